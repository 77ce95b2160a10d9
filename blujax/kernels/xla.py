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


def softmax_cross_entropy(logits, targets, *, ignore_index: int = -1):
    """Per-row logsumexp(logits[n]) - logits[n, targets[n]], float32 (float64 for float64).

    Rows whose target is ignore_index give 0 and no gradient; other targets outside [0, V)
    give NaN, and a NaN gradient row.
    """
    x = logits.astype(_compute_dtype(logits.dtype))
    lse = jax.nn.logsumexp(x, axis=-1)
    ignored = targets == ignore_index
    known = (targets >= 0) & (targets < x.shape[-1])
    picked = jnp.take_along_axis(x, jnp.where(known, targets, 0)[:, None], axis=-1)[:, 0]
    # A factor rather than a select, so that unknown targets poison the gradient as well.
    poison = jnp.where(known | ignored, 1.0, jnp.nan).astype(x.dtype)
    return jnp.where(ignored, 0.0, (lse - picked) * poison)
