"""blujax.kernels.rms_norm / add_rms_norm against the jnp spec (blujax.kernels.xla).

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
gpu = pytest.mark.gpu
# On a GPU: C = 1, 3 and 1001 take the any-shape paths (not a multiple of the pack); 200, 264,
# 768, 1000, 2048, 3072, 4096 and 6000 the register paths with groups of 32 to 1024 threads,
# some of a group's lanes past the row's end at 200, 264 and 1000; 20000 the register forward
# and the any-shape backward (wider than the backward's registers hold), 40000 the any-shape
# path both ways. Leading ranks 0 to 3 and row counts that are no multiple of a block's rows;
# the larger row counts (GPU only, as they only add CPU time) make the forward's and the
# backward's groups loop over many rows.
SHAPES = [
    (1,), (5, 1), (7, 3), (3, 5, 3), (768,), (37, 768), (2, 3, 5, 768), (11, 1000), (2, 1001),
    (3, 200), (5, 264), (9, 2048), (3, 3072), (2, 3, 4096), (5, 6000), (3, 20000), (2, 40000),
    pytest.param((4300, 200), marks=gpu), pytest.param((2500, 264), marks=gpu),
    pytest.param((4099, 768), marks=gpu), pytest.param((1100, 2048), marks=gpu),
    pytest.param((33, 3072), marks=gpu), pytest.param((2, 9, 4096), marks=gpu),
    pytest.param((1037, 1001), marks=gpu), pytest.param((65, 20000), marks=gpu),
]
ADD_SHAPES = [
    (3,), (7, 3), (37, 768), (2, 3, 5, 768), (2, 1001), (5, 264), (2, 3, 4096), (3, 20000),
    (2, 40000), pytest.param((2500, 264), marks=gpu), pytest.param((4099, 768), marks=gpu),
    pytest.param((2, 9, 4096), marks=gpu), pytest.param((1037, 1001), marks=gpu),
]


def _weight(rng, c, dtype):
    return randn(rng, (c,), dtype, 0.5, 1.0)


def _loss(fn, ct):
    """A scalar whose gradient sends a random cotangent into every output of fn."""
    def loss(*args):
        outs = fn(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(outs, ct))
    return loss


def _values_and_grads(fn, ct, *args):
    """fn(*args) and the gradients of _loss(fn, ct) for all args, as one jitted program (one
    compilation rather than one per jnp op, which is most of the CPU time of these tests)."""
    argnums = tuple(range(len(args)))
    return jax.jit(lambda *a: (fn(*a), jax.grad(_loss(fn, ct), argnums)(*a)))(*args)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm_values_and_grads(rng, shape, dtype):
    x = randn(rng, shape, dtype, 2.0, 0.3)
    w = _weight(rng, shape[-1], dtype)
    ct = (randn(rng, shape, jnp.float32),)
    y, got = _values_and_grads(ops.rms_norm, ct, x, w)
    y_ref, want = _values_and_grads(spec.rms_norm, ct, x, w)
    assert y.dtype == dtype and y.shape == shape
    assert_close(y, y_ref, dtype)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert_close(g, r, dtype, factor=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", ADD_SHAPES, ids=str)
def test_add_rms_norm_values_and_grads(rng, shape, dtype):
    x, r = randn(rng, shape, dtype), randn(rng, shape, dtype, 3.0)
    w = _weight(rng, shape[-1], dtype)
    # Cotangents on both outputs: the sum feeds the next residual in a transformer block.
    ct = (randn(rng, shape, jnp.float32), randn(rng, shape, jnp.float32))
    f = functools.partial(ops.add_rms_norm, eps=1e-6)
    f_ref = functools.partial(spec.add_rms_norm, eps=1e-6)
    (y, s), got = _values_and_grads(f, ct, x, r, w)
    (y_ref, s_ref), want = _values_and_grads(f_ref, ct, x, r, w)
    assert y.dtype == s.dtype == dtype and y.shape == s.shape == shape
    # The same sum, rounded to x's dtype once.
    np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(s_ref, np.float32))
    assert_close(y, y_ref, dtype)
    for g, ref in zip(got, want):
        assert g.dtype == ref.dtype and g.shape == ref.shape
        assert_close(g, ref, dtype, factor=2)


def test_add_rms_norm_is_one_pass(rng):
    # The add and the gradient of both of its terms happen in our kernels, not in XLA ops
    # around them.
    x, r = randn(rng, (6, 64), jnp.float32), randn(rng, (6, 64), jnp.float32)
    w = _weight(rng, 64, jnp.float32)

    def vjp(x, r, w, dy, ds):
        return jax.vjp(ops.add_rms_norm, x, r, w)[1]((dy, ds))

    hlo = jax.jit(vjp).lower(x, r, w, x, r).as_text()
    assert "blujax_add_rms_norm_fwd" in hlo and "blujax_add_rms_norm_bwd" in hlo
    assert "stablehlo.reduce" not in hlo and "stablehlo.add" not in hlo


def test_lowers_for_cuda_without_a_gpu():
    # One custom call per direction, the same target names on the CUDA platform.
    x, w = jnp.ones((4, 8)), jnp.ones((8,))
    for op, name in ((lambda x: ops.rms_norm(x, w), "rms_norm"),
                     (lambda x: ops.add_rms_norm(x, x, w)[0], "add_rms_norm")):
        f = jax.jit(jax.grad(lambda x: op(x).sum()))
        hlo = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
        assert f"blujax_{name}_fwd" in hlo and f"blujax_{name}_bwd" in hlo


def test_eps_is_used(rng):
    x = randn(rng, (4, 64), jnp.float32, 1e-2)
    w = _weight(rng, 64, jnp.float32)
    for eps in (0.0, 1e-5, 0.1):
        assert_close(ops.rms_norm(x, w, eps=eps), spec.rms_norm(x, w, eps=eps), jnp.float32)


def test_eps_is_exact_in_float64(rng):
    # eps travels as a float64 attribute: with mean(x^2) ~ eps, rounding it to float32 would
    # move y by ~1e-8 relative, far more than float64's rounding.
    with cpu_float64():
        x = randn(rng, (3, 16), jnp.float64, 3e-3)
        w = _weight(rng, 16, jnp.float64)
        eps = 1e-5 + 1e-12
        got, want = ops.rms_norm(x, w, eps=eps), spec.rms_norm(x, w, eps=eps)
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=0)
        rounded = spec.rms_norm(x, w, eps=float(np.float32(eps)))
        assert np.max(np.abs(rounded - want)) > 1e3 * np.max(np.abs(got - want))


def test_empty_rows(rng):
    x = jnp.zeros((0, 768), jnp.float32)
    w = _weight(rng, 768, jnp.float32)
    assert ops.rms_norm(x, w).shape == (0, 768)
    dw = jax.grad(lambda w: ops.rms_norm(x, w).sum())(w)
    np.testing.assert_array_equal(dw, 0.0)
    dw = jax.grad(lambda w: sum(o.sum() for o in ops.add_rms_norm(x, x, w)))(w)
    np.testing.assert_array_equal(dw, 0.0)


@pytest.mark.parametrize("shape", [(3,), (4, 3), (2, 3, 17), (5, 64)], ids=str)
def test_check_grads_float64(rng, shape):
    with cpu_float64():
        x, r = randn(rng, shape, jnp.float64), randn(rng, shape, jnp.float64)
        w = _weight(rng, shape[-1], jnp.float64)
        assert ops.rms_norm(x, w).dtype == jnp.float64
        assert_close(ops.rms_norm(x, w), spec.rms_norm(x, w), jnp.float64)
        for got, want in zip(ops.add_rms_norm(x, r, w), spec.add_rms_norm(x, r, w)):
            assert got.dtype == jnp.float64
            assert_close(got, want, jnp.float64)
        check_grads(ops.rms_norm, (x, w), order=1, modes=("rev",))
        check_grads(lambda *a: ops.add_rms_norm(*a)[0] * 2 + ops.add_rms_norm(*a)[1],
                    (x, r, w), order=1, modes=("rev",))


def test_jit_and_remat(rng):
    x = randn(rng, (6, 7, 96), jnp.float32)
    w = _weight(rng, 96, jnp.float32)
    f = jax.jit(lambda x, w: ops.rms_norm(ops.add_rms_norm(x, x, w)[0], w))
    f_ref = lambda x, w: spec.rms_norm(spec.add_rms_norm(x, x, w)[0], w)
    assert_close(f(x, w), f_ref(x, w), jnp.float32)
    g = jax.jit(jax.grad(lambda x: jax.checkpoint(f)(x, w).sum() ** 2))(x)
    g_ref = jax.grad(lambda x: f_ref(x, w).sum() ** 2)(x)
    assert_close(g, g_ref, jnp.float32, factor=50)


def test_vmap(rng):
    x, r = randn(rng, (5, 3, 128), jnp.float32), randn(rng, (5, 3, 128), jnp.float32)
    w = _weight(rng, 128, jnp.float32)
    # Shared weight: the batch axis becomes more rows of one kernel call.
    assert_close(jax.vmap(ops.rms_norm, (0, None))(x, w), spec.rms_norm(x, w), jnp.float32)
    for got, want in zip(jax.vmap(ops.add_rms_norm, (0, 0, None))(x, r, w),
                         spec.add_rms_norm(x, r, w)):
        assert_close(got, want, jnp.float32)

    # Per-example gradients of the weight (the backward runs once per batch member).
    def per_ex(rms, add):
        loss = lambda x, r, w: (jnp.sin(rms(x, w)) * add(x, r, w)[1]).sum()
        return jax.jit(jax.vmap(jax.grad(loss, (0, 2)), (0, 0, None)))(x, r, w)
    for got, want in zip(per_ex(ops.rms_norm, ops.add_rms_norm),
                         per_ex(spec.rms_norm, spec.add_rms_norm)):
        assert_close(got, want, jnp.float32, factor=5)


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "add"])
def test_shard_map(rng, fused):
    devices = mesh_devices()
    mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=devices)
    x = randn(rng, (4 * len(devices), 5, 256), jnp.float32)
    r = randn(rng, x.shape, jnp.float32)
    w = _weight(rng, 256, jnp.float32)

    def loss(kernels, x, r, w):
        if fused:
            y, s = kernels.add_rms_norm(x, r, w)
            return jnp.sum(jnp.sin(y) * s)
        return jnp.sum(jnp.sin(kernels.rms_norm(x, w)) * r)

    @jax.jit
    def sharded(x, r, w):
        def body(x, r, w):
            # A replicated weight meets row-sharded x: its gradient is summed over "data".
            return jax.lax.psum(loss(ops, x, r, w), "data")
        return jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P("data"), P()),
                             out_specs=P())(x, r, w)

    argnums = (0, 1, 2) if fused else (0, 2)
    got = jax.value_and_grad(sharded, argnums=argnums)(x, r, w)
    want = jax.value_and_grad(functools.partial(loss, spec), argnums=argnums)(x, r, w)
    assert_close(got[0], want[0], jnp.float32)
    for g, ref in zip(got[1], want[1]):
        assert_close(g, ref, jnp.float32, factor=5)
    hlo = sharded.lower(x, r, w).as_text()
    target = "blujax_add_rms_norm_fwd" if fused else "blujax_rms_norm_fwd"
    assert target in hlo and "all-gather" not in hlo


# --- errors a user can act on, at trace time ----------------------------------------------------

def test_bad_arguments_raise_clear_errors(rng):
    x = randn(rng, (4, 8), jnp.float32)
    w = _weight(rng, 8, jnp.float32)
    with pytest.raises(ValueError, match="at least one axis"):
        ops.rms_norm(jnp.float32(1.0), w[:1])
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        ops.rms_norm(x, w[:7])
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        ops.rms_norm(x, jnp.ones((2, 8)))
    with pytest.raises(TypeError, match="dtype int32"):
        ops.rms_norm(x.astype(jnp.int32), w.astype(jnp.int32))
    with pytest.raises(TypeError, match="dtype float16"):
        ops.rms_norm(x.astype(jnp.float16), w.astype(jnp.float16))
    with pytest.raises(TypeError, match="weight is bfloat16 but x is float32"):
        ops.rms_norm(x, w.astype(jnp.bfloat16))
    for eps in (-1.0, float("nan"), float("inf"), "1e-5", True):
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            ops.rms_norm(x, w, eps=eps)
    with pytest.raises(ValueError, match="last axis of x is empty"):
        ops.rms_norm(jnp.ones((3, 0)), jnp.ones((0,)))
    with pytest.raises(ValueError, match="residual must match x"):
        ops.add_rms_norm(x, x[:2], w)
    with pytest.raises(ValueError, match="residual must match x"):
        ops.add_rms_norm(x, x.astype(jnp.bfloat16), w)
    with pytest.raises(TypeError, match="weight is bfloat16 but x is float32"):
        ops.add_rms_norm(x, x, w.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="eps"):
        ops.add_rms_norm(x, x, w, eps=-1e-5)


# --- handlers fed inconsistent buffers directly -------------------------------------------------

def _raw(target, outs, *args, **attrs):
    return jax.jit(lambda *a: jax.ffi.ffi_call(target, outs)(*a, **attrs))(*args)


@pytest.mark.parametrize("case", [
    "weight_size", "weight_dtype", "rstd_size", "rstd_dtype", "y_dtype", "x_dtype", "eps_nan",
    "eps_negative", "residual_size", "sum_dtype", "dy_size", "dsum_size", "dx_size",
    "dweight_size", "workspace_dtype", "workspace_size",
])
def test_handler_rejects_inconsistent_buffers(rng, case):
    x = randn(rng, (4, 8), jnp.float32)
    w = _weight(rng, 8, jnp.float32)
    sds = jax.ShapeDtypeStruct
    y, st, p = sds((4, 8), jnp.float32), sds((4,), jnp.float32), sds((8,), jnp.float32)
    ws = sds((1, 8), jnp.float32)
    fwd, add_fwd = "blujax_rms_norm_fwd", "blujax_add_rms_norm_fwd"
    bwd, add_bwd = "blujax_rms_norm_bwd", "blujax_add_rms_norm_bwd"
    eps = np.float64(1e-5)
    m = x[:, 0]
    calls = {  # case: (target, call, what the handler says)
        "weight_size": (fwd, lambda: _raw(fwd, (y, st), x, w[:5], eps=eps), "weight has shape"),
        "weight_dtype": (fwd, lambda: _raw(fwd, (y, st), x, w.astype(jnp.bfloat16), eps=eps),
                         "weight must be float32"),
        "rstd_size": (fwd, lambda: _raw(fwd, (y, sds((3,), jnp.float32)), x, w, eps=eps),
                      "rstd has shape"),
        "rstd_dtype": (fwd, lambda: _raw(fwd, (y, sds((4,), jnp.int32)), x, w, eps=eps),
                       "rstd must be float32"),
        "y_dtype": (fwd, lambda: _raw(fwd, (sds((4, 8), jnp.bfloat16), st), x, w, eps=eps),
                    "y is bfloat16"),
        "x_dtype": (fwd, lambda: _raw(fwd, (sds((4, 8), jnp.int32), st), x.astype(jnp.int32),
                                      w.astype(jnp.int32), eps=eps), "unsupported dtype int32"),
        "eps_nan": (fwd, lambda: _raw(fwd, (y, st), x, w, eps=np.float64("nan")), "eps must"),
        "eps_negative": (add_fwd, lambda: _raw(add_fwd, (y, y, st), x, x, w,
                                               eps=np.float64(-1.0)), "eps must"),
        "residual_size": (add_fwd, lambda: _raw(add_fwd, (y, y, st), x, x[:3], w, eps=eps),
                          "residual has shape"),
        "sum_dtype": (add_fwd, lambda: _raw(add_fwd, (y, sds((4, 8), jnp.bfloat16), st), x, x,
                                            w, eps=eps), "sum is bfloat16"),
        "dy_size": (bwd, lambda: _raw(bwd, (y, p, ws), x[:, :7], x, w, m), "dy has shape"),
        "dsum_size": (add_bwd, lambda: _raw(add_bwd, (y, p, ws), x, x[:, :7], x, w, m),
                      "dsum has shape"),
        "dx_size": (bwd, lambda: _raw(bwd, (sds((4, 9), jnp.float32), p, ws), x, x, w, m),
                    "dx has shape"),
        "dweight_size": (add_bwd, lambda: _raw(add_bwd, (y, sds((9,), jnp.float32), ws), x, x,
                                               x, w, m), "dweight has shape"),
        "workspace_dtype": (bwd, lambda: _raw(bwd, (y, p, sds((1, 8), jnp.bfloat16)), x, x, w,
                                              m), "workspace must be float32"),
        "workspace_size": (bwd, lambda: _raw(bwd, (y, p, sds((3, 5), jnp.float32)), x, x, w, m),
                           "workspace must hold P x 8"),
    }
    target, call, message = calls[case]
    with pytest.raises(Exception, match=f"{target}: {message}"):
        jax.block_until_ready(call())


# --- the CUDA kernels ---------------------------------------------------------------------------

@gpu
def test_cuda_rejects_float64_buffers():
    x = np.ones((4, 8), np.float64)
    with jax.enable_x64(True):
        sds = jax.ShapeDtypeStruct
        with pytest.raises(Exception, match="unsupported dtype float64"):
            jax.block_until_ready(_raw("blujax_rms_norm_fwd", (
                sds((4, 8), jnp.float64), sds((4,), jnp.float64)), x, x[0], eps=np.float64(1e-5)))


@gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(16411, 768), (8195, 4096), (4099, 1001)], ids=str)
def test_cuda_large_rows(rng, shape, dtype):
    # Many more rows than blocks: every block loops, and the backward reduces its partials,
    # in the same order every run (dweight is bitwise reproducible).
    x, r = randn(rng, shape, dtype), randn(rng, shape, dtype, 3.0)
    w = _weight(rng, shape[-1], dtype)
    for got, want in zip(ops.add_rms_norm(x, r, w), spec.add_rms_norm(x, r, w)):
        assert_close(got, want, dtype)
    ct = (randn(rng, shape, jnp.float32), randn(rng, shape, jnp.float32))
    grad = jax.jit(jax.grad(_loss(ops.add_rms_norm, ct), argnums=(0, 1, 2)))
    got = grad(x, r, w)
    want = jax.grad(_loss(spec.add_rms_norm, ct), argnums=(0, 1, 2))(x, r, w)
    for g, ref in zip(got, want):
        assert_close(g, ref, dtype, factor=2)
    np.testing.assert_array_equal(np.asarray(grad(x, r, w)[2], np.float32),
                                  np.asarray(got[2], np.float32))


# --- the FP8 form of add_rms_norm (blujax.fp8's pieces that begin with the norm) ----------------

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# Bit for bit on the CPU, whose FP8 form runs the plain forward's rows. The CUDA one sums the
# squares in another order than the plain kernel, so its rstd (and through it y) may differ in
# the last bit: its tests allow that.
EXACT = jax.default_backend() != "gpu"
# (x's shape, dtype, format, scale): odd shapes, one element, no rows at all; on a GPU, 1001 and
# 7 columns take the any-shape loads, 264 and 136 whole 16-byte packs, 130 rows a part tile of
# the 64-row ones. Scales that are not powers of two test a division, not a multiply.
_BF, _F32 = jnp.bfloat16, jnp.float32
FP8_CASES = [
    ((3, 5, 7), _F32, E4M3, 2.0 ** -5), ((3, 5, 7), _BF, E5M2, 0.37), ((1, 1), _BF, E4M3, 0.37),
    ((0, 8), _BF, E4M3, 2.0 ** -5), ((130, 72), _F32, E5M2, 2.0 ** -14),
    ((70, 1001), _BF, E4M3, 2.0 ** -5), ((64, 264), _BF, E5M2, 0.37),
    ((2, 48, 136), _F32, E4M3, 0.37),
]


def _bits(a):
    a = np.asarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def _codes(a):
    """FP8 values as integers that step by one from each code to its neighbours (and +-0 to
    0), so that |difference| counts codes."""
    b = _bits(a).astype(np.int32)
    return np.where(b & 0x80, -(b & 0x7F), b & 0x7F)


@functools.partial(jax.jit, static_argnames=("fmt", "eps"))
def _fp8_and_plain(x, r, w, scale, fmt, eps=1e-6):
    """The FP8 form's (q, qt, amax, s, rstd), and what it must equal: add_rms_norm's y cast
    (as a product would cast it), its s, and the plain forward's rstd."""
    got = ops.add_rms_norm_fwd_fp8(x, r, w, scale, fmt, eps=eps)
    y, s = ops.add_rms_norm(x, r, w, eps=eps)
    q, qt, amax = spec.fp8_copy(y.reshape(-1, x.shape[-1]), scale, fmt)
    return got, (q, qt, amax, s, _plain_rstd(x, r, w, eps))


