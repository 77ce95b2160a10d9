"""blujax.kernels.rope against the jnp spec (blujax.kernels.xla.rope) and an independent numpy
rotation (complex multiplication).

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
# x is [B, T, N, D]. Half head sizes H = D/2: 1, 5, 20 are not whole 16-byte vectors of
# bfloat16 (the CUDA any-shape path; 20 is of float32), 8, 32, 64 are. Head counts 1 to 9 leave
# a partial group of heads a CUDA thread turns together; row counts are not multiples of any
# block size. The last shape has leading axes [2, 3] before T.
SHAPES = [
    (1, 1, 1, 2), (2, 5, 3, 10), (1, 7, 4, 16), (3, 4, 5, 40), (2, 9, 9, 64),
    (1, 33, 2, 128), (3, 2, 6, 8, 64),
]


def _tables(positions, d, theta=10000.0, dtype=np.float32):
    """cos, sin [T, D/2] of Llama's angles positions[t] * theta^(-2k/D), computed in float64."""
    inv_freq = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    angles = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]
    return jnp.asarray(np.cos(angles), dtype), jnp.asarray(np.sin(angles), dtype), angles


def _numpy_rope(x, angles):
    """An independent rotation: each pair (x[d], x[d + D/2]) as the complex number
    x[d] + i x[d + D/2], multiplied by exp(i angle[t, d])."""
    x = np.asarray(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x, np.float64)
    h = x.shape[-1] // 2
    z = (x[..., :h] + 1j * x[..., h:]) * np.exp(1j * angles)[:, None, :]
    return np.concatenate([z.real, z.imag], axis=-1)


def _loss(fn, ct):
    """A scalar whose gradient sends the random cotangent ct into fn's output."""
    return lambda x, cos, sin: jnp.sum(fn(x, cos, sin).astype(jnp.float32) * ct)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rope_values_and_grads(rng, shape, dtype):
    x = randn(rng, shape, dtype)
    cos, sin, angles = _tables(np.arange(shape[-3]) + 5, shape[-1])
    y = ops.rope(x, cos, sin)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert_close(y, spec.rope(x, cos, sin), dtype)
    assert_close(y, _numpy_rope(x, angles), dtype)

    ct = randn(rng, shape, jnp.float32)
    got = jax.grad(_loss(ops.rope, ct), argnums=(0, 1, 2))(x, cos, sin)
    want = jax.grad(_loss(spec.rope, ct), argnums=(0, 1, 2))(x, cos, sin)
    assert got[0].dtype == x.dtype and got[0].shape == x.shape
    assert_close(got[0], want[0], dtype, factor=2)
    # The tables are not parameters: zero cotangents, of their own shape and dtype.
    for g, t in zip(got[1:], (cos, sin)):
        assert g.shape == t.shape and g.dtype == t.dtype
        np.testing.assert_array_equal(g, 0.0)


def test_gradient_is_the_inverse_rotation(rng):
    # The backward turns dy back: the vjp of y gives x again (a rotation's transpose is its
    # inverse), and equals the forward with -sin.
    x = randn(rng, (2, 12, 3, 64), jnp.float32)
    cos, sin, _ = _tables(np.arange(12) * 37.0, 64)
    y, vjp = jax.vjp(lambda x: ops.rope(x, cos, sin), x)
    (back,) = vjp(y)
    assert_close(back, x, jnp.float32, factor=2)
    dy = randn(rng, x.shape, jnp.float32)
    assert_close(vjp(dy)[0], ops.rope(dy, cos, -sin), jnp.float32)
    assert_close(vjp(dy)[0], _numpy_rope(dy, -_tables(np.arange(12) * 37.0, 64)[2]),
                 jnp.float32)


def test_large_positions_and_llama3_theta(rng):
    # Angles far past 2 pi (position 100k at theta 500k): the tables carry them, the kernel
    # only multiplies.
    positions = np.array([0, 1, 4095, 8191, 100_000, 131_071])
    x = randn(rng, (1, positions.size, 2, 128), jnp.float32)
    cos, sin, angles = _tables(positions, 128, theta=500000.0)
    assert_close(ops.rope(x, cos, sin), _numpy_rope(x, angles), jnp.float32)


