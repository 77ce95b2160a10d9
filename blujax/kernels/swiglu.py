"""SwiGLU, silu(gate) * up, the Llama MLP activation, on our FFI kernels.

Kernels: xla_ext/cpu/swiglu.cc (float32, float64, bfloat16) and xla_ext/cuda/swiglu.cu (float32,
bfloat16). The input is the output of one fused projection, x [..., 2, F] = (gate, up) (the
model computes h @ W with W [C, 2, F], a free reshape), so the backward returns its gradient as
one [..., 2, F] tensor, with no concatenation pass. Arithmetic is in float32 (float64 for
float64 x) and each result is rounded to x's dtype once. The forward saves only x; the backward
recomputes sigmoid(gate) from it in the same single pass over dy and x. The jnp specification
is `blujax.kernels.xla.swiglu`.

The FP8 forms (`swiglu_fwd_fp8`, `swiglu_bwd_fp8`; float32 and bfloat16) are what blujax.fp8's
fused MLP runs: in the same pass, instead of y (or the backward's dx), they write its FP8 copy
at a given scale, the copy's transpose (an FP8 product wants both operands with the
contracted axis innermost, and the weight-gradient product contracts over the rows) and its
amax, where a separate cast would read y again. Not differentiable themselves: the fused MLP's
own vjp calls the backward form. Specs: `blujax.kernels.xla.swiglu_fwd_fp8`, `swiglu_bwd_fp8`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from blujax._ffi import require_kernels
from blujax.kernels._util import (check_dtype, check_float64_platform, check_fp8, match_vma,
                                  result_type)

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float64)


def swiglu(x):
    """silu(x[..., 0, :]) * x[..., 1, :], with silu(g) = g * sigmoid(g).

    x: [..., 2, F] (gate, up), float32, bfloat16 or float64 (float64 on the CPU only).
    Returns [..., F] in x's dtype.
    """
    _check(x)
    require_kernels("swiglu")
    return _swiglu(x)


def swiglu_fwd_fp8(x, scale, dtype=jnp.float8_e4m3fn):
    """(q, qt, amax) of y = swiglu(x) without y: q = y / scale saturated and rounded to dtype
    (float8_e4m3fn or float8_e5m2), as rows [N, F] (N the product of x's axes before (2, F)),
    qt its transpose [F, N], amax = max |y| float32 [] (y as swiglu writes it, in x's dtype).

    x: [..., 2, F] float32 or bfloat16; scale: a float32 scalar (blujax.fp8.scale_of).
    """
    check_fp8("swiglu_fwd_fp8", x, scale, dtype)
    _check(x)
    require_kernels("swiglu")
    rows, f = math.prod(x.shape[:-2]), x.shape[-1]
    x, scale = match_vma(x, jnp.asarray(scale, jnp.float32))
    return jax.ffi.ffi_call(
        "blujax_swiglu_fwd_fp8",
        (result_type(x, (rows, f), dtype), result_type(x, (f, rows), dtype),
         result_type(x, (), jnp.float32)),
    )(x, scale)


def swiglu_bwd_fp8(dy, x, scale, dtype=jnp.float8_e5m2):
    """(q, qt, amax) of dx, swiglu's gradient at x for dy [..., F], without dx: as
    swiglu_fwd_fp8's, of dx as rows [N, 2F] ((d gate, d up) a row, x's layout)."""
    check_fp8("swiglu_bwd_fp8", x, scale, dtype)
    _check(x)
    if getattr(dy, "shape", None) != x.shape[:-2] + x.shape[-1:] or dy.dtype != x.dtype:
        raise ValueError(f"swiglu_bwd_fp8: dy must be {x.dtype} {x.shape[:-2] + x.shape[-1:]} "
                         f"(x's shape without its axis of 2), got "
                         f"{getattr(dy, 'dtype', type(dy).__name__)} {getattr(dy, 'shape', '')}")
    require_kernels("swiglu")
    rows, f = math.prod(x.shape[:-2]), x.shape[-1]
    dy, x, scale = match_vma(dy, x, jnp.asarray(scale, jnp.float32))
    return jax.ffi.ffi_call(
        "blujax_swiglu_bwd_fp8",
        (result_type(x, (rows, 2 * f), dtype), result_type(x, (2 * f, rows), dtype),
         result_type(x, (), jnp.float32)),
    )(dy, x, scale)


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