def _plain_rstd(x, r, w, eps):
    """The rstd the plain forward saves (add_rms_norm returns only y and s)."""
    st = jax.ShapeDtypeStruct(x.shape[:-1], jnp.float32)
    return jax.ffi.ffi_call("blujax_add_rms_norm_fwd", (jax.typeof(x), jax.typeof(x), st))(
        x, r, w, eps=np.float64(eps))[2]


def _assert_fp8_form(got, want, exact=EXACT):
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    (q, qt, amax, s, rstd), (q0, qt0, amax0, s0, rstd0) = got, want
    np.testing.assert_array_equal(_bits(s), _bits(s0))  # the same sum on every platform
    np.testing.assert_array_equal(_bits(qt), _bits(q).T)
    if exact:
        for a, b in ((q, q0), (amax, amax0), (rstd, rstd0)):
            np.testing.assert_array_equal(_bits(a), _bits(b))
        return
    np.testing.assert_allclose(rstd, rstd0, rtol=1e-6, atol=0)
    codes = np.abs(_codes(q) - _codes(q0))
    moved = np.count_nonzero(codes) / max(codes.size, 1)
    assert codes.max(initial=0) <= 1 and moved < 0.01, moved
    np.testing.assert_allclose(amax, amax0, rtol=1e-2)


