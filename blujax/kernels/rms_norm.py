"""RMSNorm over the last axis, and its fused residual-add variant, on our FFI kernels.

Kernels: xla_ext/cpu/rms_norm.cc (float32, float64, bfloat16) and xla_ext/cuda/rms_norm.cu
(float32, bfloat16); statistics are float32 (float64 for float64 input). The forward saves
rstd; the backward computes dx and dweight in one pass over dy and x. The residual-add
variant is the Llama block's `s = x + residual; rms_norm(s)`, one kernel each way. The jnp
specification is `blujax.kernels.xla.rms_norm` / `add_rms_norm`.

The add variant's FP8 form (`add_rms_norm_fwd_fp8`; float32 and bfloat16) is what blujax.fp8's
pieces that begin with the norm run: in the pass that normalises, instead of y it writes y's
FP8 copy at a given scale, the copy's transpose (for the weight-gradient product) and y's
amax, beside the sum and rstd. Its backward is the plain one's, `add_rms_norm_bwd`, which the
pieces' own vjps call. Specs: `blujax.kernels.xla.add_rms_norm_fwd_fp8`, `add_rms_norm_bwd`.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from blujax._ffi import current_platform, require_kernels
from blujax.kernels._util import (check_dtype, check_feature_param, check_float64_platform,
                                  check_fp8, match_vma, result_type)

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float64)
# Upper bound on the per-block partial rows of dweight the CUDA backward may use; it launches
# at most a few blocks per multiprocessor, so most of this is never touched.
_MAX_PARTIALS = 1024


def rms_norm(x, weight, *, eps: float = 1e-5):
    """x / sqrt(mean(x^2) + eps) * weight over the last axis of x (no mean subtracted, no bias).

    x: [..., C] float32, bfloat16 or float64 (float64 on the CPU only); weight: [C] of x's
    dtype. Statistics are float32 (float64 for float64); the product is rounded to x's dtype
    once. Returns an array like x.
    """
    _check("rms_norm", x, weight, eps)
    require_kernels("rms_norm")
    x, weight = match_vma(x, weight)
    return _rms_norm(x, weight, float(eps))


def add_rms_norm(x, residual, weight, *, eps: float = 1e-5):
    """The Llama block's `s = x + residual; rms_norm(s)` in one pass.

    Returns (rms_norm(s), s); s is rounded to x's dtype before it is normalised, as
    add_layer_norm's is. The backward takes the cotangents of both outputs and gives x and
    residual the same gradient (one array).
    """
    _check_add("add_rms_norm", x, residual, weight, eps)
    x, residual, weight = match_vma(x, residual, weight)
    return _add_rms_norm(x, residual, weight, float(eps))


def add_rms_norm_fwd_fp8(x, residual, weight, scale, dtype=jnp.float8_e4m3fn, *,
                         eps: float = 1e-5):
    """(q, qt, amax, s, rstd) of add_rms_norm's (y, s) without y: q = y / scale saturated and
    rounded to dtype (float8_e4m3fn or float8_e5m2) as rows [N, C] (N the product of x's
    leading axes), qt its transpose [C, N], amax = max |y| float32 [] (y as add_rms_norm writes
    it, in x's dtype); s = x + residual like x; rstd float32 [...] (x's leading axes), what
    add_rms_norm_bwd takes.

    x, residual: [..., C] float32 or bfloat16; weight [C]; scale: a float32 scalar
    (blujax.fp8.scale_of).
    """
    op = "add_rms_norm_fwd_fp8"
    check_fp8(op, x, scale, dtype)
    _check_add(op, x, residual, weight, eps)
    rows, c = math.prod(x.shape[:-1]), x.shape[-1]
    x, residual, weight, scale = match_vma(x, residual, weight, jnp.asarray(scale, jnp.float32))
    return jax.ffi.ffi_call(
        "blujax_add_rms_norm_fwd_fp8",
        (result_type(x, (rows, c), dtype), result_type(x, (c, rows), dtype),
         result_type(x, (), jnp.float32), result_type(x),
         result_type(x, x.shape[:-1], jnp.float32)),
    )(x, residual, weight, scale, eps=np.float64(eps))


def add_rms_norm_bwd(dy, dsum, s, weight, rstd, *, eps: float = 1e-5):
    """add_rms_norm's backward: (dx, dweight) for the cotangents dy of its y and dsum of its
    s, from what its forward (or add_rms_norm_fwd_fp8) kept: s, weight and rstd. dx is the
    gradient of both x and residual. eps is the forward's (rstd already holds it; the spec
    recomputes from s)."""
    _check("add_rms_norm_bwd", s, weight, eps)
    for name, t in (("dy", dy), ("dsum", dsum)):
        if getattr(t, "shape", None) != s.shape or t.dtype != s.dtype:
            raise ValueError(f"add_rms_norm_bwd: {name} must match s ({s.dtype}"
                             f"{list(s.shape)}), got {getattr(t, 'dtype', type(t).__name__)}"
                             f"{list(getattr(t, 'shape', []))}")
    if rstd.shape != s.shape[:-1] or rstd.dtype != _stat_dtype(s.dtype):
        raise ValueError(f"add_rms_norm_bwd: rstd must be {jnp.dtype(_stat_dtype(s.dtype)).name}"
                         f"{list(s.shape[:-1])}, got {rstd.dtype}{list(rstd.shape)}")
    require_kernels("add_rms_norm")
    dy, dsum, s, weight, rstd = match_vma(dy, dsum, s, weight, rstd)
    return _add_bwd_call(dy, dsum, s, weight, rstd)


def _check_add(op, x, residual, weight, eps):
    _check(op, x, weight, eps)
    if getattr(residual, "shape", None) != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"{op}: residual must match x ({x.dtype}{list(x.shape)}), "
            f"got {getattr(residual, 'dtype', type(residual).__name__)}"
            f"{list(getattr(residual, 'shape', []))}"
        )
    require_kernels("add_rms_norm")


def _check(op, x, weight, eps):
    if x.ndim < 1:
        raise ValueError(f"{op}: x must have at least one axis (the one normalised), got a scalar")
    if x.shape[-1] == 0:
        raise ValueError(f"{op}: the last axis of x is empty (shape {x.shape})")
    check_dtype(op, "x", x, _DTYPES)
    check_feature_param(op, "weight", weight, x)
    if not (isinstance(eps, (int, float, np.floating)) and not isinstance(eps, bool)
            and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps!r}")
    check_float64_platform(op, x.dtype)


def _stat_dtype(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _workspace(x):
    """The backward's [P, C] float32 workspace type (P = 1 on the CPU, which does not use it)."""
    rows = math.prod(x.shape[:-1])
    p = 1 if current_platform() == "cpu" else max(1, min(rows, _MAX_PARTIALS))
    return result_type(x, (p, x.shape[-1]), jnp.float32)


