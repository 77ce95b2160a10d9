"""blujax.kernels.gelu (with and without bias) against the jnp spec (blujax.kernels.xla.gelu).

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
from tests.util import TOL, assert_close, cpu_float64, mesh_devices, randn

DTYPES = [jnp.float32, jnp.bfloat16]
# C = 1 and 3 take the CUDA any-shape path with a bias and leave a tail without one; 1000 is a
# whole number of 16-byte vectors for both dtypes but not of warp-wide tiles. Leading ranks 0 to 3;
# row counts (1 to 1037) are not multiples of any block size.
SHAPES = [
    (1,), (3,), (5, 1), (7, 3), (3, 5, 3), (2, 3, 1, 3), (768,), (1037, 768), (2, 3, 5, 768),
    (11, 1000), (3, 5, 1000), (3072,), (2, 9, 3072),
]


def _bias(rng, c, dtype):
    return randn(rng, (c,), dtype, 0.5)


def assert_grads_close(got, want, dtype, factor=2.0):
    """(dx[, dbias]) against the spec's. dbias is a sum over rows of dx, so its rounding error
    scales with the sum of |dx| over the rows (cancellation can leave dbias itself small); like
    assert_close, the largest such sum sets a floor shared by every column."""
    for g, r in zip(got, want):
        assert g.dtype == r.dtype and g.shape == r.shape
    assert_close(got[0], want[0], dtype, factor)
    if len(got) == 2:
        dx = np.abs(np.asarray(want[0].astype(jnp.float32), np.float64))
        summed = dx.reshape(-1, dx.shape[-1]).sum(axis=0)
        a, e = (np.asarray(v.astype(jnp.float32), np.float64) for v in (got[1], want[1]))
        err = np.abs(a - e)
        tol = TOL[jnp.dtype(dtype).type] * factor * (np.abs(e) + summed + summed.max())
        assert np.all(err <= tol), f"dbias: worst excess {np.max(err - tol):.3e}"


def _loss(fn, ct):
    """A scalar whose gradient sends the random cotangent ct into fn's output."""
    return lambda *args: jnp.sum(fn(*args).astype(jnp.float32) * ct)


@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gelu_values_and_grads(rng, shape, dtype, with_bias):
    x = randn(rng, shape, dtype, 2.0)
    args = (x, _bias(rng, shape[-1], dtype)) if with_bias else (x,)
    y = ops.gelu(*args)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, spec.gelu(*args), dtype)

    ct = randn(rng, shape, jnp.float32)
    argnums = tuple(range(len(args)))
    got = jax.grad(_loss(ops.gelu, ct), argnums=argnums)(*args)
    want = jax.grad(_loss(spec.gelu, ct), argnums=argnums)(*args)
    assert_grads_close(got, want, dtype)


def test_wide_range_of_inputs(rng):
    # Far tails (gelu -> 0 and gelu -> x), where the kernels' exp/reciprocal form of tanh saturates.
    x = jnp.asarray(np.concatenate([np.linspace(-30, 30, 2001), [0.0, -0.0, 1e-30, -1e-30]]),
                    jnp.float32).reshape(5, -1)
    b = randn(rng, (x.shape[-1],), jnp.float32, 0.1)
    for args in ((x,), (x, b)):
        assert_close(ops.gelu(*args), spec.gelu(*args), jnp.float32)
        ct = jnp.ones(x.shape, jnp.float32)
        got = jax.grad(_loss(ops.gelu, ct), argnums=tuple(range(len(args))))(*args)
        want = jax.grad(_loss(spec.gelu, ct), argnums=tuple(range(len(args))))(*args)
        assert_grads_close(got, want, jnp.float32)


def test_bfloat16_sum_is_not_rounded_before_gelu(rng):
    # The definition: v = x + bias stays float32 and y is rounded once. Rounding v to bfloat16
    # first would change about a quarter of the outputs by one step; the kernels agree with the
    # spec bit for bit except where a float32 result sits on a rounding edge. (The far negative
    # tail, |y| < 0.01, is left out: there 1 + tanh(u) cancels and float32 tanh implementations
    # legitimately differ in the last bits.)
    x = randn(rng, (64, 768), jnp.bfloat16, 2.0)
    b = _bias(rng, 768, jnp.bfloat16)
    got = np.asarray(ops.gelu(x, b).astype(jnp.float32))
    want = np.asarray(spec.gelu(x, b).astype(jnp.float32))
    rounded_first = np.asarray(spec.gelu(x + b).astype(jnp.float32))
    body = np.abs(want) >= 1e-2
    assert np.mean(got[body] == want[body]) > 0.999
    assert np.mean(rounded_first[body] == want[body]) < 0.9