@pytest.mark.parametrize("shape,dtype,fmt,scale", FP8_CASES,
                         ids=lambda v: jnp.dtype(v).name if isinstance(v, type) else str(v))
def test_fp8_form_is_the_cast_of_the_kernels_output(rng, shape, dtype, fmt, scale):
    """q, qt and amax are what casting add_rms_norm's y gives, s and rstd what it computes:
    the FP8 pieces then compute what the plain norm followed by the products' cast does."""
    x, r = randn(rng, shape, dtype), randn(rng, shape, dtype, 3.0)
    w = _weight(rng, shape[-1], dtype)
    _assert_fp8_form(*_fp8_and_plain(x, r, w, jnp.float32(scale), fmt))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_fp8_form_against_the_spec(rng, dtype):
    """Against the jnp spec (y in float32 with XLA's reduction, rounded to x's dtype, then the
    cast): the kernel's own rounding of y can move a value across an FP8 rounding boundary, by
    one code at most."""
    x, r = randn(rng, (33, 72), dtype), randn(rng, (33, 72), dtype, 3.0)
    w = _weight(rng, 72, dtype)
    sc = jnp.float32(2.0 ** -6)
    q, qt, amax, s, rstd = ops.add_rms_norm_fwd_fp8(x, r, w, sc, eps=1e-6)
    # The spec op by op: jitted, XLA's CPU compiler may keep the bfloat16 sum in float32 for
    # the squares (excess precision), which is not the spec.
    q0, qt0, amax0, s0, rstd0 = spec.add_rms_norm_fwd_fp8(x, r, w, sc, eps=1e-6)
    for a, b in ((q, q0), (qt, qt0)):
        codes = np.abs(_codes(a) - _codes(b))
        assert codes.max() <= 1 and codes.mean() < 0.05
    np.testing.assert_array_equal(_bits(s), _bits(s0))
    assert_close(amax, amax0, dtype)
    assert_close(rstd, rstd0, jnp.float32)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda d: jnp.dtype(d).name)
