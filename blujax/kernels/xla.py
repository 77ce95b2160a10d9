"""Every blujax op written in plain jnp, with the same signature as in `blujax.kernels`.

This is the specification: tests compare our kernels (values and `jax.grad`) against it, and
benchmarks run it as the "plain XLA" side. Arithmetic happens in float32 (float64 for float64
inputs) and results are cast back to the input dtype, as the kernels do.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


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


def add_layer_norm(x, residual, weight, bias, *, x_bias=None, eps: float = 1e-5):
    """(layer_norm(s), s) with s = x + residual.

    x_bias (optional, [C]): the bias of the matmul that produced x, folded in:
    s = x + x_bias + residual, summed in the compute dtype and rounded to x's dtype once.
    """
    if x_bias is None:
        s = x + residual
    else:
        ct = _compute_dtype(x.dtype)
        s = (x.astype(ct) + x_bias.astype(ct) + residual.astype(ct)).astype(x.dtype)
    return layer_norm(s, weight, bias, eps=eps), s


def rms_norm(x, weight, *, eps: float = 1e-5):
    """x / sqrt(mean(x^2) + eps) * weight over the last axis (no mean subtracted, no bias)."""
    ct = _compute_dtype(x.dtype)
    xc = x.astype(ct)
    ms = jnp.mean(jnp.square(xc), axis=-1, keepdims=True)
    return (xc * jax.lax.rsqrt(ms + eps) * weight.astype(ct)).astype(x.dtype)


def add_rms_norm(x, residual, weight, *, eps: float = 1e-5):
    """(rms_norm(s), s) with s = x + residual, in x's dtype."""
    s = x + residual
    return rms_norm(s, weight, eps=eps), s


def add_rms_norm_fwd_fp8(x, residual, weight, scale, dtype=jnp.float8_e4m3fn, *,
                         eps: float = 1e-5):
    """add_rms_norm's FP8 form, for an FP8 product that takes its y: (q, qt, amax, s, rstd)
    with (y, s) = add_rms_norm(x, residual, weight), (q, qt, amax) = fp8_copy of y as rows
    [N, C], and rstd = 1 / sqrt(mean(s^2) + eps) float32 [...] (x's leading axes)."""
    y, s = add_rms_norm(x, residual, weight, eps=eps)
    sc = s.astype(jnp.float32)
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(sc), axis=-1) + jnp.float32(eps))
    return (*fp8_copy(y.reshape(-1, x.shape[-1]), scale, dtype), s, rstd)


def add_rms_norm_bwd(dy, dsum, s, weight, rstd, *, eps: float = 1e-5):
    """add_rms_norm's backward from what its forward kept: (dx, dweight) for the cotangents
    dy of y and dsum of s (dx: the gradient of x and of residual). Recomputed from s, so rstd
    is not read."""
    del rstd
    dx, dw = jax.vjp(lambda s, w: rms_norm(s, w, eps=eps), s, weight)[1](dy)
    return dx + dsum, dw


def adamw_update(param, grad, m, v, hparams, *, b1: float = 0.9, b2: float = 0.95,
                 eps: float = 1e-8, grad_scale=None, apply: bool = False):
    """One AdamW step, in optax.adamw's order: returns (update, new_m, new_v).

    hparams = [lr, weight_decay, bias_correction1, bias_correction2] in the moments' dtype;
    the gradient is grad * grad_scale where grad_scale (a scalar of that dtype) is given.
    apply=True returns param + update (optax.apply_updates) in place of the update.
    """
    ct = m.dtype
    lr, wd, bc1, bc2 = hparams[0], hparams[1], hparams[2], hparams[3]
    g = grad.astype(ct)
    if grad_scale is not None:
        g = g * grad_scale
    m = (1 - b1) * g + b1 * m
    v = (1 - b2) * (g * g) + b2 * v
    u = (m / bc1) / (jnp.sqrt(v / bc2) + eps) + wd * param.astype(ct)
    u = ((-lr) * u).astype(param.dtype)
    return (param + u if apply else u), m, v


def adamw_update_many(params, grads, ms, vs, hparams, *, b1: float = 0.9, b2: float = 0.95,
                      eps: float = 1e-8, grad_scale=None, apply: bool = False):
    """adamw_update over lists of tensors sharing hparams: (updates or new params, new_ms,
    new_vs)."""
    outs = [adamw_update(p, g, m, v, hparams, b1=b1, b2=b2, eps=eps, grad_scale=grad_scale,
                         apply=apply)
            for p, g, m, v in zip(params, grads, ms, vs)]
    return [o[0] for o in outs], [o[1] for o in outs], [o[2] for o in outs]


