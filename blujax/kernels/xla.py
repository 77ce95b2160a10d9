"""Every blujax op written in plain jnp, with the same signature as in `blujax.kernels`.

This is the specification: tests compare our kernels (values and `jax.grad`) against it, and
benchmarks run it as the "plain XLA" side. Arithmetic happens in float32 (float64 for float64
inputs) and results are cast back to the input dtype, as the kernels do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _compute_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def layer_norm(x, weight, bias, *, eps: float = 1e-5):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis."""
    ct = _compute_dtype(x.dtype)
    xc = x.astype(ct)
    mean = jnp.mean(xc, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xc - mean), axis=-1, keepdims=True)
    y = (xc - mean) * jax.lax.rsqrt(var + eps) * weight.astype(ct) + bias.astype(ct)
    return y.astype(x.dtype)


def add_layer_norm(x, residual, weight, bias, *, eps: float = 1e-5):
    """(layer_norm(x + residual), x + residual)."""
    s = x + residual
    return layer_norm(s, weight, bias, eps=eps), s


def gelu(x, bias=None):
    """jax.nn.gelu(x + bias, approximate=True); x + bias is formed in the compute dtype and
    is not rounded to x's dtype before GELU."""
    v = x.astype(_compute_dtype(x.dtype))
    if bias is not None:
        v = v + bias.astype(v.dtype)
    return jax.nn.gelu(v, approximate=True).astype(x.dtype)