def test_fp8_form_saturates_and_carries_nan_into_the_amax(fmt):
    # eps = 0 and rows of +-1 and +-1/4: rstd is exactly 1 and 4, so y = (+-1) * weight
    # exactly. 1e4 is beyond e4m3's 448 at scale 1 and e5m2's 57344 at scale 1/16.
    x = jnp.array([[0.25, -0.25, 0.25, 0.25], [1.0, -1.0, 1.0, 1.0]], jnp.float32)
    w = jnp.array([1e4, 1e4, 0.5, 2.0], jnp.float32)
    sc, top = (1.0, 448.0) if fmt == E4M3 else (1 / 16, 57344.0)
    f = jax.jit(lambda x: ops.add_rms_norm_fwd_fp8(x, jnp.zeros_like(x), w, jnp.float32(sc),
                                                   fmt, eps=0.0))
    want = [[top, -top, 0.5 / sc, 2.0 / sc]] * 2
    q, qt, amax, s, rstd = f(x)
    assert q.astype(jnp.float32).tolist() == want
    rtol = 0 if EXACT else 1e-6  # (CUDA's rsqrtf is not promised exact)
    np.testing.assert_allclose(rstd, [4.0, 1.0], rtol=rtol)
    np.testing.assert_allclose(amax, 1e4, rtol=rtol)
    # A NaN makes its row's rstd, and every y of the row, NaN; the amax stays NaN though
    # larger values come after it.
    q, qt, amax, s, rstd = f(x.at[0, 2].set(jnp.nan))
    assert np.isnan(float(amax)) and np.isnan(float(rstd[0]))
    assert np.isnan(np.asarray(q[0], np.float32)).all()
    assert q[1].astype(jnp.float32).tolist() == want[1]


