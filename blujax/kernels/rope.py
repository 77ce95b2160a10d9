"""Rotary position embedding (RoPE), as Hugging Face Llama applies it, on our FFI kernels.

Kernels: xla_ext/cpu/rope.cc (float32, float64, bfloat16 x) and xla_ext/cuda/rope.cu (float32,
bfloat16 x). The "rotate_half" form: each head's pair (x[d], x[d + D/2]), d < D/2, turns by the
angle whose cosine and sine are cos[t, d] and sin[t, d] of its position t. The model computes
the tables once from positions and theta (under context parallelism, this device's rows).
Arithmetic is in float32 (float64 for float64 x), each result rounded to x's dtype once.

The backward is the inverse rotation of dy (target blujax_rope_bwd: the same kernel turning the
other way), which needs only cos and sin: nothing else is saved. cos and sin get no gradient:
they are functions of positions, not parameters, so their cotangents are zeros (differentiating
with respect to them gives zeros, not the derivative). The jnp specification is
`blujax.kernels.xla.rope`.

`rope_qkv` is RoPE fused into the split of a fused QKV projection's output (targets
blujax_rope_qkv_fwd / _bwd, the same kernels over three parts of each row): one pass reads the
projection's rows and writes q and k turned and v copied, and one pass back writes the
projection's gradient; its spec is `blujax.kernels.xla.rope_qkv`.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from blujax._ffi import require_kernels
from blujax.kernels._util import check_dtype, check_float64_platform, result_type

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float64)


def rope(x, cos, sin):
    """Rotary position embedding of x by the tables cos, sin.

    x: [B, T, N, D] (any number of leading axes before T: [..., T, N, D]; N heads, D even),
    float32, bfloat16 or float64 (float64 on the CPU only). cos, sin: [T, D/2] float32 (with
    float64 x they may also be float64; both one dtype), row t for x[..., t, :, :]. For d < D/2:
    y[d] = x[d] cos[t, d] - x[d + D/2] sin[t, d] and
    y[d + D/2] = x[d + D/2] cos[t, d] + x[d] sin[t, d]. Returns an array like x. cos and sin
    get zero gradients.
    """
    _check(x, cos, sin)
    require_kernels("rope")
    return _rope(x, cos, sin)


def rope_qkv(qkv, cos, sin, *, heads: int):
    """The fused QKV projection's output split into rotated q, rotated k and v.

    qkv: [B, T, heads + 2 KV, D] (or [..., T, N, D]): `heads` query heads, then KV key heads,
    then KV value heads; dtypes and tables as for `rope`. Returns (q [..., T, heads, D] and
    k [..., T, KV, D], each as rope(...) gives it, v [..., T, KV, D] as it is). cos and sin get
    zero gradients.
    """
    _check(qkv, cos, sin, op="rope_qkv", name="qkv")
    n = qkv.shape[-2]
    if not isinstance(heads, int) or isinstance(heads, bool) or not 0 < heads < n \
            or (n - heads) % 2:
        raise ValueError(f"rope_qkv: heads must be the query heads H of qkv's H + 2 KV = {n} "
                         f"heads (0 < H < {n}, {n} - H even), got {heads!r}")
    require_kernels("rope_qkv")
    return _rope_qkv(qkv, cos, sin, heads)


def _check(x, cos, sin, op="rope", name="x"):
    if not hasattr(x, "ndim") or not hasattr(x, "dtype"):
        raise TypeError(f"{op}: {name} must be an array, got {type(x).__name__}")
    for tname, t in (("cos", cos), ("sin", sin)):
        if not hasattr(t, "shape") or not hasattr(t, "dtype"):
            raise TypeError(f"{op}: {tname} must be an array, got {type(t).__name__}")
    if x.ndim < 3:
        raise ValueError(f"{op}: {name} must have shape [B, T, N, D] (or [..., T, N, D]), got "
                         f"{tuple(x.shape)}")
    if x.shape[-1] % 2:
        raise ValueError(f"{op}: the head size D (last axis of {name}) must be even, got "
                         f"{tuple(x.shape)}")
    check_dtype(op, name, x, _DTYPES)
    check_float64_platform(op, x.dtype)
    want = (x.shape[-3], x.shape[-1] // 2)
    tables = (jnp.float32, jnp.float64) if jnp.dtype(x.dtype) == jnp.float64 else (jnp.float32,)
    for tname, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want:
            raise ValueError(
                f"{op}: {tname} must have shape (T, D/2) = {want} for {name} of shape "
                f"{tuple(x.shape)} (one row per position of {name}), got {tuple(t.shape)}"
            )
        if jnp.dtype(t.dtype) not in [jnp.dtype(d) for d in tables]:
            raise TypeError(
                f"{op}: {tname} has dtype {jnp.dtype(t.dtype).name}; it must be float32"
                + (" or float64" if len(tables) > 1 else
                   f" ({name} is {jnp.dtype(x.dtype).name}; float64 tables go with float64 "
                   f"{name})")
            )
    if cos.dtype != sin.dtype:
        raise TypeError(f"{op}: cos is {cos.dtype} but sin is {sin.dtype}; use one dtype")


def _call(target, x, cos, sin):
    return jax.ffi.ffi_call(
        target, result_type(x),
        # A batch axis of x is more positions sharing the tables (which get a leading 1).
        vmap_method="expand_dims",
    )(x, cos, sin)


@jax.custom_vjp
def _rope(x, cos, sin):
    return _call("blujax_rope_fwd", x, cos, sin)


def _rope_fwd(x, cos, sin):
    return _call("blujax_rope_fwd", x, cos, sin), (cos, sin)


def _rope_bwd(res, dy):
    cos, sin = res
    # None: a zero cotangent for each table, typed like it (replicated tables stay replicated
    # under shard_map, with no psum of zeros).
    return _call("blujax_rope_bwd", dy, cos, sin), None, None


_rope.defvjp(_rope_fwd, _rope_bwd)


def _parts(qkv, heads):
    """Result types of q, k, v split from qkv [..., T, heads + 2 KV, D]."""
    kv = (qkv.shape[-2] - heads) // 2
    lead = qkv.shape[:-2]
    return tuple(result_type(qkv, shape=(*lead, n, qkv.shape[-1])) for n in (heads, kv, kv))


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rope_qkv(qkv, cos, sin, heads):
    return _rope_qkv_fwd(qkv, cos, sin, heads)[0]


def _rope_qkv_fwd(qkv, cos, sin, heads):
    q, k, v = jax.ffi.ffi_call("blujax_rope_qkv_fwd", _parts(qkv, heads),
                               vmap_method="expand_dims")(qkv, cos, sin)
    return (q, k, v), (cos, sin)


def _rope_qkv_bwd(heads, res, grads):
    cos, sin = res
    dq, dk, dv = grads
    n = heads + 2 * dk.shape[-2]
    dqkv = jax.ffi.ffi_call(
        "blujax_rope_qkv_bwd", result_type(dq, shape=(*dq.shape[:-2], n, dq.shape[-1])),
        vmap_method="expand_dims")(dq, dk, dv, cos, sin)
    return dqkv, None, None


_rope_qkv.defvjp(_rope_qkv_fwd, _rope_qkv_bwd)
