"""blujax.kernels.swiglu against the jnp spec (blujax.kernels.xla.swiglu).

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
# x is [..., 2, F]. F = 1, 3, 5, 7, 1001 take the CUDA any-shape path (not whole 16-byte
# vectors); 8, 64, 1376 are whole vectors of both dtypes, 12 of float32 only. Leading ranks 0
# to 3; row counts (1 to 1037) are not multiples of any block size.
SHAPES = [
    (2, 1), (2, 3), (5, 2, 7), (3, 2, 8), (1037, 2, 12), (4, 5, 2, 64), (7, 2, 1001),
    (2, 3, 2, 1376), (2, 1, 3, 2, 5),
]


def _loss(fn, ct):
    """A scalar whose gradient sends the random cotangent ct into fn's output."""
    return lambda x: jnp.sum(fn(x).astype(jnp.float32) * ct)


def _out_shape(shape):
    return shape[:-2] + shape[-1:]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_swiglu_values_and_grads(rng, shape, dtype):
    x = randn(rng, shape, dtype, 2.0)
    y = ops.swiglu(x)
    assert y.dtype == x.dtype and y.shape == _out_shape(shape)
    assert_close(y, spec.swiglu(x), dtype)

    ct = randn(rng, _out_shape(shape), jnp.float32)
    got = jax.grad(_loss(ops.swiglu, ct))(x)
    want = jax.grad(_loss(spec.swiglu, ct))(x)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert_close(got, want, dtype, factor=2)


def test_the_definition(rng):
    # silu(gate) * up and its two partial derivatives, written out in numpy float64.
    x = randn(rng, (6, 2, 40), jnp.float32, 3.0)
    dy = randn(rng, (6, 40), jnp.float32)
    g, u = (np.asarray(x[:, i], np.float64) for i in (0, 1))
    s = 1 / (1 + np.exp(-g))
    assert_close(ops.swiglu(x), g * s * u, jnp.float32)
    _, vjp = jax.vjp(ops.swiglu, x)
    (dx,) = vjp(dy)
    d = np.asarray(dy, np.float64)
    want = np.stack([d * u * s * (1 + g * (1 - s)), d * g * s], axis=1)
    assert_close(dx, want, jnp.float32, factor=2)


def test_wide_range_of_inputs(rng):
    # Far tails: sigmoid saturates to 0 (silu -> 0) and to 1 (silu -> g).
    g = np.concatenate([np.linspace(-100, 100, 2001), [0.0, -0.0, 1e-30, -1e-30, -90.0, 89.0]])
    x = jnp.asarray(np.stack([g, rng.standard_normal(g.size)]), jnp.float32).reshape(2, -1)
    x = x.reshape(2, 1, -1).transpose(1, 0, 2)  # [1, 2, F]
    assert_close(ops.swiglu(x), spec.swiglu(x), jnp.float32)
    ct = jnp.ones((1, x.shape[-1]), jnp.float32)
    assert_close(jax.grad(_loss(ops.swiglu, ct))(x), jax.grad(_loss(spec.swiglu, ct))(x),
                 jnp.float32, factor=2)


def test_bfloat16_is_rounded_once(rng):
    # silu(gate) * up is formed in float32 and rounded once: the kernels agree with the spec
    # bit for bit except where a float32 result sits on a rounding edge, while rounding
    # silu(gate) to bfloat16 first (as plain JAX in bfloat16 does) changes many outputs.
    x = randn(rng, (64, 2, 768), jnp.bfloat16, 2.0)
    got = np.asarray(ops.swiglu(x).astype(jnp.float32))
    want = np.asarray(spec.swiglu(x).astype(jnp.float32))
    rounded_twice = np.asarray((jax.nn.silu(x[:, 0]) * x[:, 1]).astype(jnp.float32))
    assert np.mean(got == want) > 0.999
    assert np.mean(rounded_twice == want) < 0.9


def test_empty():
    for shape in [(0, 2, 8), (4, 2, 0), (3, 0, 2, 5)]:
        x = jnp.zeros(shape, jnp.float32)
        assert ops.swiglu(x).shape == _out_shape(shape)
        dx = jax.grad(lambda x: ops.swiglu(x).sum())(x)
        assert dx.shape == shape