def test_empty(rng):
    for shape in [(0, 768), (4, 0), (0,)]:
        x = jnp.zeros(shape, jnp.float32)
        b = _bias(rng, shape[-1], jnp.float32)
        assert ops.gelu(x).shape == shape and ops.gelu(x, b).shape == shape
        dx, db = jax.grad(lambda x, b: ops.gelu(x, b).sum(), argnums=(0, 1))(x, b)
        assert dx.shape == shape and db.shape == b.shape
        np.testing.assert_array_equal(db, 0.0)


@pytest.mark.parametrize("shape", [(3,), (4, 3), (2, 3, 17), (5, 64)], ids=str)
def test_check_grads_float64(rng, shape):
    with cpu_float64():
        x = randn(rng, shape, jnp.float64, 2.0)
        b = _bias(rng, shape[-1], jnp.float64)
        assert ops.gelu(x).dtype == jnp.float64
        assert_close(ops.gelu(x), spec.gelu(x), jnp.float64)
        assert_close(ops.gelu(x, b), spec.gelu(x, b), jnp.float64)
        check_grads(ops.gelu, (x,), order=1, modes=("rev",))
        check_grads(ops.gelu, (x, b), order=1, modes=("rev",))


def test_jit_and_remat(rng):
    x = randn(rng, (6, 7, 96), jnp.float32)
    b = _bias(rng, 96, jnp.float32)
    f = jax.jit(lambda x, b: ops.gelu(ops.gelu(x, b)))
    f_ref = lambda x, b: spec.gelu(spec.gelu(x, b))
    assert_close(f(x, b), f_ref(x, b), jnp.float32)
    loss = lambda f: lambda x, b: jnp.sum(jax.checkpoint(f)(x, b) ** 2)
    got = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, b)
    want = jax.grad(loss(f_ref), argnums=(0, 1))(x, b)
    assert_grads_close(got, want, jnp.float32, factor=5)


def test_vmap(rng):
    x = randn(rng, (5, 3, 128), jnp.float32)
    b = _bias(rng, 128, jnp.float32)
    # A shared bias: the batch axis becomes more rows of one kernel call.
    assert_close(jax.vmap(ops.gelu)(x), spec.gelu(x), jnp.float32)
    assert_close(jax.vmap(ops.gelu, (0, None))(x, b), spec.gelu(x, b), jnp.float32)
    # Per-example gradients of the bias (the backward runs once per example).
    per_ex = jax.vmap(jax.grad(lambda x, b: (ops.gelu(x, b) ** 2).sum(), 1), (0, None))
    per_ex_ref = jax.vmap(jax.grad(lambda x, b: (spec.gelu(x, b) ** 2).sum(), 1), (0, None))
    assert_close(per_ex(x, b), per_ex_ref(x, b), jnp.float32, factor=5)
    dx = jax.vmap(jax.grad(lambda x: (ops.gelu(x) ** 2).sum()))(x)
    dx_ref = jax.vmap(jax.grad(lambda x: (spec.gelu(x) ** 2).sum()))(x)
    assert_close(dx, dx_ref, jnp.float32, factor=2)


def test_vmap_over_bias_is_refused(rng):
    # One bias per example is not the fused op's contract; the handler says so instead of
    # broadcasting something else.
    x = randn(rng, (5, 3, 16), jnp.float32)
    b = randn(rng, (5, 16), jnp.float32)
    with pytest.raises(Exception, match="bias has shape"):
        jax.block_until_ready(jax.vmap(ops.gelu)(x, b))


def test_shard_map(rng):
    devices = mesh_devices()
    mesh = jax.make_mesh((len(devices),), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=devices)
    x = randn(rng, (4 * len(devices), 5, 256), jnp.float32)
    b = _bias(rng, 256, jnp.float32)

    def loss(op, x, b):
        return jnp.sum(jnp.sin(op(x, b)) * op(x))

    @jax.jit
    def sharded(x, b):
        def body(x, b):
            # A replicated bias meets row-sharded x: its gradient is summed over "data".
            return jax.lax.psum(loss(ops.gelu, x, b), "data")
        return jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P())(x, b)

    got = jax.value_and_grad(sharded, argnums=(0, 1))(x, b)
    want = jax.value_and_grad(functools.partial(loss, spec.gelu), argnums=(0, 1))(x, b)
    assert_close(got[0], want[0], jnp.float32)
    assert_grads_close(got[1], want[1], jnp.float32, factor=5)
    hlo = sharded.lower(x, b).as_text()
    assert "blujax_bias_gelu_fwd" in hlo and "blujax_gelu_fwd" in hlo and "all-gather" not in hlo


# --- errors a user can act on, at trace time ----------------------------------------------------

