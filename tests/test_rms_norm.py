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
