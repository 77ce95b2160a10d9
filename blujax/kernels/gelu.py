"""GELU (tanh approximation) of x + bias, the GPT-2 MLP activation, on our FFI kernels.

Kernels: xla_ext/cpu/gelu.cc (float32, float64, bfloat16) and xla_ext/cuda/gelu.cu (float32,
bfloat16). The bias add is fused in: v = x + bias is formed in float32 (float64 for float64 x)
and is not rounded before GELU, so bfloat16 loses precision once, in the output. The forward
saves x (and bias); the backward reads dy and x once, writes dx, and sums dbias over the rows in
the same pass. The jnp specification is `blujax.kernels.xla.gelu`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from blujax._ffi import current_platform, require_kernels
from blujax.kernels._util import (check_dtype, check_feature_param, check_float64_platform,
                                  match_vma, result_type)

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float64)
# Bound on the partial dbias rows of the CUDA backward: it launches about 4 blocks per
# multiprocessor (far fewer than _MAX_BLOCKS), each spanning at most _TILE_COLS columns, and
# needs one partial row per block in a column.
_MAX_BLOCKS = 1024
_TILE_COLS = 256


def gelu(x, bias=None):
    """jax.nn.gelu(x + bias, approximate=True), with x + bias kept in float32.

    x: [..., C] float32, bfloat16 or float64 (float64 on the CPU only); bias: [C] of x's dtype,
    or None. Returns an array like x.
    """
    _check(x, bias)
    require_kernels("gelu")
    if bias is None:
        return _gelu(x)
    x, bias = match_vma(x, bias)
    return _bias_gelu(x, bias)


def _check(x, bias):
    if not hasattr(x, "ndim") or not hasattr(x, "dtype"):
        raise TypeError(f"gelu: x must be an array, got {type(x).__name__}")
    if x.ndim < 1:
        raise ValueError("gelu: x must have at least one axis (bias runs along the last), "
                         "got a scalar")
    check_dtype("gelu", "x", x, _DTYPES)
    if bias is not None:
        if not hasattr(bias, "shape") or not hasattr(bias, "dtype"):
            raise TypeError(f"gelu: bias must be an array or None, got {type(bias).__name__}")
        check_feature_param("gelu", "bias", bias, x)
    check_float64_platform("gelu", x.dtype)


def _partials(x) -> int:
    if current_platform() == "cpu":
        return 1
    rows, c = math.prod(x.shape[:-1]), x.shape[-1]
    tiles = max(1, -(-c // _TILE_COLS))
    return max(1, min(rows, -(-_MAX_BLOCKS // tiles)))


# --- without bias -------------------------------------------------------------------------------

def _fwd_call(x):
    return jax.ffi.ffi_call(
        "blujax_gelu_fwd", result_type(x),
        vmap_method="expand_dims",  # elementwise: a batch axis is just more elements
    )(x)


@jax.custom_vjp
def _gelu(x):
    return _fwd_call(x)


def _gelu_fwd(x):
    return _fwd_call(x), x


def _gelu_bwd(x, dy):
    dx = jax.ffi.ffi_call("blujax_gelu_bwd", result_type(x), vmap_method="expand_dims")(dy, x)
    return (dx,)


_gelu.defvjp(_gelu_fwd, _gelu_bwd)


# --- with bias ----------------------------------------------------------------------------------

def _bias_fwd_call(x, bias):
    return jax.ffi.ffi_call(
        "blujax_bias_gelu_fwd", result_type(x),
        vmap_method="expand_dims",  # a batch axis of x is more rows sharing the bias
    )(x, bias)


@jax.custom_vjp
def _bias_gelu(x, bias):
    return _bias_fwd_call(x, bias)


def _bias_gelu_fwd(x, bias):
    return _bias_fwd_call(x, bias), (x, bias)


def _bias_gelu_bwd(res, dy):
    x, bias = res
    ws = result_type(x, (_partials(x), x.shape[-1]), jnp.float32)
    dx, dbias, _ = jax.ffi.ffi_call(
        "blujax_bias_gelu_bwd",
        (result_type(x), result_type(bias), ws),
        vmap_method="sequential",  # each batch member has its own dbias
    )(dy, x, bias)
    return dx, dbias


_bias_gelu.defvjp(_bias_gelu_fwd, _bias_gelu_bwd)
