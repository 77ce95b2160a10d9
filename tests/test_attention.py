"""blujax.kernels.attention / attention_with_lse against the jnp spec (blujax.kernels.xla).

The same tests run the CUDA kernels when JAX runs on a GPU and the CPU kernels otherwise. The
GPU has kernels for head sizes 64 and 128 only; cases with other head sizes run on the CPU
device (`_device_for`), whose kernels take any D. Tests marked gpu need a GPU: very long
sequences, grids with more than 65535 (batch, head) pairs, the GPU's head-size check.
"""

import contextlib
import functools
import importlib
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

from blujax import kernels as ops
from blujax.kernels import xla as spec
from blujax.kernels.attention import (CAUSAL_TWO_KERNEL_KEYS, GPU_HEAD_DIMS, dq_room,
                                      xla_deterministic)
from tests.conftest import ON_GPU
from tests.util import assert_close, cpu_float64, mesh_devices, randn, rel_close

DTYPES = [jnp.float32, jnp.bfloat16]
# (Tq, Tk, causal, D). The GPU's tiles are 16 to 64 rows; the lengths are not multiples of
# them (one-token sequences, a partial last tile, a causal diagonal inside a tile) or are
# exact multiples; the non-causal form has Tq != Tk both ways.
CASES = [
    (1, 1, True, 64), (17, 17, True, 64), (17, 17, False, 128), (128, 128, True, 128),
    (5, 70, False, 64), (70, 5, False, 128), (1, 33, False, 64), (67, 67, True, 128),
    (130, 200, False, 64),
    # A head size without a GPU kernel: the CPU kernels take any D (run on the CPU device).
    (67, 67, True, 5),
]
# Long sequences (one (batch, head) pair fewer, to keep the CPU's share short); the last is
# left to the GPU, where it costs nothing.
LONG_CASES = [
    (1000, 1000, True, 64), (1024, 1024, False, 128),
    pytest.param(1000, 1024, False, 64, marks=pytest.mark.gpu),
]
B, H = 2, 3


def _device_for(d):
    """Head sizes the GPU has no kernel for run on the CPU kernels."""
    if ON_GPU and d not in GPU_HEAD_DIMS:
        return jax.default_device(jax.devices("cpu")[0])
    return contextlib.nullcontext()


def _qkv(rng, tq, tk, d, dtype, b=B, h=H, kv=None):
    """q [b, tq, h, d] and k, v [b, tk, kv, d] (kv = h unless given: grouped-query attention)."""
    kv = h if kv is None else kv
    return (randn(rng, (b, tq, h, d), dtype), randn(rng, (b, tk, kv, d), dtype),
            randn(rng, (b, tk, kv, d), dtype))


def _loss(fn, **kw):
    """A scalar whose gradient sends random cotangents into out and lse."""
    def loss(q, k, v, ct_out, ct_lse):
        out, lse = fn(q, k, v, **kw)
        return jnp.sum(out.astype(jnp.float32) * ct_out) + jnp.sum(lse * ct_lse)
    return loss


@functools.partial(jax.jit, static_argnums=(0, 1))
def _values_and_grads(fn, causal, q, k, v, ct_out, ct_lse):
    # One compiled program per side: op-by-op dispatch would compile every primitive.
    out, lse = fn(q, k, v, causal=causal)
    grads = jax.grad(_loss(fn, causal=causal), argnums=(0, 1, 2))(q, k, v, ct_out, ct_lse)
    return out, lse, grads


def _check_values_and_grads(rng, tq, tk, causal, d, dtype, b=B, h=H, kv=None):
    q, k, v = _qkv(rng, tq, tk, d, dtype, b=b, h=h, kv=kv)
    ct_out = randn(rng, q.shape, jnp.float32)
    ct_lse = randn(rng, (b, h, tq), jnp.float32)
    out, lse, got = _values_and_grads(ops.attention_with_lse, causal, q, k, v, ct_out, ct_lse)
    out_ref, lse_ref, want = _values_and_grads(spec.attention_with_lse, causal, q, k, v, ct_out,
                                               ct_lse)
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == (b, h, tq)
    assert_close(out, out_ref, dtype)
    assert_close(lse, lse_ref, jnp.float32, factor=5)
    np.testing.assert_array_equal(ops.attention(q, k, v, causal=causal), out)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert_close(g, r, dtype, factor=2 if dtype == jnp.bfloat16 else 5)
    return (q, k, v, ct_out, ct_lse), (out, lse, got)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("tq,tk,causal,d", CASES, ids=str)
def test_values_and_grads(rng, tq, tk, causal, d, dtype):
    with _device_for(d):
        _check_values_and_grads(rng, tq, tk, causal, d, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("tq,tk,causal,d", LONG_CASES, ids=str)
def test_long_sequences(rng, tq, tk, causal, d, dtype):
    _check_values_and_grads(rng, tq, tk, causal, d, dtype, b=1, h=2)


def test_scale_is_used(rng):
    # 150 keys span three key blocks; with scale 1 the scores reach about +-30, so the running
    # max grows from block to block and the online softmax has to rescale what it summed.
    q, k, v = _qkv(rng, 150, 150, 64, jnp.float32)
    for scale in (0.05, 0.3, 1.0):
        for causal in (True, False):
            got = ops.attention_with_lse(q, k, v, causal=causal, scale=scale)
            want = spec.attention_with_lse(q, k, v, causal=causal, scale=scale)
            assert_close(got[0], want[0], jnp.float32, factor=5)
            assert_close(got[1], want[1], jnp.float32, factor=5)


@pytest.mark.parametrize("tq,tk,causal", [(5, 5, True), (3, 7, False), (6, 2, False)], ids=str)
def test_check_grads_float64(rng, tq, tk, causal):
    with cpu_float64():
        q, k, v = _qkv(rng, tq, tk, 3, jnp.float64, b=2, h=2)
        out, lse = ops.attention_with_lse(q, k, v, causal=causal)
        assert out.dtype == jnp.float64 and lse.dtype == jnp.float64
        out_ref, lse_ref = spec.attention_with_lse(q, k, v, causal=causal)
        assert_close(out, out_ref, jnp.float64)
        assert_close(lse, lse_ref, jnp.float64)
        f = functools.partial(ops.attention_with_lse, causal=causal)
        check_grads(f, (q, k, v), order=1, modes=("rev",))


def _attention_float64(q, k, v, causal, scale):
    """(out, lse) in float64 jnp with the scale exactly as given: the spec's arithmetic."""
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=hi) * scale
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - lse[..., None]), v, precision=hi), lse