@pytest.mark.parametrize("shape", [(2, 1), (4, 2, 3), (2, 3, 2, 17)], ids=str)
def test_check_grads_float64(rng, shape):
    with cpu_float64():
        x = randn(rng, shape, jnp.float64, 2.0)
        assert ops.swiglu(x).dtype == jnp.float64
        assert_close(ops.swiglu(x), spec.swiglu(x), jnp.float64)
        check_grads(ops.swiglu, (x,), order=1, modes=("rev",))
        ct = randn(rng, _out_shape(shape), jnp.float64)
        assert_close(jax.grad(_loss(ops.swiglu, ct))(x), jax.grad(_loss(spec.swiglu, ct))(x),
                     jnp.float64)


def test_jit_and_remat(rng):
    # The Llama MLP's shape of use: h @ W with W [C, 2, F], then swiglu, then the down matmul.
    h = randn(rng, (6, 7, 32), jnp.float32)
    w = randn(rng, (32, 2, 48), jnp.float32, 0.2)
    w2 = randn(rng, (48, 32), jnp.float32, 0.2)

    def mlp(op):
        return lambda h, w: op(jnp.einsum("btc,cjf->btjf", h, w)) @ w2

    f = jax.jit(mlp(ops.swiglu))
    assert_close(f(h, w), mlp(spec.swiglu)(h, w), jnp.float32)
    loss = lambda f: lambda h, w: jnp.sum(jax.checkpoint(f)(h, w) ** 2)
    got = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(h, w)
    want = jax.grad(loss(mlp(spec.swiglu)), argnums=(0, 1))(h, w)
    for g, r in zip(got, want):
        assert_close(g, r, jnp.float32, factor=5)


def test_vmap(rng):
    x = randn(rng, (5, 3, 2, 24), jnp.float32)
    assert_close(jax.vmap(ops.swiglu)(x), spec.swiglu(x), jnp.float32)
    # The batch axis somewhere other than in front.
    xt = jnp.moveaxis(x, 0, 2)  # [3, 2, 5, 24]
    assert_close(jax.vmap(ops.swiglu, in_axes=2)(xt), spec.swiglu(x), jnp.float32)
    dx = jax.vmap(jax.grad(lambda x: (ops.swiglu(x) ** 2).sum()))(x)
    dx_ref = jax.vmap(jax.grad(lambda x: (spec.swiglu(x) ** 2).sum()))(x)
    assert_close(dx, dx_ref, jnp.float32, factor=2)
    # One cotangent shared by every example: the backward's dy is unbatched while x is.
    ct = randn(rng, (3, 24), jnp.float32)
    per_ex = jax.vmap(lambda x: jax.vjp(ops.swiglu, x)[1](ct)[0])(x)
    per_ex_ref = jax.vmap(lambda x: jax.vjp(spec.swiglu, x)[1](ct)[0])(x)
    assert_close(per_ex, per_ex_ref, jnp.float32, factor=2)


