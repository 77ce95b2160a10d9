"""blujax.kernels.layer_norm / add_layer_norm against the jnp spec (blujax.kernels.xla).

Runs the CPU kernels on CPU and the CUDA kernels wherever JAX runs on a GPU.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

from blujax import kernels as ops
from blujax.kernels import xla as spec
from tests.util import assert_close, cpu_float64, mesh_devices, randn

DTYPES = [jnp.float32, jnp.bfloat16]
# C = 1, 3 and 1001 take the any-shape path, 40000 is wider than the register path holds; the
# leading shapes give rows that are not multiples of any block size (1 to 4300 rows; on a GPU,
# 4099 rows of 768 and 1100 of 2048 make the backward's groups take several rows each). On a
# GPU, bfloat16 C = 200, 264, 768 and 1000 take the pack-a-thread backward with groups of 1 to
# 4 warps, the row's last warp partly past its end at 200, 264 and 1000 (4300 and 2500 rows
# make those groups loop).
SHAPES = [
    (1,), (5, 1), (7, 3), (3, 5, 3), (4300, 200), (2500, 264), (768,), (1037, 768), (4099, 768),
    (2, 3, 5, 768), (11, 1000), (3, 5, 1000), (2, 1001), (1100, 2048), (33, 3072), (4096,),
    (2, 9, 4096), (5, 6000), (3, 40000),
]


def _params(rng, c, dtype):
    return randn(rng, (c,), dtype, 0.5, 1.0), randn(rng, (c,), dtype, 0.5)


def _loss(fn, ct):
    """A scalar whose gradient sends a random cotangent into every output of fn."""
    def loss(*args):
        outs = fn(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(outs, ct))
    return loss


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_layer_norm_values_and_grads(rng, shape, dtype):
    x = randn(rng, shape, dtype, 2.0, 0.3)
    w, b = _params(rng, shape[-1], dtype)
    assert_close(ops.layer_norm(x, w, b), spec.layer_norm(x, w, b), dtype)

    ct = (randn(rng, shape, jnp.float32),)
    got = jax.grad(_loss(ops.layer_norm, ct), argnums=(0, 1, 2))(x, w, b)
    want = jax.grad(_loss(spec.layer_norm, ct), argnums=(0, 1, 2))(x, w, b)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert_close(g, r, dtype, factor=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(3,), (7, 3), (2500, 264), (1037, 768), (2, 3, 5, 768),
                                   (2, 1001), (2, 9, 4096), (3, 40000)], ids=str)
def test_add_layer_norm_values_and_grads(rng, shape, dtype):
    x, r = randn(rng, shape, dtype), randn(rng, shape, dtype, 3.0)
    w, b = _params(rng, shape[-1], dtype)
    y, s = ops.add_layer_norm(x, r, w, b, eps=1e-6)
    y_ref, s_ref = spec.add_layer_norm(x, r, w, b, eps=1e-6)
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(s_ref, np.float32))
    assert_close(y, y_ref, dtype)

    # Cotangents on both outputs: the sum feeds the next residual in a transformer block.
    ct = (randn(rng, shape, jnp.float32), randn(rng, shape, jnp.float32))
    f = functools.partial(ops.add_layer_norm, eps=1e-6)
    f_ref = functools.partial(spec.add_layer_norm, eps=1e-6)
    got = jax.grad(_loss(f, ct), argnums=(0, 1, 2, 3))(x, r, w, b)
    want = jax.grad(_loss(f_ref, ct), argnums=(0, 1, 2, 3))(x, r, w, b)
    for g, ref in zip(got, want):
        assert_close(g, ref, dtype, factor=2)


# C = 1, 3, 1001 and 40000 take the any-shape paths; 768, 1000 and 2048 the register paths with
# several groups a backward block, 6000 with one; leading ranks 0 to 3, odd row counts (4099
# and 1100: the backward's groups loop on a GPU).
XBIAS_SHAPES = [(1,), (5, 1), (7, 3), (3, 5, 3), (768,), (1037, 768), (4099, 768),
                (2, 3, 5, 768), (11, 1000), (3, 5, 1000), (2, 1001), (9, 2048), (1100, 2048),
                (3, 6000), (3, 40000)]


def _add_bias(f, eps=1e-5):
    """f's add_layer_norm with x_bias as the second positional argument, for jax.grad."""
    return lambda x, xb, r, w, b: f(x, r, w, b, x_bias=xb, eps=eps)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", XBIAS_SHAPES, ids=str)