def _fwd_call(x, weight, eps):
    return jax.ffi.ffi_call(
        "blujax_rms_norm_fwd",
        (result_type(x), result_type(x, x.shape[:-1], _stat_dtype(x.dtype))),
        vmap_method="expand_dims",  # a batch axis is just more rows
    )(x, weight, eps=np.float64(eps))  # float64: exact for float64 x


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm(x, weight, eps):
    return _fwd_call(x, weight, eps)[0]


def _rms_norm_fwd(x, weight, eps):
    y, rstd = _fwd_call(x, weight, eps)
    return y, (x, weight, rstd)


def _rms_norm_bwd(eps, res, dy):
    x, weight, rstd = res
    dx, dw, _ = jax.ffi.ffi_call(
        "blujax_rms_norm_bwd",
        (result_type(x), result_type(weight), _workspace(x)),
        vmap_method="sequential",  # each batch member has its own dweight
    )(dy, x, weight, rstd)
    return dx, dw


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def _add_fwd_call(x, residual, weight, eps):
    return jax.ffi.ffi_call(
        "blujax_add_rms_norm_fwd",
        (result_type(x), result_type(x), result_type(x, x.shape[:-1], _stat_dtype(x.dtype))),
        vmap_method="expand_dims",
    )(x, residual, weight, eps=np.float64(eps))


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _add_rms_norm(x, residual, weight, eps):
    y, s, _ = _add_fwd_call(x, residual, weight, eps)
    return y, s


def _add_rms_norm_fwd(x, residual, weight, eps):
    y, s, rstd = _add_fwd_call(x, residual, weight, eps)
    return (y, s), (s, weight, rstd)


def _add_bwd_call(dy, ds, s, weight, rstd):
    dx, dw, _ = jax.ffi.ffi_call(
        "blujax_add_rms_norm_bwd",
        (result_type(s), result_type(weight), _workspace(s)),
        vmap_method="sequential",
    )(dy, ds, s, weight, rstd)
    return dx, dw


def _add_rms_norm_bwd(eps, res, cts):
    dx, dw = _add_bwd_call(*cts, *res)
    # The sum's gradient flows to both of its terms.
    return dx, dx, dw


_add_rms_norm.defvjp(_add_rms_norm_fwd, _add_rms_norm_bwd)