def test_empty():
    for shape in [(0, 4, 2, 8), (2, 0, 2, 8), (2, 4, 0, 8), (2, 4, 2, 0)]:
        x = jnp.zeros(shape, jnp.float32)
        cos = jnp.zeros((shape[1], shape[3] // 2), jnp.float32)
        assert ops.rope(x, cos, cos).shape == shape
        assert jax.grad(lambda x: ops.rope(x, cos, cos).sum())(x).shape == shape


@pytest.mark.parametrize("table_dtype", [jnp.float32, jnp.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("shape", [(1, 3, 1, 2), (2, 4, 3, 6), (3, 5, 2, 16)], ids=str)
def test_check_grads_float64(rng, shape, table_dtype):
    with cpu_float64():
        x = randn(rng, shape, jnp.float64)
        cos, sin, angles = _tables(np.arange(shape[1]), shape[-1], dtype=table_dtype)
        y = ops.rope(x, cos, sin)
        assert y.dtype == jnp.float64
        assert_close(y, spec.rope(x, cos, sin), jnp.float64)
        if table_dtype == jnp.float64:
            assert_close(y, _numpy_rope(x, angles), jnp.float64)
        check_grads(lambda x: ops.rope(x, cos, sin), (x,), order=1, modes=("rev",))


def test_jit_and_remat(rng):
    # Queries and keys with different head counts (grouped-query attention) share one pair of
    # tables.
    q = randn(rng, (2, 6, 4, 32), jnp.float32)
    k = randn(rng, (2, 6, 2, 32), jnp.float32)
    cos, sin, _ = _tables(np.arange(6), 32)

    def scores(op):
        def f(q, k):
            qr, kr = op(q, cos, sin), op(k, cos, sin)
            return jnp.einsum("btnd,bsnd->bnts", qr[:, :, ::2], kr)
        return f

    f = jax.jit(scores(ops.rope))
    assert_close(f(q, k), scores(spec.rope)(q, k), jnp.float32)
    loss = lambda f: lambda q, k: jnp.sum(jax.checkpoint(f)(q, k) ** 2)
    got = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(q, k)
    want = jax.grad(loss(scores(spec.rope)), argnums=(0, 1))(q, k)
    for g, r in zip(got, want):
        assert_close(g, r, jnp.float32, factor=5)


def test_vmap(rng):
    x = randn(rng, (5, 2, 6, 3, 16), jnp.float32)
    cos, sin, angles = _tables(np.arange(6), 16)
    # Shared tables: the batch axis becomes more positions of one kernel call.
    got = jax.vmap(ops.rope, (0, None, None))(x, cos, sin)
    assert_close(got, spec.rope(x.reshape(10, 6, 3, 16), cos, sin).reshape(x.shape), jnp.float32)
    dx = jax.vmap(jax.grad(lambda x: (ops.rope(x, cos, sin) ** 2).sum()))(x)
    dx_ref = jax.vmap(jax.grad(lambda x: (spec.rope(x, cos, sin) ** 2).sum()))(x)
    assert_close(dx, dx_ref, jnp.float32, factor=2)


def test_vmap_over_tables_is_refused(rng):
    # One pair of tables per example is not the kernel's contract; the handler says so instead
    # of reading something else.
    x = randn(rng, (5, 2, 6, 3, 16), jnp.float32)
    cos = randn(rng, (5, 6, 8), jnp.float32)
    with pytest.raises(Exception, match="cos has shape"):
        jax.block_until_ready(jax.vmap(ops.rope)(x, cos, cos))


def test_shard_map_data_and_context(rng):
    # Batch over "data", sequence over "context": each device turns its own positions with its
    # own rows of the tables. Replicated over "data", the tables get no gradient to sum.
    devices = mesh_devices()
    n = len(devices)
    shape = (2, n // 2) if n % 2 == 0 and n > 1 else (n, 1)
    mesh = jax.make_mesh(shape, ("data", "context"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=devices)
    t = 3 * shape[1]
    x = randn(rng, (2 * shape[0], t, 4, 32), jnp.float32)
    cos, sin, _ = _tables(np.arange(t), 32)

    def loss(op, x, cos, sin):
        return jnp.sum(jnp.sin(op(x, cos, sin)) * x)

    @jax.jit
    def sharded(x, cos, sin):
        def body(x, cos, sin):
            return jax.lax.psum(loss(ops.rope, x, cos, sin), ("data", "context"))
        return jax.shard_map(body, mesh=mesh, in_specs=(P("data", "context"), P("context"),
                                                        P("context")),
                             out_specs=P())(x, cos, sin)

    got = jax.value_and_grad(sharded, argnums=(0, 1, 2))(x, cos, sin)
    want = jax.value_and_grad(functools.partial(loss, spec.rope), argnums=(0, 1, 2))(x, cos, sin)
    assert_close(got[0], want[0], jnp.float32)
    assert_close(got[1][0], want[1][0], jnp.float32, factor=5)
    for g in got[1][1:]:
        np.testing.assert_array_equal(g, 0.0)
    hlo = sharded.lower(x, cos, sin).as_text()
    assert "blujax_rope_fwd" in hlo and "all-gather" not in hlo
    # No collective in the gradient: in particular no psum of the tables' zero cotangents.
    grad_hlo = jax.jit(jax.grad(sharded, argnums=(0, 1, 2))).lower(x, cos, sin).as_text()
    assert "blujax_rope_bwd" in grad_hlo and "all_reduce" not in grad_hlo


def test_lowers_for_cuda_without_a_gpu():
    x = jnp.ones((2, 4, 2, 16), jnp.bfloat16)
    cos, sin, _ = _tables(np.arange(4), 16)
    f = jax.jit(jax.value_and_grad(lambda x: ops.rope(x, cos, sin).astype(jnp.float32).sum()))
    hlo = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "blujax_rope_fwd" in hlo and "blujax_rope_bwd" in hlo


# --- errors a user can act on, at trace time ----------------------------------------------------

def test_bad_arguments_raise_clear_errors(rng):
    x = randn(rng, (2, 4, 3, 8), jnp.float32)
    cos, sin, _ = _tables(np.arange(4), 8)
    with pytest.raises(ValueError, match=r"\[B, T, N, D\]"):
        ops.rope(x[0, 0], cos, sin)
    with pytest.raises(ValueError, match="must be even"):
        ops.rope(x[..., :7], cos, sin)
    with pytest.raises(ValueError, match=r"cos must have shape \(T, D/2\) = \(4, 4\)"):
        ops.rope(x, cos[:3], sin)
    with pytest.raises(ValueError, match=r"sin must have shape \(T, D/2\) = \(4, 4\)"):
        ops.rope(x, cos, jnp.concatenate([sin, sin], axis=-1))
    with pytest.raises(TypeError, match="cos has dtype bfloat16; it must be float32"):
        ops.rope(x, cos.astype(jnp.bfloat16), sin)
    with pytest.raises(TypeError, match="float64 tables go with float64 x"):
        with jax.enable_x64(True):
            ops.rope(x, cos.astype(jnp.float64), sin.astype(jnp.float64))
    with pytest.raises(TypeError, match="dtype int32"):
        ops.rope(x.astype(jnp.int32), cos, sin)
    with pytest.raises(TypeError, match="dtype float16"):
        ops.rope(x.astype(jnp.float16), cos, sin)
    with pytest.raises(TypeError, match="x must be an array"):
        ops.rope([1.0, 2.0], cos, sin)
    with pytest.raises(TypeError, match="sin must be an array"):
        ops.rope(x, cos, 0.5)
    with pytest.raises(TypeError, match="cos is float32 but sin is float64"):
        with cpu_float64():
            ops.rope(x.astype(jnp.float64), cos, sin.astype(jnp.float64))


# --- handlers fed inconsistent buffers directly -------------------------------------------------

def _raw(target, outs, *args):
    return jax.jit(lambda *a: jax.ffi.ffi_call(target, outs)(*a))(*args)


@pytest.mark.parametrize("case", ["x_rank2", "x_odd", "x_dtype", "cos_rows", "cos_cols",
                                  "cos_lead", "cos_dtype", "sin_dtype", "sin_rank1", "y_dtype",
                                  "y_size", "dx_size"])
def test_handler_rejects_inconsistent_buffers(rng, case):
    x = randn(rng, (2, 4, 3, 8), jnp.float32)
    cos, sin, _ = _tables(np.arange(4), 8)
    sds = jax.ShapeDtypeStruct
    y = sds(x.shape, jnp.float32)
    fwd, bwd = "blujax_rope_fwd", "blujax_rope_bwd"
    calls = {
        "x_rank2": lambda: _raw(fwd, sds((3, 8), jnp.float32), x[0, 0], cos, sin),
        "x_odd": lambda: _raw(fwd, sds((2, 4, 3, 7), jnp.float32), x[..., :7], cos, sin),
        "x_dtype": lambda: _raw(fwd, sds(x.shape, jnp.int32), x.astype(jnp.int32), cos, sin),
        "cos_rows": lambda: _raw(fwd, y, x, cos[:3], sin),
        "cos_cols": lambda: _raw(fwd, y, x, cos[:, :3], sin),
        "cos_lead": lambda: _raw(fwd, y, x, jnp.stack([cos, cos]), sin),
        "cos_dtype": lambda: _raw(fwd, y, x, cos.astype(jnp.bfloat16), sin),
        "sin_dtype": lambda: _raw(fwd, y, x, cos, sin.astype(jnp.int32)),
        "sin_rank1": lambda: _raw(fwd, y, x, cos, sin.reshape(-1)),
        "y_dtype": lambda: _raw(fwd, sds(x.shape, jnp.bfloat16), x, cos, sin),
        "y_size": lambda: _raw(fwd, sds((2, 4, 3, 6), jnp.float32), x, cos, sin),
        "dx_size": lambda: _raw(bwd, sds((2, 4, 2, 8), jnp.float32), x, cos, sin),
    }
    with pytest.raises(Exception, match="blujax_rope_(fwd|bwd): "):
        jax.block_until_ready(calls[case]())


def test_cpu_handler_rejects_mixed_table_dtypes(rng):
    with cpu_float64():
        x = randn(rng, (2, 4, 3, 8), jnp.float64)
        cos, sin, _ = _tables(np.arange(4), 8)
        with pytest.raises(Exception, match="blujax_rope_fwd: sin is float64 but cos is float32"):
            jax.block_until_ready(_raw("blujax_rope_fwd", jax.ShapeDtypeStruct(x.shape, x.dtype),
                                       x, cos, sin.astype(jnp.float64)))


@pytest.mark.gpu
def test_cuda_rejects_float64_buffers():
    x = np.ones((2, 4, 3, 8), np.float64)
    cos = np.ones((4, 4), np.float32)
    with jax.enable_x64(True):
        with pytest.raises(Exception, match="unsupported dtype float64"):
            jax.block_until_ready(_raw("blujax_rope_fwd", jax.ShapeDtypeStruct(x.shape, x.dtype),
                                       x, cos, cos))
        with pytest.raises(Exception, match="cos must be float32, got float64"):
            jax.block_until_ready(_raw("blujax_rope_fwd",
                                       jax.ShapeDtypeStruct(x.shape, np.float32),
                                       x.astype(np.float32), cos.astype(np.float64), cos))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(4, 1024, 32, 128), (2, 2048, 8, 64), (3, 517, 5, 80),
                                   (2, 77, 3, 6), (1, 4099, 7, 128)], ids=str)
def test_cuda_large(rng, shape, dtype):
    # Many more vectors than one block; 80 (H = 40) is whole float32 vectors only, 6 neither;
    # 5 and 7 heads leave partial groups.
    x = randn(rng, shape, dtype)
    cos, sin, angles = _tables(np.arange(shape[1]), shape[-1], theta=500000.0)
    y = ops.rope(x, cos, sin)
    assert_close(y, spec.rope(x, cos, sin), dtype)
    ct = randn(rng, shape, jnp.float32)
    got = jax.grad(_loss(ops.rope, ct))(x, cos, sin)
    want = jax.grad(_loss(spec.rope, ct))(x, cos, sin)
    assert_close(got, want, dtype, factor=2)


# --- rope_qkv: RoPE fused into the split of a fused QKV projection's output ---------------------

# (B, T, H, KV, D): multi-head (H = KV), grouped (H = 4 KV, llama-d12's 12/4 and 1B's 32/8
# shapes small), one KV head; half head sizes whole bfloat16 vectors (32) or not (5, 20).
QKV_SHAPES = [(2, 5, 2, 2, 10), (1, 7, 12, 4, 64), (3, 4, 4, 1, 40), (2, 9, 3, 1, 64),
              (1, 33, 8, 2, 128)]


def _qkv_loss(fn, heads, cts):
    """A scalar whose gradient sends the cotangents cts into fn's q, k, v."""
    def loss(qkv, cos, sin):
        outs = fn(qkv, cos, sin, heads=heads)
        return sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(outs, cts))
    return loss


def _check_rope_qkv(rng, shape, dtype, factor=2):
    b, t, h, kv, d = shape
    qkv = randn(rng, (b, t, h + 2 * kv, d), dtype)
    cos, sin, angles = _tables(np.arange(t) + 3, d, theta=500000.0)
    q, k, v = ops.rope_qkv(qkv, cos, sin, heads=h)
    assert [a.shape for a in (q, k, v)] == [(b, t, h, d), (b, t, kv, d), (b, t, kv, d)]
    assert q.dtype == k.dtype == v.dtype == qkv.dtype
    for got, want in zip((q, k, v), spec.rope_qkv(qkv, cos, sin, heads=h)):
        assert_close(got, want, dtype)
    # The same as the unfused op on the split, and v bit for bit.
    assert_close(q, _numpy_rope(qkv[:, :, :h], angles), dtype)
    assert_close(k, _numpy_rope(qkv[:, :, h:h + kv], angles), dtype)
    np.testing.assert_array_equal(np.asarray(v.astype(jnp.float32)),
                                  np.asarray(qkv[:, :, h + kv:].astype(jnp.float32)))
    cts = [randn(rng, a.shape, jnp.float32) for a in (q, k, v)]
    got = jax.grad(_qkv_loss(ops.rope_qkv, h, cts), argnums=(0, 1, 2))(qkv, cos, sin)
    want = jax.grad(_qkv_loss(spec.rope_qkv, h, cts), argnums=(0, 1, 2))(qkv, cos, sin)
    assert got[0].dtype == qkv.dtype and got[0].shape == qkv.shape
    assert_close(got[0], want[0], dtype, factor=factor)
    for g in got[1:]:
        np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", QKV_SHAPES, ids=str)
def test_rope_qkv_values_and_grads(rng, shape, dtype):
    _check_rope_qkv(rng, shape, dtype)


@pytest.mark.parametrize("shape", [(1, 3, 2, 1, 2), (2, 4, 3, 3, 6)], ids=str)
def test_rope_qkv_check_grads_float64(rng, shape):
    b, t, h, kv, d = shape
    with cpu_float64():
        qkv = randn(rng, (b, t, h + 2 * kv, d), jnp.float64)
        cos, sin, _ = _tables(np.arange(t), d, dtype=np.float64)
        for got, want in zip(ops.rope_qkv(qkv, cos, sin, heads=h),
                             spec.rope_qkv(qkv, cos, sin, heads=h)):
            assert_close(got, want, jnp.float64)
        check_grads(lambda x: ops.rope_qkv(x, cos, sin, heads=h), (qkv,), order=1,
                    modes=("rev",))


def test_rope_qkv_jit_vmap_and_empty(rng):
    qkv = randn(rng, (3, 2, 6, 8, 16), jnp.float32)  # a vmapped batch of [2, 6, 4 + 2 + 2, 16]
    cos, sin, _ = _tables(np.arange(6), 16)
    f = jax.jit(jax.vmap(lambda x: ops.rope_qkv(x, cos, sin, heads=4)))
    for got, want in zip(f(qkv), spec.rope_qkv(qkv, cos, sin, heads=4)):
        assert_close(got, want, jnp.float32)
    empty = jnp.zeros((0, 6, 8, 16), jnp.float32)
    assert [a.shape for a in ops.rope_qkv(empty, cos, sin, heads=4)] == \
        [(0, 6, 4, 16), (0, 6, 2, 16), (0, 6, 2, 16)]


def test_rope_qkv_bad_arguments(rng):
    qkv = randn(rng, (2, 4, 6, 8), jnp.float32)
    cos, sin, _ = _tables(np.arange(4), 8)
    for heads in (0, 6, 3, 2.0, True):
        with pytest.raises(ValueError, match="rope_qkv: heads must be"):
            ops.rope_qkv(qkv, cos, sin, heads=heads)
    with pytest.raises(ValueError, match=r"rope_qkv: cos must have shape \(T, D/2\)"):
        ops.rope_qkv(qkv, cos[:3], sin, heads=4)
    with pytest.raises(ValueError, match=r"rope_qkv: qkv must have shape"):
        ops.rope_qkv(qkv[0, 0], cos, sin, heads=4)
    with pytest.raises(TypeError, match="rope_qkv: qkv has dtype int32"):
        ops.rope_qkv(qkv.astype(jnp.int32), cos, sin, heads=4)


@pytest.mark.parametrize("case", ["heads_sum", "kv_unequal", "part_dtype", "part_lead",
                                  "part_rank", "dqkv_heads", "cos_rows"])
def test_rope_qkv_handler_rejects_inconsistent_buffers(rng, case):
    qkv = randn(rng, (2, 4, 6, 8), jnp.float32)
    cos, sin, _ = _tables(np.arange(4), 8)
    sds = jax.ShapeDtypeStruct
    f32 = jnp.float32

    def parts(h, kv, kv2=None, dtype=f32, lead=(2, 4)):
        return (sds((*lead, h, 8), dtype), sds((*lead, kv, 8), f32),
                sds((*lead, kv if kv2 is None else kv2, 8), f32))

    fwd, bwd = "blujax_rope_qkv_fwd", "blujax_rope_qkv_bwd"
    dq, dk = qkv[:, :, :4], qkv[:, :, 4:5]
    calls = {
        "heads_sum": lambda: _raw(fwd, parts(2, 1), qkv, cos, sin),
        "kv_unequal": lambda: _raw(fwd, parts(3, 1, 2), qkv, cos, sin),
        "part_dtype": lambda: _raw(fwd, parts(4, 1, dtype=jnp.bfloat16), qkv, cos, sin),
        "part_lead": lambda: _raw(fwd, parts(4, 1, lead=(2, 3)), qkv, cos, sin),
        "part_rank": lambda: _raw(fwd, (sds((8, 4, 8), f32),) + parts(4, 1)[1:], qkv, cos, sin),
        "dqkv_heads": lambda: _raw(bwd, sds((2, 4, 7, 8), f32), dq, dk, dk, cos, sin),
        "cos_rows": lambda: _raw(fwd, parts(4, 1), qkv, cos[:3], sin),
    }
    with pytest.raises(Exception, match="blujax_rope_qkv_(fwd|bwd): "):
        jax.block_until_ready(calls[case]())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(8, 2048, 32, 8, 64), (16, 1024, 12, 4, 64),
                                   (2, 517, 5, 1, 80), (3, 77, 6, 2, 6), (1, 1031, 7, 7, 128)],
                         ids=str)
def test_cuda_rope_qkv_large(rng, shape, dtype):
    # llama-1b's and llama-d12's shapes; H = 40 whole float32 vectors only, 3 neither; head
    # counts that leave partial groups in every part.
    _check_rope_qkv(rng, shape, dtype)