def test_add_bias_layer_norm_values_and_grads(rng, shape, dtype):
    x, r = randn(rng, shape, dtype), randn(rng, shape, dtype, 3.0)
    xb = randn(rng, shape[-1:], dtype, 0.5)
    w, b = _params(rng, shape[-1], dtype)
    f, f_ref = _add_bias(ops.add_layer_norm, 1e-6), _add_bias(spec.add_layer_norm, 1e-6)
    y, s = f(x, xb, r, w, b)
    y_ref, s_ref = f_ref(x, xb, r, w, b)
    assert y.dtype == s.dtype == dtype and y.shape == s.shape == shape
    # The same float32 sum (x + x_bias) + residual, rounded once.
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(s_ref, np.float32))
    assert_close(y, y_ref, dtype)

    ct = (randn(rng, shape, jnp.float32), randn(rng, shape, jnp.float32))
    got = jax.grad(_loss(f, ct), argnums=(0, 1, 2, 3, 4))(x, xb, r, w, b)
    want = jax.grad(_loss(f_ref, ct), argnums=(0, 1, 2, 3, 4))(x, xb, r, w, b)
    for g, ref in zip(got, want):
        assert g.dtype == ref.dtype and g.shape == ref.shape
        assert_close(g, ref, dtype, factor=2)


def test_add_bias_layer_norm_jit_and_vmap(rng):
    x, r = randn(rng, (5, 3, 128), jnp.float32), randn(rng, (5, 3, 128), jnp.float32)
    xb = randn(rng, (128,), jnp.float32)
    w, b = _params(rng, 128, jnp.float32)
    f, f_ref = _add_bias(ops.add_layer_norm), _add_bias(spec.add_layer_norm)
    for got, want in zip(jax.jit(f)(x, xb, r, w, b), f_ref(x, xb, r, w, b)):
        assert_close(got, want, jnp.float32)
    # Shared parameters: the batch axis becomes more rows of one kernel call.
    batched = jax.vmap(f, (0, None, 0, None, None))(x, xb, r, w, b)
    for got, want in zip(batched, f_ref(x, xb, r, w, b)):
        assert_close(got, want, jnp.float32)
    # Per-example gradients of x_bias (the backward runs once per batch member).
    def per_ex(f):
        loss = lambda x, xb, r: jnp.sum(jnp.sin(f(x, xb, r, w, b)[0]) * f(x, xb, r, w, b)[1])
        return jax.jit(jax.vmap(jax.grad(loss, 1), (0, None, 0)))(x, xb, r)
    assert_close(per_ex(f), per_ex(f_ref), jnp.float32, factor=5)


def test_add_bias_layer_norm_is_one_pass(rng):
    # The bias add and its gradient's row sum happen in our kernels, not in XLA ops around them;
    # without x_bias, the call is the plain add variant as before.
    x, r = randn(rng, (6, 64), jnp.float32), randn(rng, (6, 64), jnp.float32)
    xb = randn(rng, (64,), jnp.float32)
    w, b = _params(rng, 64, jnp.float32)

    def vjp(x, xb, r, w, b, dy, ds):
        return jax.vjp(_add_bias(ops.add_layer_norm), x, xb, r, w, b)[1]((dy, ds))

    hlo = jax.jit(vjp).lower(x, xb, r, w, b, x, r).as_text()
    assert "blujax_add_bias_layer_norm_fwd" in hlo and "blujax_add_bias_layer_norm_bwd" in hlo
    assert "stablehlo.reduce" not in hlo and "stablehlo.add" not in hlo
    hlo = jax.jit(ops.add_layer_norm).lower(x, r, w, b).as_text()
    assert "blujax_add_layer_norm_fwd" in hlo and "bias_layer_norm" not in hlo