def test_shard_map(rng):
    # Data parallel over rows and tensor parallel over F (the column-parallel W [C, 2, F]
    # splits its F), as the Llama MLP runs on a mesh.
    devices = mesh_devices()
    n = len(devices)
    shape = (2, n // 2) if n % 2 == 0 and n > 1 else (n, 1)
    mesh = jax.make_mesh(shape, ("data", "tensor"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=devices)
    x = randn(rng, (2 * shape[0], 3, 2, 16 * shape[1]), jnp.float32)

    def loss(op, x):
        return jnp.sum(jnp.sin(op(x)))

    @jax.jit
    def sharded(x):
        def body(x):
            return jax.lax.psum(loss(ops.swiglu, x), ("data", "tensor"))
        spec_x = P("data", None, None, "tensor")
        return jax.shard_map(body, mesh=mesh, in_specs=(spec_x,), out_specs=P())(x)

    got = jax.value_and_grad(sharded)(x)
    want = jax.value_and_grad(functools.partial(loss, spec.swiglu))(x)
    assert_close(got[0], want[0], jnp.float32)
    assert_close(got[1], want[1], jnp.float32, factor=5)
    hlo = sharded.lower(x).as_text()
    assert "blujax_swiglu_fwd" in hlo and "all-gather" not in hlo


def test_lowers_for_cuda_without_a_gpu():
    x = jnp.ones((4, 2, 8), jnp.bfloat16)
    f = jax.jit(jax.value_and_grad(lambda x: ops.swiglu(x).astype(jnp.float32).sum()))
    hlo = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "blujax_swiglu_fwd" in hlo and "blujax_swiglu_bwd" in hlo


# --- errors a user can act on, at trace time ----------------------------------------------------

def test_bad_arguments_raise_clear_errors(rng):
    x = randn(rng, (4, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"\[\.\.\., 2, F\].*got \(4, 3, 8\)"):
        ops.swiglu(jnp.ones((4, 3, 8)))
    with pytest.raises(ValueError, match=r"\[\.\.\., 2, F\].*got \(8,\)"):
        ops.swiglu(jnp.ones((8,)))
    with pytest.raises(ValueError, match=r"\[\.\.\., 2, F\]"):
        ops.swiglu(jnp.float32(1.0))
    with pytest.raises(TypeError, match="dtype int32"):
        ops.swiglu(x.astype(jnp.int32))
    with pytest.raises(TypeError, match="dtype float16"):
        ops.swiglu(x.astype(jnp.float16))
    with pytest.raises(TypeError, match="x must be an array"):
        ops.swiglu([[1.0], [2.0]])


# --- handlers fed inconsistent buffers directly -------------------------------------------------

def _raw(target, outs, *args):
    return jax.jit(lambda *a: jax.ffi.ffi_call(target, outs)(*a))(*args)


@pytest.mark.parametrize("case", ["x_not_pair", "x_rank1", "x_dtype", "y_dtype", "y_size",
                                  "y_rank", "dy_size", "dy_dtype", "dx_size", "dx_dtype"])
def test_handler_rejects_inconsistent_buffers(rng, case):
    x = randn(rng, (4, 2, 8), jnp.float32)
    dy = randn(rng, (4, 8), jnp.float32)
    sds = jax.ShapeDtypeStruct
    y, dx = sds((4, 8), jnp.float32), sds((4, 2, 8), jnp.float32)
    fwd, bwd = "blujax_swiglu_fwd", "blujax_swiglu_bwd"
    calls = {
        "x_not_pair": lambda: _raw(fwd, y, jnp.ones((4, 3, 8))),
        "x_rank1": lambda: _raw(fwd, sds((8,), jnp.float32), jnp.ones((8,))),
        "x_dtype": lambda: _raw(fwd, sds((4, 8), jnp.int32), x.astype(jnp.int32)),
        "y_dtype": lambda: _raw(fwd, sds((4, 8), jnp.bfloat16), x),
        "y_size": lambda: _raw(fwd, sds((4, 9), jnp.float32), x),
        "y_rank": lambda: _raw(fwd, sds((32,), jnp.float32), x),
        "dy_size": lambda: _raw(bwd, dx, dy[:3], x),
        "dy_dtype": lambda: _raw(bwd, dx, dy.astype(jnp.bfloat16), x),
        "dx_size": lambda: _raw(bwd, sds((4, 2, 7), jnp.float32), dy, x),
        "dx_dtype": lambda: _raw(bwd, sds((4, 2, 8), jnp.bfloat16), dy, x),
    }
    with pytest.raises(Exception, match="blujax_swiglu_(fwd|bwd): "):
        jax.block_until_ready(calls[case]())


@pytest.mark.gpu
def test_cuda_rejects_float64_buffers():
    x = np.ones((4, 2, 8), np.float64)
    with jax.enable_x64(True):
        with pytest.raises(Exception, match="unsupported dtype float64"):
            jax.block_until_ready(_raw("blujax_swiglu_fwd",
                                       jax.ShapeDtypeStruct((4, 8), x.dtype), x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(16411, 2, 1376), (4099, 2, 2048), (517, 2, 1001),
                                   (70001, 2, 3)], ids=str)
def test_cuda_large_rows(rng, shape, dtype):
    # Many more vectors than one block: 1376 and 2048 columns take the packed path, 1001 and 3
    # the any-shape one.
    x = randn(rng, shape, dtype, 2.0)
    ct = randn(rng, _out_shape(shape), jnp.float32)
    assert_close(ops.swiglu(x), spec.swiglu(x), dtype)
    assert_close(jax.grad(_loss(ops.swiglu, ct))(x), jax.grad(_loss(spec.swiglu, ct))(x), dtype,
                 factor=2)


# --- the FP8 forms (blujax.fp8's fused MLP) ------------------------------------------------------

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# (x's shape, dtype, format, scale): rows and columns around the CUDA kernel's 64 x 64 tiles;
# F = 5, 1001 take its any-shape path, row counts that are not multiples of 16 its
# byte-by-byte transposed writes (32 and 96 rows its 16-byte ones); no rows at all; a scale
# that is not a power of two (a division, not a multiply).
_BF, _F32 = jnp.bfloat16, jnp.float32
FP8_CASES = [
    ((3, 2, 5), _F32, E4M3, 2.0 ** -5), ((3, 2, 5), _BF, E5M2, 2.0 ** -14),
    ((4, 5, 2, 64), _BF, E4M3, 2.0 ** -5), ((130, 2, 72), _BF, E4M3, 0.37),
    ((130, 2, 72), _F32, E5M2, 2.0 ** -14), ((70, 2, 1001), _BF, E5M2, 2.0 ** -14),
    ((70, 2, 1001), _F32, E4M3, 2.0 ** -5), ((2, 0, 2, 8), _BF, E4M3, 2.0 ** -5),
    ((32, 2, 64), _BF, E4M3, 2.0 ** -5), ((32, 2, 64), _F32, E4M3, 0.37),
    ((2, 48, 2, 136), _BF, E5M2, 2.0 ** -14),
]


def _copy(y, scale, fmt):
    """What the FP8 forms must write for y [N, K]: the cast a product would do of it."""
    return spec.fp8_copy(y, scale, fmt)


def _fp8_forms(x, dy, scale, fmt):
    """(forward, backward) FP8 forms of our kernel and the casts of its plain outputs."""
    f = x.shape[-1]
    dx = jax.vjp(ops.swiglu, x)[1](dy)[0]
    return ((ops.swiglu_fwd_fp8(x, scale, fmt), _copy(ops.swiglu(x).reshape(-1, f), scale, fmt)),
            (ops.swiglu_bwd_fp8(dy, x, scale, fmt), _copy(dx.reshape(-1, 2 * f), scale, fmt)))


def _bits(a):
    return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)) if a.dtype.itemsize == 1 \
        else np.asarray(a)


@pytest.mark.parametrize("shape,dtype,fmt,scale", FP8_CASES,
                         ids=lambda v: jnp.dtype(v).name if isinstance(v, type) else str(v))
def test_fp8_forms_are_the_cast_of_the_kernels_output(rng, shape, dtype, fmt, scale):
    """q, its transpose and the amax are, to the bit, what casting swiglu's (or its
    backward's) output in x's dtype gives: the fused MLP then computes what the products do."""
    x = randn(rng, shape, dtype, 3.0)
    dy = randn(rng, _out_shape(shape), dtype)
    for got, want in _fp8_forms(x, dy, jnp.float32(scale), fmt):
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape)
            np.testing.assert_array_equal(_bits(a), _bits(b))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_fp8_forms_against_the_spec(rng, dtype):
    """Against the jnp spec (swiglu in float32, then the cast): the kernel's own rounding of
    y can move a value across an FP8 rounding boundary, by one code at most."""
    x = randn(rng, (33, 2, 72), dtype, 3.0)
    dy = randn(rng, (33, 72), dtype)
    s = jnp.float32(2.0 ** -6)
    for got, want in ((ops.swiglu_fwd_fp8(x, s), spec.swiglu_fwd_fp8(x, s)),
                      (ops.swiglu_bwd_fp8(dy, x, s), spec.swiglu_bwd_fp8(dy, x, s))):
        for a, b in zip(got[:2], want[:2]):
            codes = np.abs(_bits(a).astype(int) - _bits(b).astype(int))
            assert codes.max() <= 1 and codes.mean() < 0.05
        assert_close(got[2], want[2], dtype)