def gelu(x, bias=None):
    """jax.nn.gelu(x + bias, approximate=True); x + bias is formed in the compute dtype and
    is not rounded to x's dtype before GELU."""
    v = x.astype(_compute_dtype(x.dtype))
    if bias is not None:
        v = v + bias.astype(v.dtype)
    return jax.nn.gelu(v, approximate=True).astype(x.dtype)


def swiglu(x):
    """silu(gate) * up of x [..., 2, F] = (gate, up) along its second-to-last axis: [..., F],
    computed in the compute dtype and rounded to x's dtype once."""
    ct = _compute_dtype(x.dtype)
    gate, up = x[..., 0, :].astype(ct), x[..., 1, :].astype(ct)
    return (jax.nn.silu(gate) * up).astype(x.dtype)


def swiglu_fwd_fp8(x, scale, dtype=jnp.float8_e4m3fn):
    """swiglu's FP8 form, for an FP8 product that takes y: (q, qt, amax) with y = swiglu(x) as
    rows [N, F] (N the product of x's axes before (2, F)), q = blujax.fp8.quantize(y, scale,
    dtype) [N, F], qt its transpose [F, N] and amax = max |y| (float32)."""
    return fp8_copy(swiglu(x).reshape(-1, x.shape[-1]), scale, dtype)


def swiglu_bwd_fp8(dy, x, scale, dtype=jnp.float8_e5m2):
    """The FP8 form of swiglu's backward, for an FP8 product's backward that takes dx: (q, qt,
    amax) of dx = the gradient of swiglu at x for dy [..., F], as rows [N, 2F] ((d gate, d
    up) each row, x's layout)."""
    _, vjp = jax.vjp(swiglu, x)
    (dx,) = vjp(dy)
    return fp8_copy(dx.reshape(-1, 2 * x.shape[-1]), scale, dtype)


def fp8_copy(y, scale, dtype):
    """The FP8 forms' outputs for y [N, K]: (q, qt, amax) as swiglu_fwd_fp8 says."""
    from blujax.fp8 import quantize  # the one definition of the cast (blujax.fp8 needs no ops)

    q = quantize(y, jnp.asarray(scale, jnp.float32), dtype)
    return q, q.T, jnp.max(jnp.abs(y), initial=0.0).astype(jnp.float32)


def rope(x, cos, sin):
    """Rotary position embedding of x [..., T, N, D] by cos, sin [T, D/2], Hugging Face
    Llama's rotate_half form: for d < D/2, y[d] = x[d] cos[t, d] - x[d + D/2] sin[t, d] and
    y[d + D/2] = x[d + D/2] cos[t, d] + x[d] sin[t, d]; in the compute dtype, rounded once.
    cos and sin get zero gradients (they are not parameters)."""
    ct = _compute_dtype(x.dtype)
    half = x.shape[-1] // 2
    # [T, 1, D/2]: one row per position, shared by the heads.
    c = jax.lax.stop_gradient(cos).astype(ct)[:, None, :]
    s = jax.lax.stop_gradient(sin).astype(ct)[:, None, :]
    x1, x2 = x[..., :half].astype(ct), x[..., half:].astype(ct)
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


def rope_qkv(qkv, cos, sin, *, heads: int):
    """A fused QKV projection's output qkv [..., T, heads + 2 KV, D] split into (q, k, v) =
    (rope(qkv[..., :heads, :]), rope(the next KV heads), the last KV heads)."""
    kv = (qkv.shape[-2] - heads) // 2
    q, k, v = jnp.split(qkv, (heads, heads + kv), axis=-2)
    return rope(q, cos, sin), rope(k, cos, sin), v


def softmax_cross_entropy(logits, targets, *, ignore_index: int = -1,
                          num_classes: int | None = None):
    """Per-row logsumexp(logits[n]) - logits[n, targets[n]], float32 (float64 for float64),
    over the first num_classes columns (default: all).

    Rows whose target is ignore_index give 0 and no gradient; other targets outside
    [0, num_classes) give NaN, and a NaN gradient row.
    """
    if num_classes is not None:
        logits = logits[:, :num_classes]
    x = logits.astype(_compute_dtype(logits.dtype))
    lse = jax.nn.logsumexp(x, axis=-1)
    ignored = targets == ignore_index
    known = (targets >= 0) & (targets < x.shape[-1])
    picked = jnp.take_along_axis(x, jnp.where(known, targets, 0)[:, None], axis=-1)[:, 0]
    # A factor rather than a select, so that unknown targets poison the gradient as well.
    poison = jnp.where(known | ignored, 1.0, jnp.nan).astype(x.dtype)
    return jnp.where(ignored, 0.0, (lse - picked) * poison)