def test_eps_is_used(rng):
    x = randn(rng, (4, 64), jnp.float32, 1e-2)
    w, b = _params(rng, 64, jnp.float32)
    for eps in (0.0, 1e-5, 0.1):
        assert_close(ops.layer_norm(x, w, b, eps=eps), spec.layer_norm(x, w, b, eps=eps),
                     jnp.float32)


def test_empty_rows(rng):
    x = jnp.zeros((0, 768), jnp.float32)
    w, b = _params(rng, 768, jnp.float32)
    assert ops.layer_norm(x, w, b).shape == (0, 768)
    dw, db = jax.grad(lambda w, b: ops.layer_norm(x, w, b).sum(), argnums=(0, 1))(w, b)
    np.testing.assert_array_equal(dw, 0.0)
    np.testing.assert_array_equal(db, 0.0)


@pytest.mark.parametrize("shape", [(3,), (4, 3), (2, 3, 17), (5, 64)], ids=str)
def test_check_grads_float64(rng, shape):
    with cpu_float64():
        x = randn(rng, shape, jnp.float64)
        r = randn(rng, shape, jnp.float64)
        w, b = _params(rng, shape[-1], jnp.float64)
        assert ops.layer_norm(x, w, b).dtype == jnp.float64
        assert_close(ops.layer_norm(x, w, b), spec.layer_norm(x, w, b), jnp.float64)
        check_grads(ops.layer_norm, (x, w, b), order=1, modes=("rev",))
        check_grads(lambda *a: ops.add_layer_norm(*a)[0] * 2 + ops.add_layer_norm(*a)[1],
                    (x, r, w, b), order=1, modes=("rev",))
        xb = randn(rng, shape[-1:], jnp.float64)
        f = _add_bias(ops.add_layer_norm)
        for got, want in zip(f(x, xb, r, w, b), _add_bias(spec.add_layer_norm)(x, xb, r, w, b)):
            assert got.dtype == jnp.float64
            assert_close(got, want, jnp.float64)
        check_grads(lambda *a: f(*a)[0] * 2 + f(*a)[1], (x, xb, r, w, b), order=1,
                    modes=("rev",))


def test_jit_and_remat(rng):
    x = randn(rng, (6, 7, 96), jnp.float32)
    w, b = _params(rng, 96, jnp.float32)
    f = jax.jit(lambda x, w, b: ops.layer_norm(ops.layer_norm(x, w, b), w, b))
    f_ref = lambda x, w, b: spec.layer_norm(spec.layer_norm(x, w, b), w, b)
    assert_close(f(x, w, b), f_ref(x, w, b), jnp.float32)
    g = jax.jit(jax.grad(lambda x: jax.checkpoint(f)(x, w, b).sum() ** 2))(x)
    g_ref = jax.grad(lambda x: f_ref(x, w, b).sum() ** 2)(x)
    assert_close(g, g_ref, jnp.float32, factor=50)


def test_vmap(rng):
    x = randn(rng, (5, 3, 128), jnp.float32)
    w, b = _params(rng, 128, jnp.float32)
    # Shared parameters: the batch axis becomes more rows of one kernel call.
    assert_close(jax.vmap(ops.layer_norm, (0, None, None))(x, w, b), spec.layer_norm(x, w, b),
                 jnp.float32)
    # Per-example gradients of the parameters.
    per_ex = jax.vmap(jax.grad(lambda x, w: (ops.layer_norm(x, w, b) ** 2).sum(), 1), (0, None))
    per_ex_ref = jax.vmap(jax.grad(lambda x, w: (spec.layer_norm(x, w, b) ** 2).sum(), 1),
                          (0, None))
    assert_close(per_ex(x, w), per_ex_ref(x, w), jnp.float32, factor=5)