def test_fp8_form_divides_by_the_scale():
    # y / scale, not y * (1 / scale): near the midpoints between e4m3 codes, weights w for
    # which the two round to different codes. eps = 0 and x of ones make y = w exactly (128
    # columns: mean(x^2) is exactly 1 however the kernel forms it).
    fmt, sc = E4M3, np.float32(0.37)
    codes = np.arange(256, dtype=np.uint8).view(fmt).astype(np.float32)
    v = np.unique(codes[(codes >= 1) & (codes <= 8)])
    near = ((v[:-1] + v[1:]) / 2 * sc).astype(np.float32).view(np.int32)
    w = (near[:, None] + np.arange(-2, 3, dtype=np.int32)).view(np.float32).ravel()
    w = np.concatenate([w, np.ones(128 - w.size, np.float32)])
    want = (w / sc).astype(fmt)
    assert np.sum(want != (w * (np.float32(1) / sc)).astype(fmt)) >= 4  # the data tells
    x = jnp.ones((1, w.size), jnp.float32)
    q = ops.add_rms_norm_fwd_fp8(x, jnp.zeros_like(x), jnp.asarray(w), jnp.float32(sc), fmt,
                                 eps=0.0)[0]
    np.testing.assert_array_equal(_bits(q[0]), want.view(np.uint8))