def softmax_cross_entropy_mean(logits, targets, *, ignore_index: int = -1,
                               num_classes: int | None = None):
    """The mean of softmax_cross_entropy over the rows whose target is not ignore_index, a
    float32 (float64) scalar; 0 when every row is ignored."""
    losses = softmax_cross_entropy(logits, targets, ignore_index=ignore_index,
                                   num_classes=num_classes)
    count = jnp.sum(targets != ignore_index, axis=-1)
    return jnp.sum(losses, axis=-1) / jnp.maximum(count, 1).astype(losses.dtype)


def attention_with_lse(q, k, v, *, causal: bool = True, scale: float | None = None):
    """(softmax(scale * q k^T [+ causal mask]) v, lse) over q [B, Tq, H, D], k, v [B, Tk, KV, D].

    KV divides H (grouped-query attention; KV == H is multi-head attention): query head h
    attends to key/value head h // (H / KV), as Hugging Face's repeat_kv has it. lse [B, H, Tq]
    is the log-sum-exp of each query's scaled scores, float32 (float64 for float64). causal
    masks keys after the query (Tq == Tk). scale defaults to 1/sqrt(D); below float64 it is
    rounded to float32, as the kernels use it.
    """
    b, tq, h, d = q.shape
    kv = k.shape[2]
    if kv != h and (kv < 1 or kv > h or h % kv):
        raise ValueError(f"attention: k, v have {kv} heads, which do not divide q's {h}")
    ct = _compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if ct != jnp.float64:
        scale = float(np.float32(scale))
    hi = jax.lax.Precision.HIGHEST  # an oracle: no TF32 on a GPU
    # The query heads as [KV, G]: head h is (h // G, h % G), so each group meets its K/V head
    # without K and V being repeated.
    qg = q.astype(ct).reshape(b, tq, kv, h // kv if kv else 1, d)
    s = jnp.einsum("bqngd,bknd->bngqk", qg, k.astype(ct), precision=hi) * scale
    if causal:
        keep = jnp.tril(jnp.ones((tq, k.shape[1]), bool))
        s = jnp.where(keep, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])
    out = jnp.einsum("bngqk,bknd->bqngd", p, v.astype(ct), precision=hi)
    return out.reshape(q.shape).astype(q.dtype), lse.reshape(b, h, tq)


def attention(q, k, v, *, causal: bool = True, scale: float | None = None):
    """softmax(scale * q k^T [+ causal mask]) v, in q's dtype; see attention_with_lse."""
    return attention_with_lse(q, k, v, causal=causal, scale=scale)[0]


def attention_qkv(qkv, *, causal: bool = True, scale: float | None = None):
    """attention over a fused QKV projection's output qkv [B, T, 3, H, D]."""
    return attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=causal, scale=scale)


def vocab_parallel_softmax_cross_entropy(logits, targets, *, axis_name, ignore_index: int = -1,
                                         num_classes: int | None = None):
    """softmax_cross_entropy of logits [N, V] split along the vocabulary over `axis_name`
    (inside shard_map: device i holds classes [i * V, (i + 1) * V)); targets [N] are global
    ids. The per-row loss is the same on every device of the axis. Global columns from
    num_classes on (a padded vocabulary) are left out."""
    x = logits.astype(_compute_dtype(logits.dtype))
    vocab = x.shape[-1]
    total = vocab * jax.lax.axis_size(axis_name)
    if num_classes is not None:
        ids = jax.lax.axis_index(axis_name) * vocab + jnp.arange(vocab)
        x = jnp.where(ids < num_classes, x, -jnp.inf)
        total = min(total, num_classes)
    # The max only steadies the exponentials; it carries no gradient (pmax has none).
    m = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(x, axis=-1)), axis_name)
    lse = m + jnp.log(jax.lax.psum(jnp.sum(jnp.exp(x - m[:, None]), axis=-1), axis_name))
    local = targets - jax.lax.axis_index(axis_name) * vocab
    here = (local >= 0) & (local < vocab)
    picked = jnp.take_along_axis(x, jnp.where(here, local, 0)[:, None], axis=-1)[:, 0]
    picked = jax.lax.psum(jnp.where(here, picked, 0.0), axis_name)
    ignored = targets == ignore_index
    known = (targets >= 0) & (targets < total)
    poison = jnp.where(known | ignored, 1.0, jnp.nan).astype(x.dtype)
    return jnp.where(ignored, 0.0, (lse - picked) * poison)