@pytest.mark.parametrize("with_x_bias", [False, True], ids=["plain", "x_bias"])
def test_shard_map(rng, with_x_bias):
    devices = mesh_devices()
    mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=devices)
    x = randn(rng, (4 * len(devices), 5, 256), jnp.float32)
    r = randn(rng, x.shape, jnp.float32)
    w, b = _params(rng, 256, jnp.float32)
    xb = randn(rng, (256,), jnp.float32)

    def loss(op, x, r, w, b, xb):
        y, s = op(x, r, w, b, x_bias=xb if with_x_bias else None)
        return jnp.sum(jnp.sin(y) * s)

    @jax.jit
    def sharded(x, r, w, b, xb):
        def body(x, r, w, b, xb):
            # Replicated w, b (and x_bias) meet row-sharded x: their gradients are summed over
            # "data".
            return jax.lax.psum(loss(ops.add_layer_norm, x, r, w, b, xb), "data")
        return jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data"), P(), P(), P()),
                             out_specs=P())(x, r, w, b, xb)

    argnums = (0, 1, 2, 3, 4) if with_x_bias else (0, 1, 2, 3)
    got = jax.value_and_grad(sharded, argnums=argnums)(x, r, w, b, xb)
    want = jax.value_and_grad(functools.partial(loss, spec.add_layer_norm),
                              argnums=argnums)(x, r, w, b, xb)
    assert_close(got[0], want[0], jnp.float32)
    for g, ref in zip(got[1], want[1]):
        assert_close(g, ref, jnp.float32, factor=5)
    hlo = sharded.lower(x, r, w, b, xb).as_text()
    target = "blujax_add_bias_layer_norm_fwd" if with_x_bias else "blujax_add_layer_norm_fwd"
    assert target in hlo and "all-gather" not in hlo


# --- errors a user can act on, at trace time ----------------------------------------------------

def test_bad_arguments_raise_clear_errors(rng):
    x = randn(rng, (4, 8), jnp.float32)
    w, b = _params(rng, 8, jnp.float32)
    with pytest.raises(ValueError, match="at least one axis"):
        ops.layer_norm(jnp.float32(1.0), w[:1], b[:1])
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        ops.layer_norm(x, w[:7], b)
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        ops.layer_norm(x, w, jnp.ones((2, 8)))
    with pytest.raises(TypeError, match="dtype int32"):
        ops.layer_norm(x.astype(jnp.int32), w.astype(jnp.int32), b.astype(jnp.int32))
    with pytest.raises(TypeError, match="dtype float16"):
        ops.layer_norm(x.astype(jnp.float16), w.astype(jnp.float16), b.astype(jnp.float16))
    with pytest.raises(TypeError, match="weight is bfloat16 but x is float32"):
        ops.layer_norm(x, w.astype(jnp.bfloat16), b)
    with pytest.raises(ValueError, match="eps"):
        ops.layer_norm(x, w, b, eps=-1.0)
    with pytest.raises(ValueError, match="last axis of x is empty"):
        ops.layer_norm(jnp.ones((3, 0)), jnp.ones((0,)), jnp.ones((0,)))
    with pytest.raises(ValueError, match="residual must match x"):
        ops.add_layer_norm(x, x[:2], w, b)
    with pytest.raises(ValueError, match=r"x_bias must have shape \(8,\)"):
        ops.add_layer_norm(x, x, w, b, x_bias=b[:7])
    with pytest.raises(ValueError, match=r"x_bias must have shape \(8,\)"):
        ops.add_layer_norm(x, x, w, b, x_bias=x)  # a bias per row is not a matmul's bias
    with pytest.raises(ValueError, match=r"x_bias must have shape \(8,\)"):
        ops.add_layer_norm(x, x, w, b, x_bias=jnp.float32(1.0))
    with pytest.raises(TypeError, match="x_bias is bfloat16 but x is float32"):
        ops.add_layer_norm(x, x, w, b, x_bias=b.astype(jnp.bfloat16))


