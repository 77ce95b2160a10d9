"""LayerNorm over the last axis, and its fused residual-add variant, on our FFI kernels.

Kernels: xla_ext/cpu/layernorm.cc (float32, float64, bfloat16) and xla_ext/cuda/layernorm.cu
(float32, bfloat16); statistics are float32 (float64 for float64 input). The forward saves
mean and rstd; the backward computes dx, dweight and dbias in one pass over dy and x.
The residual-add variant can also fold in the bias of the matmul before it (`x_bias`), whose
gradient the backward then sums in the same pass. The jnp specification is
`blujax.kernels.xla.layer_norm` / `add_layer_norm`.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from blujax._ffi import current_platform, require_kernels
from blujax.kernels._util import (check_dtype, check_feature_param, check_float64_platform,
                                  match_vma, result_type)

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float64)
# Upper bound on the per-block partial rows of dweight/dbias the CUDA backward may use; it
# launches at most a few blocks per multiprocessor, so most of this is never touched.
_MAX_PARTIALS = 1024


def layer_norm(x, weight, bias, *, eps: float = 1e-5):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis of x.

    x: [..., C] float32, bfloat16 or float64 (float64 on the CPU only); weight, bias: [C] of
    x's dtype. Returns an array like x.
    """
    _check("layer_norm", x, weight, bias, eps)
    require_kernels("layer_norm")
    x, weight, bias = match_vma(x, weight, bias)
    return _layer_norm(x, weight, bias, float(eps))


def add_layer_norm(x, residual, weight, bias, *, x_bias=None, eps: float = 1e-5):
    """The transformer block's `s = x + residual; layer_norm(s)` in one pass.

    Returns (layer_norm(s), s); s is rounded to x's dtype before it is normalised.

    x_bias: optional [C] of x's dtype, the bias of the matmul that produced x (the attention
    or MLP output projection), folded in here rather than added by XLA in a pass of its own:
    s = x + x_bias + residual, summed in float32 (float64 for float64) and rounded once. Its
    gradient (the column sums of s's gradient) comes out of the same backward pass.
    """
    _check("add_layer_norm", x, weight, bias, eps)
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"add_layer_norm: residual must match x ({x.dtype}{list(x.shape)}), "
            f"got {residual.dtype}{list(residual.shape)}"
        )
    if x_bias is not None:
        check_feature_param("add_layer_norm", "x_bias", x_bias, x)
    require_kernels("add_layer_norm")
    if x_bias is None:
        x, residual, weight, bias = match_vma(x, residual, weight, bias)
        return _add_layer_norm(x, residual, weight, bias, float(eps))
    x, x_bias, residual, weight, bias = match_vma(x, x_bias, residual, weight, bias)
    return _add_bias_layer_norm(x, x_bias, residual, weight, bias, float(eps))


def _check(op, x, weight, bias, eps):
    if x.ndim < 1:
        raise ValueError(f"{op}: x must have at least one axis (the one normalised), got a scalar")
    c = x.shape[-1]
    if c == 0:
        raise ValueError(f"{op}: the last axis of x is empty (shape {x.shape})")
    check_dtype(op, "x", x, _DTYPES)
    for name, p in (("weight", weight), ("bias", bias)):
        check_feature_param(op, name, p, x)
    if not (isinstance(eps, (int, float, np.floating)) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps!r}")
    check_float64_platform(op, x.dtype)