def test_bad_arguments_raise_clear_errors(rng):
    x = randn(rng, (4, 8), jnp.float32)
    b = _bias(rng, 8, jnp.float32)
    with pytest.raises(ValueError, match="at least one axis"):
        ops.gelu(jnp.float32(1.0))
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        ops.gelu(x, b[:7])
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        ops.gelu(x, jnp.ones((2, 8)))
    with pytest.raises(TypeError, match="bias is bfloat16 but x is float32"):
        ops.gelu(x, b.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="dtype int32"):
        ops.gelu(x.astype(jnp.int32))
    with pytest.raises(TypeError, match="dtype float16"):
        ops.gelu(x.astype(jnp.float16), b.astype(jnp.float16))
    with pytest.raises(TypeError, match="x must be an array"):
        ops.gelu([1.0, 2.0])
    with pytest.raises(TypeError, match="bias must be an array or None"):
        ops.gelu(x, 0.5)


# --- handlers fed inconsistent buffers directly -------------------------------------------------

def _raw(target, outs, *args):
    return jax.jit(lambda *a: jax.ffi.ffi_call(target, outs)(*a))(*args)


@pytest.mark.parametrize("case", ["bias_size", "bias_rank0", "bias_dtype", "y_dtype", "y_size",
                                  "x_dtype", "x_scalar", "dy_size", "dx_dtype", "dbias_size",
                                  "workspace_cols", "workspace_dtype", "workspace_empty"])
def test_handler_rejects_inconsistent_buffers(rng, case):
    x = randn(rng, (4, 8), jnp.float32)
    b = _bias(rng, 8, jnp.float32)
    sds = jax.ShapeDtypeStruct
    y, vec, ws = sds((4, 8), jnp.float32), sds((8,), jnp.float32), sds((2, 8), jnp.float32)
    fwd, bfwd, bwd, bbwd = ("blujax_gelu_fwd", "blujax_bias_gelu_fwd", "blujax_gelu_bwd",
                            "blujax_bias_gelu_bwd")
    calls = {
        "bias_size": lambda: _raw(bfwd, y, x, b[:5]),
        "bias_rank0": lambda: _raw(bfwd, sds((4, 1), jnp.float32), x[:, :1], b[0]),
        "bias_dtype": lambda: _raw(bfwd, y, x, b.astype(jnp.bfloat16)),
        "y_dtype": lambda: _raw(fwd, sds((4, 8), jnp.bfloat16), x),
        "y_size": lambda: _raw(bfwd, sds((4, 9), jnp.float32), x, b),
        "x_dtype": lambda: _raw(fwd, sds((4, 8), jnp.int32), x.astype(jnp.int32)),
        "x_scalar": lambda: _raw(fwd, sds((), jnp.float32), x[0, 0]),
        "dy_size": lambda: _raw(bwd, y, x[:3], x),
        "dx_dtype": lambda: _raw(bwd, sds((4, 8), jnp.bfloat16), x, x),
        "dbias_size": lambda: _raw(bbwd, (y, sds((7,), jnp.float32), ws), x, x, b),
        "workspace_cols": lambda: _raw(bbwd, (y, vec, sds((2, 9), jnp.float32)), x, x, b),
        "workspace_dtype": lambda: _raw(bbwd, (y, vec, sds((2, 8), jnp.bfloat16)), x, x, b),
        "workspace_empty": lambda: _raw(bbwd, (y, vec, sds((0, 8), jnp.float32)), x, x, b),
    }
    with pytest.raises(Exception, match="blujax_(bias_)?gelu_(fwd|bwd): "):
        jax.block_until_ready(calls[case]())


@pytest.mark.gpu
def test_cuda_rejects_float64_buffers():
    x = np.ones((4, 8), np.float64)
    with jax.enable_x64(True):
        with pytest.raises(Exception, match="unsupported dtype float64"):
            jax.block_until_ready(_raw("blujax_gelu_fwd", jax.ShapeDtypeStruct(x.shape, x.dtype),
                                       x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(16411, 768), (4099, 3072), (517, 1001), (70001, 3)], ids=str)
def test_cuda_large_rows(rng, shape, dtype):
    # Many more rows than one block's tile: every block loops, and the backward reduces its
    # partial dbias rows; 1001 and 3 columns take the any-shape path.
    x = randn(rng, shape, dtype, 2.0)
    b = _bias(rng, shape[-1], dtype)
    ct = randn(rng, shape, jnp.float32)
    for args in ((x,), (x, b)):
        assert_close(ops.gelu(*args), spec.gelu(*args), dtype)
        argnums = tuple(range(len(args)))
        got = jax.grad(_loss(ops.gelu, ct), argnums=argnums)(*args)
        want = jax.grad(_loss(spec.gelu, ct), argnums=argnums)(*args)
        assert_grads_close(got, want, dtype)