# --- handlers fed inconsistent buffers directly -------------------------------------------------

def _raw(target, outs, *args, **attrs):
    return jax.jit(lambda *a: jax.ffi.ffi_call(target, outs)(*a, **attrs))(*args)


@pytest.mark.parametrize("case", ["weight_size", "stats_size", "stats_dtype", "y_dtype",
                                  "x_dtype", "eps_nan", "workspace", "dx_size"])
def test_handler_rejects_inconsistent_buffers(rng, case):
    x = randn(rng, (4, 8), jnp.float32)
    w, b = _params(rng, 8, jnp.float32)
    sds = jax.ShapeDtypeStruct
    y, st = sds((4, 8), jnp.float32), sds((4,), jnp.float32)
    fwd = "blujax_layer_norm_fwd"
    eps = np.float32(1e-5)
    calls = {
        "weight_size": lambda: _raw(fwd, (y, st, st), x, w[:5], b, eps=eps),
        "stats_size": lambda: _raw(fwd, (y, sds((3,), jnp.float32), st), x, w, b, eps=eps),
        "stats_dtype": lambda: _raw(fwd, (y, sds((4,), jnp.int32), st), x, w, b, eps=eps),
        "y_dtype": lambda: _raw(fwd, (sds((4, 8), jnp.bfloat16), st, st), x, w, b, eps=eps),
        "x_dtype": lambda: _raw(fwd, (sds((4, 8), jnp.int32), st, st), x.astype(jnp.int32),
                                w.astype(jnp.int32), b.astype(jnp.int32), eps=eps),
        "eps_nan": lambda: _raw(fwd, (y, st, st), x, w, b, eps=np.float32("nan")),
        "workspace": lambda: _raw("blujax_layer_norm_bwd", (y, sds((8,), jnp.float32),
                                  sds((8,), jnp.float32), sds((3, 5), jnp.float32)),
                                  x, x, w, x[:, 0], x[:, 0]),
        "dx_size": lambda: _raw("blujax_layer_norm_bwd", (sds((4, 9), jnp.float32),
                                sds((8,), jnp.float32), sds((8,), jnp.float32),
                                sds((1, 2, 8), jnp.float32)), x, x, w, x[:, 0], x[:, 0]),
    }
    with pytest.raises(Exception, match="blujax_layer_norm_(fwd|bwd): "):
        jax.block_until_ready(calls[case]())


@pytest.mark.parametrize("case", ["x_bias_size", "x_bias_dtype", "residual_size", "sum_dtype",
                                  "dsum_size", "dx_bias_size", "dx_bias_dtype", "workspace"])