def test_add_rms_norm_bwd(rng):
    shape, eps = (5, 3, 40), 1e-6
    cases = {}
    for dtype in DTYPES:
        x, r = randn(rng, shape, dtype), randn(rng, shape, dtype, 3.0)
        cases[dtype] = (x, r, _weight(rng, shape[-1], dtype), randn(rng, shape, dtype),
                        randn(rng, shape, dtype))

    @jax.jit
    def grads(x, r, w, dy, ds):
        _, _, _, s, rstd = ops.add_rms_norm_fwd_fp8(x, r, w, jnp.float32(1.0), eps=eps)
        got = ops.add_rms_norm_bwd(dy, ds, s, w, rstd, eps=eps)
        want = jax.vjp(functools.partial(spec.add_rms_norm, eps=eps), x, r, w)[1]((dy, ds))
        # What add_rms_norm's own vjp computes, from the plain forward's rstd (the GPU FP8
        # form's may differ from it in the last bit).
        plain = ops.add_rms_norm_bwd(dy, ds, s, w, _plain_rstd(x, r, w, eps), eps=eps)
        vjp = jax.vjp(functools.partial(ops.add_rms_norm, eps=eps), x, r, w)[1]((dy, ds))
        return got, want, plain, vjp

    for dtype, args in cases.items():
        (dx, dw), (sdx, sdr, sdw), plain, (vdx, vdr, vdw) = grads(*args)
        assert dx.dtype == dw.dtype == dtype and dx.shape == shape and dw.shape == shape[-1:]
        if dtype == jnp.float32:
            assert_close(dx, sdx, dtype, factor=2)
            assert_close(dw, sdw, dtype, factor=2)
        for a, b in zip(plain, (vdx, vdw)):
            np.testing.assert_array_equal(_bits(a), _bits(b))
        np.testing.assert_array_equal(_bits(vdr), _bits(vdx))