def _stat_dtype(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _partials(x) -> int:
    """P of the backward's [P, planes, C] workspace."""
    rows = math.prod(x.shape[:-1])
    return 1 if current_platform() == "cpu" else max(1, min(rows, _MAX_PARTIALS))


def _fwd_call(x, weight, bias, eps):
    stats = result_type(x, x.shape[:-1], _stat_dtype(x.dtype))
    return jax.ffi.ffi_call(
        "blujax_layer_norm_fwd",
        (result_type(x), stats, stats),
        vmap_method="expand_dims",  # a batch axis is just more rows
    )(x, weight, bias, eps=np.float32(eps))


def _bwd_call(dy, x, weight, mean, rstd):
    ws = result_type(x, (_partials(x), 2, x.shape[-1]), jnp.float32)
    dx, dw, db, _ = jax.ffi.ffi_call(
        "blujax_layer_norm_bwd",
        (result_type(x), result_type(weight), result_type(weight), ws),
        vmap_method="sequential",  # each batch member has its own dweight, dbias
    )(dy, x, weight, mean, rstd)
    return dx, dw, db


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _layer_norm(x, weight, bias, eps):
    return _fwd_call(x, weight, bias, eps)[0]


def _layer_norm_fwd(x, weight, bias, eps):
    y, mean, rstd = _fwd_call(x, weight, bias, eps)
    return y, (x, weight, mean, rstd)


def _layer_norm_bwd(eps, res, dy):
    return _bwd_call(dy, *res)


_layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def _add_fwd_call(x, residual, weight, bias, eps):
    stats = result_type(x, x.shape[:-1], _stat_dtype(x.dtype))
    return jax.ffi.ffi_call(
        "blujax_add_layer_norm_fwd",
        (result_type(x), result_type(x), stats, stats),
        vmap_method="expand_dims",
    )(x, residual, weight, bias, eps=np.float32(eps))


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _add_layer_norm(x, residual, weight, bias, eps):
    y, s, _, _ = _add_fwd_call(x, residual, weight, bias, eps)
    return y, s


def _add_layer_norm_fwd(x, residual, weight, bias, eps):
    y, s, mean, rstd = _add_fwd_call(x, residual, weight, bias, eps)
    return (y, s), (s, weight, mean, rstd)


def _add_layer_norm_bwd(eps, res, cts):
    s, weight, mean, rstd = res
    dy, ds = cts
    ws = result_type(s, (_partials(s), 2, s.shape[-1]), jnp.float32)
    dx, dw, db, _ = jax.ffi.ffi_call(
        "blujax_add_layer_norm_bwd",
        (result_type(s), result_type(weight), result_type(weight), ws),
        vmap_method="sequential",
    )(dy, ds, s, weight, mean, rstd)
    # The sum's gradient flows to both of its terms.
    return dx, dx, dw, db


_add_layer_norm.defvjp(_add_layer_norm_fwd, _add_layer_norm_bwd)


# The add-bias variant: s = x + x_bias + residual. Its own targets, so the ones above (and their
# kernels) stay as they are.

def _add_bias_fwd_call(x, x_bias, residual, weight, bias, eps):
    stats = result_type(x, x.shape[:-1], _stat_dtype(x.dtype))
    return jax.ffi.ffi_call(
        "blujax_add_bias_layer_norm_fwd",
        (result_type(x), result_type(x), stats, stats),
        vmap_method="expand_dims",
    )(x, x_bias, residual, weight, bias, eps=np.float32(eps))


@partial(jax.custom_vjp, nondiff_argnums=(5,))
def _add_bias_layer_norm(x, x_bias, residual, weight, bias, eps):
    y, s, _, _ = _add_bias_fwd_call(x, x_bias, residual, weight, bias, eps)
    return y, s


def _add_bias_layer_norm_fwd(x, x_bias, residual, weight, bias, eps):
    y, s, mean, rstd = _add_bias_fwd_call(x, x_bias, residual, weight, bias, eps)
    return (y, s), (s, weight, mean, rstd)


def _add_bias_layer_norm_bwd(eps, res, cts):
    s, weight, mean, rstd = res
    dy, ds = cts
    # A third partial row per block: dx_bias beside dweight and dbias.
    ws = result_type(s, (_partials(s), 3, s.shape[-1]), jnp.float32)
    dx, dw, db, dxb, _ = jax.ffi.ffi_call(
        "blujax_add_bias_layer_norm_bwd",
        (result_type(s), result_type(weight), result_type(weight), result_type(weight), ws),
        vmap_method="sequential",
    )(dy, ds, s, weight, mean, rstd)
    # The sum's gradient flows to x and residual; x_bias gets its column sums.
    return dx, dxb, dx, dw, db


_add_bias_layer_norm.defvjp(_add_bias_layer_norm_fwd, _add_bias_layer_norm_bwd)
