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
"""

from __future__ import annotations

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


def _check(x, cos, sin):
    if not hasattr(x, "ndim") or not hasattr(x, "dtype"):
        raise TypeError(f"rope: x must be an array, got {type(x).__name__}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not hasattr(t, "shape") or not hasattr(t, "dtype"):
            raise TypeError(f"rope: {name} must be an array, got {type(t).__name__}")
    if x.ndim < 3:
        raise ValueError(f"rope: x must have shape [B, T, N, D] (or [..., T, N, D]), got "
                         f"{tuple(x.shape)}")
    if x.shape[-1] % 2:
        raise ValueError(f"rope: the head size D (last axis of x) must be even, got "
                         f"{tuple(x.shape)}")
    check_dtype("rope", "x", x, _DTYPES)
    check_float64_platform("rope", x.dtype)
    want = (x.shape[-3], x.shape[-1] // 2)
    tables = (jnp.float32, jnp.float64) if jnp.dtype(x.dtype) == jnp.float64 else (jnp.float32,)
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want:
            raise ValueError(
                f"rope: {name} must have shape (T, D/2) = {want} for x of shape "
                f"{tuple(x.shape)} (one row per position of x), got {tuple(t.shape)}"
            )
        if jnp.dtype(t.dtype) not in [jnp.dtype(d) for d in tables]:
            raise TypeError(
                f"rope: {name} has dtype {jnp.dtype(t.dtype).name}; it must be float32"
                + (" or float64" if len(tables) > 1 else
                   f" (x is {jnp.dtype(x.dtype).name}; float64 tables go with float64 x)")
            )
    if cos.dtype != sin.dtype:
        raise TypeError(f"rope: cos is {cos.dtype} but sin is {sin.dtype}; use one dtype")


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