def test_add_bias_handler_rejects_inconsistent_buffers(rng, case):
    x = randn(rng, (4, 8), jnp.float32)
    w, b = _params(rng, 8, jnp.float32)
    sds = jax.ShapeDtypeStruct
    y, st, p = sds((4, 8), jnp.float32), sds((4,), jnp.float32), sds((8,), jnp.float32)
    ws = sds((1, 3, 8), jnp.float32)
    fwd, bwd = "blujax_add_bias_layer_norm_fwd", "blujax_add_bias_layer_norm_bwd"
    eps = np.float32(1e-5)
    m = x[:, 0]
    calls = {  # case: (call, what the handler says)
        "x_bias_size": (lambda: _raw(fwd, (y, y, st, st), x, b[:7], x, w, b, eps=eps),
                        "x_bias has shape"),
        "x_bias_dtype": (lambda: _raw(fwd, (y, y, st, st), x, b.astype(jnp.bfloat16), x, w, b,
                                      eps=eps), "x_bias must be float32"),
        "residual_size": (lambda: _raw(fwd, (y, y, st, st), x, b, x[:3], w, b, eps=eps),
                          "residual has shape"),
        "sum_dtype": (lambda: _raw(fwd, (y, sds((4, 8), jnp.bfloat16), st, st), x, b, x, w, b,
                                   eps=eps), "sum is bfloat16"),
        "dsum_size": (lambda: _raw(bwd, (y, p, p, p, ws), x, x[:, :7], x, w, m, m),
                      "dsum has shape"),
        "dx_bias_size": (lambda: _raw(bwd, (y, p, p, sds((9,), jnp.float32), ws), x, x, x, w, m,
                                      m), "dx_bias has shape"),
        "dx_bias_dtype": (lambda: _raw(bwd, (y, p, p, sds((8,), jnp.int32), ws), x, x, x, w, m,
                                       m), "dx_bias must be float32"),
        # Room for the dweight and dbias partials only, not the third row this variant needs.
        "workspace": (lambda: _raw(bwd, (y, p, p, p, sds((1, 2, 8), jnp.float32)), x, x, x, w,
                                   m, m), "workspace must hold P x 3 x 8"),
    }
    call, message = calls[case]
    with pytest.raises(Exception, match=f"blujax_add_bias_layer_norm_(fwd|bwd): {message}"):
        jax.block_until_ready(call())


@pytest.mark.gpu
def test_cuda_rejects_float64_buffers(rng):
    x = np.ones((4, 8), np.float64)
    with jax.enable_x64(True):
        sds = jax.ShapeDtypeStruct
        with pytest.raises(Exception, match="unsupported dtype float64"):
            jax.block_until_ready(_raw("blujax_layer_norm_fwd", (
                sds((4, 8), jnp.float64), sds((4,), jnp.float64), sds((4,), jnp.float64)),
                x, x[0], x[0], eps=np.float32(1e-5)))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_cuda_large_rows(rng, dtype):
    # Many more rows than blocks: every block loops, and the backward reduces its partials.
    x = randn(rng, (16411, 768), dtype)
    w, b = _params(rng, 768, dtype)
    assert_close(ops.layer_norm(x, w, b), spec.layer_norm(x, w, b), dtype)
    ct = (randn(rng, x.shape, jnp.float32),)
    got = jax.grad(_loss(ops.layer_norm, ct), argnums=(0, 1, 2))(x, w, b)
    want = jax.grad(_loss(spec.layer_norm, ct), argnums=(0, 1, 2))(x, w, b)
    for g, r in zip(got, want):
        assert_close(g, r, dtype, factor=2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(16411, 768), (4099, 1001)], ids=str)
def test_cuda_add_bias_large_rows(rng, shape, dtype):
    # Every block loops over many rows, and the backward reduces three partial rows per block
    # (register path at C = 768, any-shape path at C = 1001).
    x, r = randn(rng, shape, dtype), randn(rng, shape, dtype, 3.0)
    xb = randn(rng, shape[-1:], dtype, 0.5)
    w, b = _params(rng, shape[-1], dtype)
    f, f_ref = _add_bias(ops.add_layer_norm), _add_bias(spec.add_layer_norm)
    for got, want in zip(f(x, xb, r, w, b), f_ref(x, xb, r, w, b)):
        assert_close(got, want, dtype)
    ct = (randn(rng, shape, jnp.float32), randn(rng, shape, jnp.float32))
    got = jax.grad(_loss(f, ct), argnums=(0, 1, 2, 3, 4))(x, xb, r, w, b)
    want = jax.grad(_loss(f_ref, ct), argnums=(0, 1, 2, 3, 4))(x, xb, r, w, b)
    for g, ref in zip(got, want):
        assert_close(g, ref, dtype, factor=2)