@pytest.mark.parametrize("d", [128, 40])
def test_float64_scale_is_exact(rng, d):
    # The float64 kernels take scale at float64: 1/sqrt(D) rounded to float32 (exact only where
    # D is a power of 4) put their results and gradients 4e-9 to 3e-8 off, where float64
    # rounding leaves about 1e-15.
    with cpu_float64():
        q, k, v = _qkv(rng, 19, 19, d, jnp.float64, b=1, h=2)
        ct_out, ct_lse = randn(rng, q.shape, jnp.float64), randn(rng, (1, 2, 19), jnp.float64)
        scale = 1 / math.sqrt(d)
        for causal in (True, False):
            ours = functools.partial(ops.attention_with_lse, causal=causal)
            ref = functools.partial(_attention_float64, causal=causal, scale=scale)
            rel_close(ours(q, k, v), ref(q, k, v), 1e-14)
            rel_close(jax.grad(_loss(ours), argnums=(0, 1, 2))(q, k, v, ct_out, ct_lse),
                      jax.grad(_loss(ref), argnums=(0, 1, 2))(q, k, v, ct_out, ct_lse), 1e-14)
            # The qkv form's backward is a handler of its own.
            qkv = jnp.stack([q, k, v], axis=2)
            ours_qkv = functools.partial(ops.attention_qkv, causal=causal)
            ref_qkv = lambda x: ref(x[:, :, 0], x[:, :, 1], x[:, :, 2])[0]  # noqa: E731
            rel_close(jax.grad(lambda x: jnp.sum(ours_qkv(x) * ct_out))(qkv),
                      jax.grad(lambda x: jnp.sum(ref_qkv(x) * ct_out))(qkv), 1e-14)


def test_jit_and_remat(rng):
    q, k, v = _qkv(rng, 40, 40, 64, jnp.float32)

    def model(attn, q, k, v):
        # Two layers deep, as in a transformer: the second attends with the first's output.
        o = attn(q, k, v)
        return attn(o, k, v + o, causal=True)

    f = jax.jit(functools.partial(model, ops.attention))
    assert_close(f(q, k, v), jax.jit(functools.partial(model, spec.attention))(q, k, v),
                 jnp.float32)
    g = jax.jit(jax.grad(lambda *a: jnp.sum(jax.checkpoint(f)(*a) ** 2), argnums=(0, 1, 2)))
    g_ref = jax.jit(jax.grad(lambda *a: jnp.sum(model(spec.attention, *a) ** 2),
                             argnums=(0, 1, 2)))
    for a, b in zip(g(q, k, v), g_ref(q, k, v)):
        assert_close(a, b, jnp.float32, factor=10)
    assert "blujax_attention_bwd" in g.lower(q, k, v).as_text()


def test_vmap(rng):
    # An extra leading axis (say microbatches): one kernel call per member.
    q = randn(rng, (3, 2, 9, 2, 64), jnp.float32)
    k = randn(rng, (3, 2, 12, 2, 64), jnp.float32)
    v = randn(rng, (3, 2, 12, 2, 64), jnp.float32)
    f = functools.partial(ops.attention_with_lse, causal=False)
    f_ref = functools.partial(spec.attention_with_lse, causal=False)
    for a, b in zip(jax.jit(jax.vmap(f))(q, k, v), jax.jit(jax.vmap(f_ref))(q, k, v)):
        assert_close(a, b, jnp.float32)
    loss = lambda fn: lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)[0])) + jnp.sum(fn(q, k, v)[1])
    per_ex = jax.jit(jax.vmap(jax.grad(loss(f), argnums=(0, 1, 2))))(q, k, v)
    per_ex_ref = jax.jit(jax.vmap(jax.grad(loss(f_ref), argnums=(0, 1, 2))))(q, k, v)
    for a, b in zip(per_ex, per_ex_ref):
        assert_close(a, b, jnp.float32, factor=5)


