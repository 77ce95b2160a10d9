"""SwiGLU, silu(gate) * up, the Llama MLP activation, on our FFI kernels.

Kernels: xla_ext/cpu/swiglu.cc (float32, float64, bfloat16) and xla_ext/cuda/swiglu.cu (float32,
bfloat16). The input is the output of one fused projection, x [..., 2, F] = (gate, up) (the
model computes h @ W with W [C, 2, F], a free reshape), so the backward returns its gradient as
one [..., 2, F] tensor, with no concatenation pass. Arithmetic is in float32 (float64 for
float64 x) and each result is rounded to x's dtype once. The forward saves only x; the backward
recomputes sigmoid(gate) from it in the same single pass over dy and x. The jnp specification
is `blujax.kernels.xla.swiglu`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from blujax._ffi import require_kernels
from blujax.kernels._util import check_dtype, check_float64_platform, result_type

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float64)


def swiglu(x):
    """silu(x[..., 0, :]) * x[..., 1, :], with silu(g) = g * sigmoid(g).

    x: [..., 2, F] (gate, up), float32, bfloat16 or float64 (float64 on the CPU only).
    Returns [..., F] in x's dtype.
    """
    _check(x)
    require_kernels("swiglu")
    return _swiglu(x)


def _check(x):
    if not hasattr(x, "ndim") or not hasattr(x, "dtype"):
        raise TypeError(f"swiglu: x must be an array, got {type(x).__name__}")
    if x.ndim < 2 or x.shape[-2] != 2:
        raise ValueError(
            "swiglu: x must have shape [..., 2, F]: (gate, up) along its second-to-last axis, "
            f"got {tuple(x.shape)}"
        )
    check_dtype("swiglu", "x", x, _DTYPES)
    check_float64_platform("swiglu", x.dtype)


def _fwd_call(x):
    return jax.ffi.ffi_call(
        "blujax_swiglu_fwd", result_type(x, x.shape[:-2] + x.shape[-1:]),
        vmap_method="expand_dims",  # elementwise over rows: a batch axis is just more rows
    )(x)


@jax.custom_vjp
def _swiglu(x):
    return _fwd_call(x)


def _swiglu_fwd(x):
    return _fwd_call(x), x


def _swiglu_bwd(x, dy):
    dx = jax.ffi.ffi_call(
        "blujax_swiglu_bwd", result_type(x),
        # dy and x pair up element by element: one batched alone is broadcast to the other.
        vmap_method="broadcast_all",
    )(dy, x)
    return (dx,)


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