def test_fp8_form_lowers_for_cuda_without_a_gpu():
    x, w = jnp.ones((4, 8), jnp.bfloat16), jnp.ones((8,), jnp.bfloat16)
    f = jax.jit(lambda x: ops.add_rms_norm_fwd_fp8(x, x, w, jnp.float32(1.0)))
    hlo = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "blujax_add_rms_norm_fwd_fp8" in hlo


def test_fp8_form_rejects_bad_arguments(rng):
    x = randn(rng, (4, 8), jnp.float32)
    w = _weight(rng, 8, jnp.float32)
    s = jnp.float32(1.0)
    fwd = ops.add_rms_norm_fwd_fp8
    with pytest.raises(TypeError, match="scale must be a float32 scalar"):
        fwd(x, x, w, jnp.ones(2))
    with pytest.raises(TypeError, match="scale must be a float32 scalar"):
        fwd(x, x, w, jnp.bfloat16(1.0))
    with pytest.raises(TypeError, match="float8_e4m3fn or float8_e5m2"):
        fwd(x, x, w, s, jnp.bfloat16)
    with pytest.raises(ValueError, match="residual must match x"):
        fwd(x, x[:3], w, s)
    with pytest.raises(ValueError, match="residual must match x"):
        fwd(x, x.astype(jnp.bfloat16), w, s)
    with pytest.raises(TypeError, match="weight is bfloat16 but x is float32"):
        fwd(x, x, w.astype(jnp.bfloat16), s)
    with pytest.raises(TypeError, match="x has dtype float64"):
        with jax.enable_x64(True):
            fwd(np.ones((4, 8)), np.ones((4, 8)), np.ones(8), s)
    rstd = jnp.ones((4,), jnp.float32)
    with pytest.raises(ValueError, match=r"rstd must be float32\[4\], got float32\[4, 1\]"):
        ops.add_rms_norm_bwd(x, x, x, w, rstd[:, None])
    with pytest.raises(ValueError, match=r"rstd must be float32\[4\], got bfloat16\[4\]"):
        ops.add_rms_norm_bwd(x, x, x, w, rstd.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="dsum must match s"):
        ops.add_rms_norm_bwd(x, x[:3], x, w, rstd)