def test_fp8_forms_saturate_and_carry_nan_into_the_amax():
    x = jnp.array([[[1e4, -1e4, 0.5, 2.0], [1.0, 1.0, 1.0, 1.0]]], jnp.float32)
    q, qt, amax = ops.swiglu_fwd_fp8(x, jnp.float32(1.0))
    assert q.astype(jnp.float32).tolist() == [[448.0, 0.0, 0.3125, 1.75]]
    assert float(amax) == 1e4
    assert np.isnan(float(ops.swiglu_fwd_fp8(x.at[0, 1, 2].set(jnp.nan), jnp.float32(1.0))[2]))
    dy = jnp.full((1, 4), 1e9, jnp.float32)
    q, _, amax = ops.swiglu_bwd_fp8(dy, x, jnp.float32(1.0), E5M2)
    assert float(jnp.max(q.astype(jnp.float32))) == 57344.0 and amax > 57344.0


def test_fp8_forms_reject_bad_arguments(rng):
    x = randn(rng, (4, 2, 8), jnp.float32)
    dy = randn(rng, (4, 8), jnp.float32)
    s = jnp.float32(1.0)
    with pytest.raises(TypeError, match="float32 scalar"):
        ops.swiglu_fwd_fp8(x, jnp.ones(2))
    with pytest.raises(TypeError, match="float32 scalar"):
        ops.swiglu_fwd_fp8(x, jnp.bfloat16(1.0))
    with pytest.raises(TypeError, match="float8_e4m3fn or float8_e5m2"):
        ops.swiglu_fwd_fp8(x, s, jnp.bfloat16)
    with pytest.raises(TypeError, match="dtype float64"):
        with jax.enable_x64(True):
            ops.swiglu_fwd_fp8(np.ones((4, 2, 8)), s)
    with pytest.raises(ValueError, match="dy must be"):
        ops.swiglu_bwd_fp8(dy[:3], x, s)
    with pytest.raises(ValueError, match=r"\[\.\.\., 2, F\]"):
        ops.swiglu_bwd_fp8(dy, jnp.ones((4, 3, 8)), s)