def test_shard_map_over_heads(rng):
    devices = mesh_devices()
    n = len(devices)
    mesh = jax.make_mesh((n,), ("tensor",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=devices)
    q, k, v = _qkv(rng, 19, 19, 64, jnp.float32, b=2, h=2 * n)
    ct_lse = randn(rng, (2, 2 * n, 19), jnp.float32)

    def loss(op, q, k, v, ct_lse):
        out, lse = op(q, k, v)
        return jnp.sum(jnp.sin(out)) + jnp.sum(lse * ct_lse)

    @jax.jit
    def sharded(q, k, v, ct_lse):
        def body(q, k, v, ct_lse):
            # Megatron layout: each device holds whole heads, so attention needs no collective.
            return jax.lax.psum(loss(ops.attention_with_lse, q, k, v, ct_lse), "tensor")
        heads = P(None, None, "tensor")
        return jax.shard_map(body, mesh=mesh, in_specs=(heads, heads, heads, P(None, "tensor")),
                             out_specs=P())(q, k, v, ct_lse)

    got = jax.value_and_grad(sharded, argnums=(0, 1, 2))(q, k, v, ct_lse)
    want = jax.value_and_grad(functools.partial(loss, spec.attention_with_lse),
                              argnums=(0, 1, 2))(q, k, v, ct_lse)
    assert_close(got[0], want[0], jnp.float32)
    for g, r in zip(got[1], want[1]):
        assert_close(g, r, jnp.float32, factor=5)
    hlo = sharded.lower(q, k, v, ct_lse).as_text()
    assert "blujax_attention_fwd" in hlo and "all-gather" not in hlo


# --- grouped-query attention: k, v with KV heads, KV dividing q's H heads ---------------------

def _repeated_kv(q, k, v, *, causal=True, scale=None):
    """An independent reference for grouped-query attention: k, v repeated to q's heads, as
    Hugging Face's repeat_kv does it (key/value head j serves query heads j G .. j G + G - 1),
    then multi-head attention in float32 (float64) einsums. jnp.repeat's transpose sums the
    gradients of k, v over each group."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    ct = jnp.promote_types(q.dtype, jnp.float32)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    if ct != jnp.float64:
        scale = float(np.float32(scale))
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(ct), k.astype(ct), precision=hi) * scale
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - lse[..., None]), v.astype(ct), precision=hi)
    return out.astype(q.dtype), lse


@pytest.mark.parametrize("h,kv,causal", [(8, 4, True), (8, 1, False), (6, 2, True)], ids=str)
def test_spec_gqa_matches_repeated_kv(rng, h, kv, causal):
    # The spec groups the query heads without repeating k, v; the reference repeats them.
    q, k, v = _qkv(rng, 13, 13, 8, jnp.float32, b=2, h=h, kv=kv)
    ct_out, ct_lse = randn(rng, q.shape, jnp.float32), randn(rng, (2, h, 13), jnp.float32)
    got = _values_and_grads(spec.attention_with_lse, causal, q, k, v, ct_out, ct_lse)
    want = _values_and_grads(_repeated_kv, causal, q, k, v, ct_out, ct_lse)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.shape == b.shape
        assert_close(a, b, jnp.float32)


def _one_dtype_on_cpu(cases):
    """Each case in the dtype it names, and on a GPU (its own kernels per dtype) in the other
    too: the CPU kernels share one code path for both."""
    out = []
    for *case, dtype in cases:
        other = jnp.bfloat16 if dtype == jnp.float32 else jnp.float32
        name = "-".join(map(str, case))
        out += [pytest.param(*case, dtype, id=f"{name}-{jnp.dtype(dtype).name}"),
                pytest.param(*case, other, id=f"{name}-{jnp.dtype(other).name}",
                             marks=pytest.mark.gpu)]
    return out


# (Tq, Tk, causal, D, H, KV, dtype): odd lengths, causal and not, Tq != Tk both ways, and
# groups H / KV of 1 (multi-head), 2, 3, 4 and H (one key/value head).
GQA_CASES = _one_dtype_on_cpu([
    (17, 17, True, 64, 8, 4, jnp.bfloat16), (67, 67, True, 128, 8, 2, jnp.float32),
    (5, 70, False, 64, 8, 1, jnp.bfloat16), (130, 67, False, 64, 6, 2, jnp.float32),
    (33, 33, False, 128, 8, 8, jnp.bfloat16), (70, 70, True, 64, 4, 1, jnp.float32),
    (19, 19, True, 5, 4, 2, jnp.bfloat16),  # a head size without a GPU kernel (the CPU's)
])


@pytest.mark.parametrize("tq,tk,causal,d,h,kv,dtype", GQA_CASES)
def test_gqa_values_and_grads(rng, tq, tk, causal, d, h, kv, dtype):
    # Against the spec (inside _check_values_and_grads) and against k, v repeated.
    with _device_for(d):
        args, (out, lse, got) = _check_values_and_grads(rng, tq, tk, causal, d, dtype, b=1, h=h,
                                                        kv=kv)
        out_ref, lse_ref, want = _values_and_grads(_repeated_kv, causal, *args)
    assert got[1].shape == got[2].shape == (1, tk, kv, d)
    assert_close(out, out_ref, dtype)
    assert_close(lse, lse_ref, jnp.float32, factor=5)
    for g, r in zip(got, want):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert_close(g, r, dtype, factor=2 if dtype == jnp.bfloat16 else 5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("tq,tk,causal,d,h,kv", [
    (1000, 1000, True, 64, 12, 4), (1024, 1024, False, 128, 8, 2), (1100, 1100, True, 128, 4, 1),
    (2048, 2048, True, 64, 32, 8), (300, 1030, False, 64, 6, 3),
], ids=str)
def test_gpu_gqa_long_sequences(rng, tq, tk, causal, d, h, kv, dtype):
    # Many tiles per (batch, head), so the dK/dV kernels' loop over a group's query heads
    # crosses from one head to the next inside their pipelines.
    _check_values_and_grads(rng, tq, tk, causal, d, dtype, b=1, h=h, kv=kv)


@pytest.mark.parametrize("h,kv", [(4, 2), (4, 1)], ids=str)
def test_gqa_check_grads_float64(rng, h, kv):
    with cpu_float64():
        q, k, v = _qkv(rng, 5, 5, 3, jnp.float64, b=2, h=h, kv=kv)
        for causal in (True, False):
            f = functools.partial(ops.attention_with_lse, causal=causal)
            rel_close(f(q, k, v), _repeated_kv(q, k, v, causal=causal), 1e-13)
            check_grads(f, (q, k, v), order=1, modes=("rev",))


@pytest.mark.gpu
def test_gqa_deterministic_gradients(rng):
    # dK and dV sum a group's query heads inside one CTA, in a fixed order: reruns agree bit
    # for bit (in XLA's deterministic mode, as the tests run).
    args, (_, _, got) = _check_values_and_grads(rng, 70, 70, True, 64, jnp.bfloat16, b=1, h=4,
                                                kv=1)
    again = _values_and_grads(ops.attention_with_lse, True, *args)[2]
    for a, b in zip(got, again):
        np.testing.assert_array_equal(a, b)


def test_gqa_jit_vmap_and_shard_map(rng):
    # vmap over a leading axis (one kernel call per member), and shard_map over heads: each
    # device holds H / n query heads and the KV / n key/value heads they attend to (blocks of
    # consecutive heads keep head h with head h // G).
    q = randn(rng, (2, 1, 9, 4, 64), jnp.float32)
    k = randn(rng, (2, 1, 12, 2, 64), jnp.float32)
    v = randn(rng, (2, 1, 12, 2, 64), jnp.float32)
    f = functools.partial(ops.attention_with_lse, causal=False)
    loss = lambda fn: lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)[0])) + jnp.sum(fn(q, k, v)[1])
    got = jax.jit(jax.vmap(jax.value_and_grad(loss(f), argnums=(0, 1, 2))))(q, k, v)
    want = jax.jit(jax.vmap(jax.value_and_grad(loss(functools.partial(_repeated_kv,
                                                                      causal=False)),
                                               argnums=(0, 1, 2))))(q, k, v)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert_close(a, b, jnp.float32, factor=5)

    devices = mesh_devices()
    n = len(devices)
    mesh = jax.make_mesh((n,), ("tensor",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=devices)
    q, k, v = _qkv(rng, 19, 19, 64, jnp.float32, b=1, h=4 * n, kv=n)
    ct_lse = randn(rng, (1, 4 * n, 19), jnp.float32)

    def attn_loss(op, q, k, v, ct_lse):
        out, lse = op(q, k, v)
        return jnp.sum(jnp.sin(out)) + jnp.sum(lse * ct_lse)

    @jax.jit
    def sharded(q, k, v, ct_lse):
        def body(q, k, v, ct_lse):
            return jax.lax.psum(attn_loss(ops.attention_with_lse, q, k, v, ct_lse), "tensor")
        heads = P(None, None, "tensor")
        return jax.shard_map(body, mesh=mesh, in_specs=(heads, heads, heads, P(None, "tensor")),
                             out_specs=P())(q, k, v, ct_lse)

    got = jax.value_and_grad(sharded, argnums=(0, 1, 2))(q, k, v, ct_lse)
    want = jax.jit(jax.value_and_grad(functools.partial(attn_loss, _repeated_kv),
                                      argnums=(0, 1, 2)))(q, k, v, ct_lse)
    assert_close(got[0], want[0], jnp.float32)
    for g, r in zip(got[1], want[1]):
        assert_close(g, r, jnp.float32, factor=5)
    hlo = sharded.lower(q, k, v, ct_lse).as_text()
    assert "blujax_attention_fwd" in hlo and "all-gather" not in hlo


def test_gqa_ring_attention(rng):
    # Ring attention passes k, v chunks of KV heads round the context axis and merges through
    # the lse of q's H heads: nothing in it depends on KV == H.
    from blujax import sharding

    n = 2
    devices = mesh_devices()
    if len(devices) % n:
        pytest.skip(f"needs a multiple of {n} devices")
    mesh = jax.make_mesh((n,), ("context",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=devices[:n])
    q, k, v = _qkv(rng, 8 * n, 8 * n, 64, jnp.float32, b=1, h=4, kv=2)

    def ring(q, k, v):
        return sharding.ring_attention(q, k, v, attention_with_lse=ops.attention_with_lse,
                                       axis_name="context", axis_size=n)

    seq = P(None, "context")
    sharded = jax.shard_map(ring, mesh=mesh, in_specs=(seq,) * 3, out_specs=seq)
    z = functools.partial(sharding.zigzag, n=n, axis=1)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    got = jax.jit(jax.value_and_grad(lambda *a: loss(sharded)(*map(z, a)), argnums=(0, 1, 2)))(
        q, k, v)
    want = jax.jit(jax.value_and_grad(loss(lambda *a: _repeated_kv(*a)[0]),
                                      argnums=(0, 1, 2)))(q, k, v)
    assert_close(got[0], want[0], jnp.float32, factor=5)
    for g, r in zip(got[1], want[1]):
        assert_close(g, r, jnp.float32, factor=5)


def test_gqa_bad_heads_raise_clear_errors(rng):
    q, k, v = _qkv(rng, 6, 6, 64, jnp.float32, h=6, kv=3)
    for op in (ops.attention, ops.attention_with_lse, spec.attention):
        with pytest.raises(ValueError, match=r"6 heads but k, v have 4|4 heads, which do not "
                                             r"divide q's 6"):
            op(q, jnp.concatenate([k, k[:, :, :1]], 2), jnp.concatenate([v, v[:, :, :1]], 2))
    with pytest.raises(ValueError, match=r"q has 6 heads but k, v have 4 .*the key/value heads "
                                         r"must divide the query heads"):
        ops.attention(q, jnp.concatenate([k, k[:, :, :1]], 2),
                      jnp.concatenate([v, v[:, :, :1]], 2))
    with pytest.raises(ValueError, match="q has 6 heads but k, v have 12"):
        ops.attention(q, jnp.concatenate([k, k, k, k], 2), jnp.concatenate([v, v, v, v], 2))
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        ops.attention(q, k, v[:, :, :1])
    with pytest.raises(ValueError, match="q has 6 heads but k, v have 0"):
        ops.attention(q, k[:, :, :0], v[:, :, :0])
    with pytest.raises(ValueError, match="q has 0 heads but k, v have 3"):
        ops.attention(q[:, :, :0], k, v)


@pytest.mark.parametrize("case", ["kv_not_dividing", "kv_more", "no_q_heads", "kv_unlike_v",
                                  "dk_shape", "dv_q_heads", "qkv_grouped"])
def test_gqa_handler_rejects_inconsistent_buffers(rng, case):
    q, k, v = _qkv(rng, 6, 6, 64, jnp.float32, h=4, kv=2)
    sds = jax.ShapeDtypeStruct
    o, l, c = sds(q.shape, q.dtype), sds((B, 4, 6), jnp.float32), sds((1,), jnp.int32)
    kv_like = sds(k.shape, k.dtype)
    attrs = dict(causal=True, scale=np.float64(0.3))
    lse = jnp.zeros((B, 4, 6), jnp.float32)
    three = jnp.concatenate([k, k[:, :, :1]], 2)
    fwd, bwd = "blujax_attention_fwd", "blujax_attention_bwd"
    calls = {
        "kv_not_dividing": (fwd, r"k and v have 3 heads, which do not divide q's 4",
                            lambda: _raw(fwd, (o, l, c), q, three, three, **attrs)),
        "kv_more": (fwd, r"k and v have 8 heads, which do not divide q's 4",
                    lambda: _raw(fwd, (o, l, c), q, jnp.concatenate([k] * 4, 2),
                                 jnp.concatenate([v] * 4, 2), **attrs)),
        "no_q_heads": (fwd, r"k and v have 2 heads, which do not divide q's 0",
                       lambda: _raw(fwd, (sds((B, 6, 0, 64), q.dtype), sds((B, 0, 6), jnp.float32),
                                          c), q[:, :, :0], k, v, **attrs)),
        "kv_unlike_v": (fwd, "blujax_attention_fwd: v",
                        lambda: _raw(fwd, (o, l, c), q, k, three, **attrs)),
        # dk, dv have k's KV heads, not q's H.
        "dk_shape": (bwd, "blujax_attention_bwd: dk",
                     lambda: _raw(bwd, (o, o, kv_like, l), q, k, v, q, lse, q, lse,
                                  sum_dq=False, **attrs)),
        "dv_q_heads": (bwd, "blujax_attention_bwd: dv",
                       lambda: _raw(bwd, (o, kv_like, o, l), q, k, v, q, lse, q, lse,
                                    sum_dq=False, **attrs)),
        "qkv_grouped": ("blujax_attention_qkv_bwd", "as many key/value heads as query heads",
                        lambda: _raw("blujax_attention_qkv_bwd", (sds((B, 6, 3, 4, 64),
                                                                      q.dtype), l),
                                     q, k, v, q, lse, q, lse, sum_dq=False, **attrs)),
    }
    target, message, call = calls[case]
    with pytest.raises(Exception, match=f"{target}: .*{message}|{message}"):
        jax.block_until_ready(call())


# --- attention_qkv: a fused QKV projection's output in, its gradient out in one tensor ----------

@functools.partial(jax.jit, static_argnums=(0, 1))
def _qkv_value_and_grad(fn, causal, qkv, ct):
    loss = lambda qkv: jnp.sum(fn(qkv, causal=causal).astype(jnp.float32) * ct)  # noqa: E731
    return fn(qkv, causal=causal), jax.grad(loss)(qkv)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("t,causal,d", [(1, True, 64), (17, True, 128), (67, False, 64),
                                        (130, True, 64), (200, False, 128), (33, True, 5)],
                         ids=str)
def test_qkv_values_and_grads(rng, t, causal, d, dtype):
    with _device_for(d):
        qkv = randn(rng, (B, t, 3, H, d), dtype)
        ct = randn(rng, (B, t, H, d), jnp.float32)
        out, dqkv = _qkv_value_and_grad(ops.attention_qkv, causal, qkv, ct)
        out_ref, dqkv_ref = _qkv_value_and_grad(spec.attention_qkv, causal, qkv, ct)
        assert out.dtype == dtype and out.shape == (B, t, H, d)
        assert dqkv.dtype == dtype and dqkv.shape == qkv.shape
        assert_close(out, out_ref, dtype)
        assert_close(dqkv, dqkv_ref, dtype, factor=2 if dtype == jnp.bfloat16 else 5)
        # The same kernels as attention(q, k, v): only where dq, dk, dv are written differs.
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        loss = lambda q, k, v: jnp.sum(  # noqa: E731
            ops.attention(q, k, v, causal=causal).astype(jnp.float32) * ct)
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
        np.testing.assert_array_equal(out, ops.attention(q, k, v, causal=causal))
        np.testing.assert_array_equal(dqkv, jnp.stack(grads, axis=2))
        hlo = jax.jit(jax.grad(lambda x: jnp.sum(ops.attention_qkv(x)))).lower(qkv).as_text()
        assert "blujax_attention_qkv_bwd" in hlo


def test_qkv_check_grads_float64(rng):
    with cpu_float64():
        qkv = randn(rng, (2, 6, 3, 2, 3), jnp.float64)
        assert_close(ops.attention_qkv(qkv), spec.attention_qkv(qkv), jnp.float64)
        for causal in (True, False):
            check_grads(functools.partial(ops.attention_qkv, causal=causal), (qkv,), order=1,
                        modes=("rev",))


def test_qkv_vmap(rng):
    qkv = randn(rng, (3, 2, 9, 3, 2, 64), jnp.float32)
    loss = lambda fn: lambda x: jnp.sum(jnp.sin(fn(x)))  # noqa: E731
    got = jax.jit(jax.vmap(jax.grad(loss(ops.attention_qkv))))(qkv)
    want = jax.jit(jax.vmap(jax.grad(loss(spec.attention_qkv))))(qkv)
    assert_close(got, want, jnp.float32, factor=5)


def test_qkv_bad_arguments(rng):
    qkv = randn(rng, (2, 6, 3, 2, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"attention_qkv: qkv must have shape \[B, T, 3, H, D\]"):
        ops.attention_qkv(qkv[:, :, :2])
    with pytest.raises(ValueError, match=r"attention_qkv: qkv must have shape"):
        ops.attention_qkv(qkv[0])
    with pytest.raises(TypeError, match="attention_qkv: qkv must be an array"):
        ops.attention_qkv([1, 2, 3])
    with pytest.raises(TypeError, match="dtype int32"):
        ops.attention_qkv(qkv.astype(jnp.int32))


@pytest.mark.parametrize("case", ["dqkv_shape", "dqkv_dtype", "lengths", "delta_shape"])
def test_qkv_handler_rejects_inconsistent_buffers(rng, case):
    q, k, v = _qkv(rng, 6, 6, 64, jnp.float32)
    sds = jax.ShapeDtypeStruct
    lse = jnp.zeros((B, H, 6), jnp.float32)
    l = sds(lse.shape, jnp.float32)
    good = sds((B, 6, 3, H, 64), jnp.float32)
    args = (q, k, v, q, lse, q, lse)
    outs = {"dqkv_shape": (sds((B, 6, 2, H, 64), jnp.float32), l),
            "dqkv_dtype": (sds(good.shape, jnp.bfloat16), l),
            "lengths": (good, l),
            "delta_shape": (good, sds((B, H, 5), jnp.float32))}[case]
    if case == "lengths":  # a packed gradient needs Tq == Tk
        args = (q, k[:, :5], v[:, :5], q, lse, q, lse)
    with pytest.raises(Exception, match="blujax_attention_qkv_bwd: "):
        jax.block_until_ready(_raw("blujax_attention_qkv_bwd", outs, *args, causal=False,
                                   scale=np.float64(0.3), sum_dq=False))


# --- errors a user can act on, at trace time ----------------------------------------------------

def test_bad_arguments_raise_clear_errors(rng):
    q, k, v = _qkv(rng, 6, 6, 64, jnp.float32)
    with pytest.raises(ValueError, match=r"q must have shape \[B, T, H, D\]"):
        ops.attention(q[0], k, v)
    with pytest.raises(ValueError, match=r"k must have shape \[B, T, H, D\]"):
        ops.attention(q, k[..., None], v)
    with pytest.raises(ValueError, match="q has 3 heads but k, v have 2"):
        ops.attention(q, k[:, :, :2], v[:, :, :2])
    with pytest.raises(ValueError, match="q has head size 64 but k, v have 32"):
        ops.attention(q, k[..., :32], v[..., :32])
    with pytest.raises(ValueError, match="q has batch 2 but k, v have batch 1"):
        ops.attention(q, k[:1], v[:1])
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        ops.attention(q, k, v[:, :5], causal=False)
    with pytest.raises(ValueError, match="causal=True needs as many queries as keys"):
        ops.attention(q, k[:, :5], v[:, :5], causal=True)
    with pytest.raises(ValueError, match="sequence lengths and head size must be >= 1"):
        ops.attention(q[:, :0], k, v, causal=False)
    with pytest.raises(TypeError, match="dtype int32"):
        ops.attention(q.astype(jnp.int32), k.astype(jnp.int32), v.astype(jnp.int32))
    with pytest.raises(TypeError, match="dtype float16"):
        ops.attention(q.astype(jnp.float16), k.astype(jnp.float16), v.astype(jnp.float16))
    with pytest.raises(TypeError, match="share one dtype"):
        ops.attention(q, k.astype(jnp.bfloat16), v)
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        ops.attention(q, k, v, scale=float("nan"))
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        ops.attention(q, k, v, scale=0.0)
    with pytest.raises(TypeError, match="causal must be True or False"):
        ops.attention(q, k, v, causal="yes")


# --- handlers fed inconsistent buffers directly -------------------------------------------------

def _raw(target, outs, *args, **attrs):
    return jax.jit(lambda *a: jax.ffi.ffi_call(target, outs)(*a, **attrs))(*args)


@pytest.mark.parametrize("case", ["out_shape", "lse_shape", "lse_dtype", "qk_dtype", "heads",
                                  "rank", "causal_lengths", "scale_nan", "dk_shape",
                                  "dlse_shape", "delta_shape", "delta_dtype", "int_inputs",
                                  "counter_shape", "counter_dtype"])
def test_handler_rejects_inconsistent_buffers(rng, case):
    d = 64
    q, k, v = _qkv(rng, 6, 6, d, jnp.float32)
    sds = jax.ShapeDtypeStruct
    o, l = sds(q.shape, jnp.float32), sds((B, H, 6), jnp.float32)
    c = sds((1,), jnp.int32)  # the forward's scratch counter
    fwd, bwd = "blujax_attention_fwd", "blujax_attention_bwd"
    attrs = dict(causal=True, scale=np.float64(0.3))
    bwd_attrs = dict(attrs, sum_dq=False)
    lse = jnp.zeros((B, H, 6), jnp.float32)
    bwd_args = (q, k, v, q, lse, q, lse)
    calls = {
        "out_shape": lambda: _raw(fwd, (sds((B, 6, H, d - 1), jnp.float32), l, c), q, k, v,
                                  **attrs),
        "lse_shape": lambda: _raw(fwd, (o, sds((B, 6, H), jnp.float32), c), q, k, v, **attrs),
        "lse_dtype": lambda: _raw(fwd, (o, sds((B, H, 6), jnp.bfloat16), c), q, k, v, **attrs),
        "qk_dtype": lambda: _raw(fwd, (o, l, c), q, k.astype(jnp.bfloat16), v, **attrs),
        "heads": lambda: _raw(fwd, (o, l, c), q, k[:, :, :2], v[:, :, :2], **attrs),
        "rank": lambda: _raw(fwd, (sds((B, 6, H * d), jnp.float32), l, c),
                             q.reshape(B, 6, H * d), k, v, **attrs),
        "causal_lengths": lambda: _raw(fwd, (o, l, c), q, k[:, :5], v[:, :5], **attrs),
        "scale_nan": lambda: _raw(fwd, (o, l, c), q, k, v, causal=False,
                                  scale=np.float64("nan")),
        "dk_shape": lambda: _raw(bwd, (o, sds((B, 5, H, d), jnp.float32), o, l),
                                 *bwd_args, **bwd_attrs),
        "dlse_shape": lambda: _raw(bwd, (o, o, o, l), q, k, v, q, lse, q, lse[:, :, :5],
                                   **bwd_attrs),
        "delta_shape": lambda: _raw(bwd, (o, o, o, sds((B, H, 5), jnp.float32)), *bwd_args,
                                    **bwd_attrs),
        "delta_dtype": lambda: _raw(bwd, (o, o, o, sds((B, H, 6), jnp.bfloat16)), *bwd_args,
                                    **bwd_attrs),
        "int_inputs": lambda: _raw(fwd, (sds(q.shape, jnp.int32), l, c), q.astype(jnp.int32),
                                   k.astype(jnp.int32), v.astype(jnp.int32), **attrs),
        "counter_shape": lambda: _raw(fwd, (o, l, sds((2,), jnp.int32)), q, k, v, **attrs),
        "counter_dtype": lambda: _raw(fwd, (o, l, sds((1,), jnp.float32)), q, k, v, **attrs),
    }
    with pytest.raises(Exception, match="blujax_attention_(fwd|bwd): "):
        jax.block_until_ready(calls[case]())


def test_handler_checks_scale_at_kernel_precision(rng):
    # scale arrives as a float64; the float32 and bfloat16 kernels use it as a float32, where
    # 1e-50 is 0. The float64 kernel takes it as it is (every key then weighs the same).
    q, k, v = _qkv(rng, 6, 6, 64, jnp.float32)
    sds = jax.ShapeDtypeStruct
    outs = (sds(q.shape, q.dtype), sds((B, H, 6), jnp.float32), sds((1,), jnp.int32))
    with pytest.raises(Exception, match="blujax_attention_fwd: scale must be finite and > 0 as "
                                        "a float32"):
        jax.block_until_ready(_raw("blujax_attention_fwd", outs, q, k, v, causal=False,
                                   scale=np.float64(1e-50)))
    with cpu_float64():
        q, k, v = (x.astype(jnp.float64) for x in (q, k, v))
        out = ops.attention(q, k, v, causal=False, scale=1e-50)
        rel_close(out, jnp.broadcast_to(v.mean(axis=1, keepdims=True), out.shape), 1e-14)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_bwd_returns_delta(rng, dtype):
    # The contract's fourth backward output, the same on both platforms:
    # delta = rowsum(dout * out) - dlse, [B, H, Tq] float32.
    tq = 37
    q, k, v = _qkv(rng, tq, 45, 64, dtype)
    out, lse = ops.attention_with_lse(q, k, v, causal=False)
    dout = randn(rng, q.shape, dtype)
    dlse = randn(rng, lse.shape, jnp.float32)
    sds = jax.ShapeDtypeStruct
    results = (sds(q.shape, dtype), sds(k.shape, dtype), sds(v.shape, dtype),
               sds(lse.shape, jnp.float32))
    *_, delta = _raw("blujax_attention_bwd", results, q, k, v, out, lse, dout, dlse,
                     causal=False, scale=np.float64(0.125), sum_dq=False)
    f32 = lambda x: np.asarray(x.astype(jnp.float32), np.float64)  # noqa: E731
    want = np.einsum("bqhd,bqhd->bhq", f32(dout), f32(out)) - f32(dlse)
    assert delta.dtype == jnp.float32 and delta.shape == (B, H, tq)
    assert_close(delta, want, jnp.float32, factor=5)


# dQ summed by the dK/dV kernel (bfloat16 on Hopper; attention.cu has the outline): the
# workspace result then has room for float32 dQ tiles after delta.
DQ_SUM_CASES = [(1, 1, True, 64), (17, 17, True, 64), (5, 70, False, 64), (130, 200, False, 64),
                (200, 130, False, 128), (67, 67, True, 128), (1000, 1000, True, 64)]


@pytest.mark.parametrize("tq,tk,causal,d", DQ_SUM_CASES, ids=str)
def test_bwd_workspace_with_dq_room(rng, tq, tk, causal, d):
    _check_bwd_workspace_with_dq_room(rng, tq, tk, causal, d)


@pytest.mark.parametrize("tq,tk,causal,d,h,kv", [
    (17, 17, True, 64, 4, 2),
    pytest.param(200, 130, False, 128, 6, 2, marks=pytest.mark.gpu),
    pytest.param(1000, 1000, True, 64, 4, 1, marks=pytest.mark.gpu),
    pytest.param(1100, 1100, True, 128, 8, 2, marks=pytest.mark.gpu),
], ids=str)
def test_gqa_bwd_workspace_with_dq_room(rng, tq, tk, causal, d, h, kv):
    # Grouped: the workspace stays per query head ([B, H, Tq + room]); on Hopper the summing
    # dK/dV kernel adds each query head's dQ shares into that head's rows.
    _check_bwd_workspace_with_dq_room(rng, tq, tk, causal, d, h=h, kv=kv)


def _check_bwd_workspace_with_dq_room(rng, tq, tk, causal, d, h=H, kv=None):
    # The same call with and without sum_dq (and the room it needs): the GPU takes the summing
    # kernel with it on Hopper and the two-kernel backward otherwise; the CPU leaves the room.
    # Same gradients and delta.
    q, k, v = _qkv(rng, tq, tk, d, jnp.bfloat16, h=h, kv=kv)
    out, lse = ops.attention_with_lse(q, k, v, causal=causal)
    dout = randn(rng, q.shape, jnp.bfloat16)
    dlse = randn(rng, lse.shape, jnp.float32)
    sds = jax.ShapeDtypeStruct

    def bwd(extra):
        results = (sds(q.shape, q.dtype), sds(k.shape, k.dtype), sds(v.shape, v.dtype),
                   sds((B, h, tq + extra), jnp.float32))
        return _raw("blujax_attention_bwd", results, q, k, v, out, lse, dout, dlse,
                    causal=causal, scale=np.float64(1 / np.sqrt(d)), sum_dq=extra > 0)

    *two, delta = bwd(0)
    *summed, delta_room = bwd(dq_room(tq, d))
    # delta is the workspace's first B * H * Tq values.
    np.testing.assert_array_equal(delta_room.reshape(-1)[:delta.size].reshape(delta.shape), delta)
    for got, want in zip(summed, two):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert_close(got, want, jnp.bfloat16)


@pytest.mark.parametrize("target", ["blujax_attention_bwd", "blujax_attention_qkv_bwd"])
@pytest.mark.parametrize("sum_dq", [True, False])
def test_handler_rejects_workspace_unlike_sum_dq(rng, target, sum_dq):
    # sum_dq says how long the workspace (delta) is: with it, room for the dQ sums after delta;
    # without, delta only. A workspace of the other length is an error, not a silent choice.
    tq, d = 70, 64
    q, k, v = _qkv(rng, tq, tq, d, jnp.bfloat16)
    out, lse = ops.attention_with_lse(q, k, v, causal=False)
    sds = jax.ShapeDtypeStruct
    wrong = sds((B, H, tq + (0 if sum_dq else dq_room(tq, d))), jnp.float32)
    grads = ((sds(q.shape, q.dtype), sds(k.shape, k.dtype), sds(v.shape, v.dtype))
             if target == "blujax_attention_bwd" else (sds((B, tq, 3, H, d), q.dtype),))
    right = tq + (dq_room(tq, d) if sum_dq else 0)
    want = (rf"{target}: delta has shape \[{B}, {H}, {wrong.shape[2]}\], expected "
            rf"\[{B}, {H}, {right}\].*sum_dq={str(sum_dq).lower()}")
    with pytest.raises(Exception, match=want):
        jax.block_until_ready(_raw(target, grads + (wrong,), q, k, v, out, lse, q, lse,
                                   causal=False, scale=np.float64(0.125), sum_dq=sum_dq))


def _outside_deterministic_mode(monkeypatch):
    flags = os.environ.get("XLA_FLAGS", "").split()
    monkeypatch.setenv("XLA_FLAGS", " ".join(
        f for f in flags if not f.startswith("--xla_gpu_deterministic_ops")))


@pytest.mark.parametrize("tq,tk,causal,d", DQ_SUM_CASES[:-1] + [
    pytest.param(1100, 1100, True, 128, marks=pytest.mark.gpu),  # causal, and summed on Hopper
    pytest.param(1000, 1000, True, 64, marks=pytest.mark.gpu),
], ids=str)
def test_values_and_grads_outside_deterministic_mode(rng, monkeypatch, tq, tk, causal, d):
    _check_outside_deterministic_mode(rng, monkeypatch, tq, tk, causal, d)


@pytest.mark.gpu
@pytest.mark.parametrize("tq,tk,causal,d,h,kv", [
    (1100, 1100, True, 128, 8, 2), (1000, 1000, False, 64, 12, 4), (200, 130, False, 128, 4, 1),
], ids=str)
def test_gqa_values_and_grads_outside_deterministic_mode(rng, monkeypatch, tq, tk, causal, d,
                                                         h, kv):
    _check_outside_deterministic_mode(rng, monkeypatch, tq, tk, causal, d, h=h, kv=kv)


def _check_outside_deterministic_mode(rng, monkeypatch, tq, tk, causal, d, h=H, kv=None):
    # The tests run in XLA's deterministic mode (conftest), where the backward keeps its two
    # kernels; here the summing kernel runs on Hopper, through attention and attention_qkv
    # (except in causal calls of few keys, which keep the two kernels in any mode).
    _outside_deterministic_mode(monkeypatch)
    fresh = functools.partial(ops.attention_with_lse)  # a new static argument: a new trace
    q, k, v = _qkv(rng, tq, tk, d, jnp.bfloat16, h=h, kv=kv)
    ct_out = randn(rng, q.shape, jnp.float32)
    ct_lse = randn(rng, (B, h, tq), jnp.float32)
    _, _, got = _values_and_grads(fresh, causal, q, k, v, ct_out, ct_lse)
    _, _, want = _values_and_grads(spec.attention_with_lse, causal, q, k, v, ct_out, ct_lse)
    for g, r in zip(got, want):
        assert_close(g, r, jnp.bfloat16, factor=2)
    if tq == tk and k.shape[2] == h:  # the fused qkv form is multi-head only
        qkv = jnp.stack([q, k, v], axis=2)
        fresh_qkv = functools.partial(ops.attention_qkv)
        _, dqkv = _qkv_value_and_grad(fresh_qkv, causal, qkv, ct_out)
        _, dqkv_ref = _qkv_value_and_grad(spec.attention_qkv, causal, qkv, ct_out)
        assert_close(dqkv, dqkv_ref, jnp.bfloat16, factor=2)
    hlo = jax.jit(jax.grad(lambda q: jnp.sum(ops.attention(q, k, v, causal=causal)))).lower(
        q).as_text()
    room = f"tensor<{B}x{h}x{tq + dq_room(tq, d)}xf32>"
    hopper = ON_GPU and jax.devices()[0].compute_capability == "9.0"
    # Short causal calls keep the two kernels (too few key blocks a query tile).
    assert (room in hlo) == (hopper and not (causal and tk <= CAUSAL_TWO_KERNEL_KEYS[d]))


def test_xla_deterministic_flag(monkeypatch):
    for flags, want in [("", False), ("--xla_gpu_deterministic_ops=true", True),
                        ("--xla_cpu_foo=1 --xla_gpu_deterministic_ops", True),
                        ("--xla_gpu_deterministic_ops=false", False),
                        ("--xla_gpu_deterministic_ops_other=true", False)]:
        monkeypatch.setenv("XLA_FLAGS", flags)
        assert xla_deterministic() is want, flags


def test_gpu_head_size_check_message(rng, monkeypatch):
    # What a GPU run sees for a head size without a CUDA kernel, checked everywhere.
    attention_module = importlib.import_module("blujax.kernels.attention")
    monkeypatch.setattr(attention_module, "current_platform", lambda: "gpu")
    q, k, v = _qkv(rng, 4, 4, 96, jnp.float32)
    with pytest.raises(ValueError, match=r"attention: head size D=96 has no CUDA kernel; "
                       r"supported on the GPU: 64, 128 .*use blujax.kernels.xla.attention"):
        ops.attention(q, k, v)


# --- GPU only -----------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_rejects_unsupported_head_sizes(rng):
    q, k, v = _qkv(rng, 8, 8, 96, jnp.bfloat16)
    with pytest.raises(ValueError, match="head size D=96 has no CUDA kernel"):
        ops.attention(q, k, v)
    with pytest.raises(ValueError, match="head size D=96 has no CUDA kernel"):
        jax.jit(ops.attention_with_lse)(q, k, v)
    sds = jax.ShapeDtypeStruct
    with pytest.raises(Exception, match=r"blujax_attention_fwd: head size D = 96 has no GPU "
                       r"kernel \(supported: 64 and 128\)"):
        jax.block_until_ready(_raw("blujax_attention_fwd", (sds(q.shape, q.dtype),
                                                            sds((B, H, 8), jnp.float32),
                                                            sds((1,), jnp.int32)),
                                   q, k, v, causal=True, scale=np.float64(0.1)))


@pytest.mark.gpu
@pytest.mark.parametrize("tq,causal,d,dtype", [
    (4096, True, 64, jnp.bfloat16), (4096, False, 128, jnp.bfloat16),
    (8192, True, 64, jnp.bfloat16), (8192, False, 128, jnp.float32),
], ids=str)
def test_gpu_very_long_sequences(rng, tq, causal, d, dtype):
    # Hundreds of tiles per (batch, head): the causal skip, the query-block order and the
    # streaming loops over thousands of rows (the spec materialises [Tq, Tk]; one head each).
    _check_values_and_grads(rng, tq, tq, causal, d, dtype, b=1, h=1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_gpu_more_than_65535_heads(rng, dtype):
    # B * H beyond a grid's y limit: the kernels number blocks along x only.
    _check_values_and_grads(rng, 3, 3, True, 64, dtype, b=2, h=33000)