@pytest.mark.parametrize("case", ["qt_shape", "amax_count", "q_dtype", "qt_dtype",
                                  "scale_dtype", "rstd_size", "sum_dtype", "x_float64"])
def test_fp8_handler_rejects_inconsistent_buffers(rng, case):
    x = randn(rng, (4, 8), jnp.float32)
    w = _weight(rng, 8, jnp.float32)
    s = jnp.float32(1.0)
    sds = jax.ShapeDtypeStruct
    q, qt, amax = sds((4, 8), E4M3), sds((8, 4), E4M3), sds((), jnp.float32)
    y, st = sds((4, 8), jnp.float32), sds((4,), jnp.float32)
    fwd, eps = "blujax_add_rms_norm_fwd_fp8", np.float64(1e-5)
    calls = {  # case: (results, what the handler says)
        "qt_shape": ((q, sds((4, 8), E4M3), amax, y, st), r"qt has shape \[4, 8\]"),
        "amax_count": ((q, qt, sds((2,), jnp.float32), y, st), "amax has shape"),
        "q_dtype": ((sds((4, 8), jnp.bfloat16), qt, amax, y, st), "q must be float8"),
        "qt_dtype": ((q, sds((8, 4), E5M2), amax, y, st), "qt is float8_e5m2 but q is"),
        "scale_dtype": ((q, qt, amax, y, st), "scale must be float32"),
        "rstd_size": ((q, qt, amax, y, sds((3,), jnp.float32)), "rstd has shape"),
        "sum_dtype": ((q, qt, amax, sds((4, 8), jnp.bfloat16), st), "sum is bfloat16"),
        "x_float64": ((q, qt, amax, sds((4, 8), jnp.float64), st), "unsupported dtype float64"),
    }
    outs, message = calls[case]
    if case == "scale_dtype":
        s = s.astype(jnp.bfloat16)
    with jax.enable_x64(case == "x_float64"):  # (the wrapper refuses float64 x at trace time)
        if case == "x_float64":
            x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
        with pytest.raises(Exception, match=f"{fwd}: {message}"):
            jax.block_until_ready(_raw(fwd, outs, x, x, w, s, eps=eps))


@gpu
@pytest.mark.parametrize("shape,dtype", [((4096, 2048), _BF), ((4099, 1001), _F32),
                                         ((2, 1500, 768), _BF), ((1037, 4096), _BF),
                                         ((70, 16384), _BF)], ids=str)
def test_cuda_fp8_form_large(rng, shape, dtype):
    # 4096 x 2048: the register path's 32-row tiles, whole; 1037 x 4096 the same, one block a
    # multiprocessor, the last tile part; 4099 x 1001 (not packed) and 70 x 16384 (a tile too
    # large for shared memory) the any-shape kernel.
    x, r = randn(rng, shape, dtype), randn(rng, shape, dtype, 3.0)
    w = _weight(rng, shape[-1], dtype)
    _assert_fp8_form(*_fp8_and_plain(x, r, w, jnp.float32(2.0 ** -6), E4M3))