@pytest.mark.parametrize("case", ["q_dtype", "qt_shape", "q_size", "scale_dtype", "amax_shape",
                                  "dy_size"])
def test_fp8_handlers_reject_inconsistent_buffers(rng, case):
    x = randn(rng, (4, 2, 8), jnp.float32)
    dy = randn(rng, (4, 8), jnp.float32)
    s = jnp.float32(1.0)
    sds = jax.ShapeDtypeStruct
    amax = sds((), jnp.float32)
    fwd, bwd = "blujax_swiglu_fwd_fp8", "blujax_swiglu_bwd_fp8"
    calls = {
        "q_dtype": lambda: _raw(fwd, (sds((4, 8), jnp.bfloat16), sds((8, 4), jnp.bfloat16),
                                      amax), x, s),
        "qt_shape": lambda: _raw(fwd, (sds((4, 8), E4M3), sds((4, 8), E4M3), amax), x, s),
        "q_size": lambda: _raw(bwd, (sds((4, 8), E5M2), sds((16, 4), E5M2), amax), dy, x, s),
        "scale_dtype": lambda: _raw(fwd, (sds((4, 8), E4M3), sds((8, 4), E4M3), amax), x,
                                    s.astype(jnp.bfloat16)),
        "amax_shape": lambda: _raw(fwd, (sds((4, 8), E4M3), sds((8, 4), E4M3),
                                         sds((2,), jnp.float32)), x, s),
        "dy_size": lambda: _raw(bwd, (sds((4, 16), E5M2), sds((16, 4), E5M2), amax), dy[:3],
                                x, s),
    }
    with pytest.raises(Exception, match="blujax_swiglu_(fwd|bwd)_fp8: "):
        jax.block_until_ready(calls[case]())


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(16384, 2, 1376), (4099, 2, 2048), (517, 2, 1001)], ids=str)
def test_cuda_fp8_forms_large(rng, shape):
    # Many tiles: 16384 rows with 16-byte transposed writes, 4099 byte by byte, 1001 columns
    # the any-shape loads.
    x = randn(rng, shape, jnp.bfloat16, 3.0)
    dy = randn(rng, _out_shape(shape), jnp.bfloat16)
    for got, want in _fp8_forms(x, dy, jnp.float32(2.0 ** -6), E4M3):
        for a, b in zip(got, want):
            np.testing.assert_array_equal(_bits(a), _bits(b))
