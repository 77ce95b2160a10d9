"""Scaled dot-product attention (flash style) on our FFI kernels, with its log-sum-exp.

Kernels: xla_ext/cuda/attention.cu (bfloat16 on tensor cores, float32 in exact float32
arithmetic; head size D of 64 or 128) and xla_ext/cpu/attention.cc (float32, float64,
bfloat16 with float32 arithmetic; any D). The forward saves the per-row log-sum-exp; the
backward recomputes the probabilities from q, k and it, and takes a cotangent for lse too
(ring attention merges partial results through lse). k and v may have fewer heads than q
(grouped-query attention): the kernels read each query head's key/value head where it lies,
and the backward sums dk, dv over a group inside its dK/dV kernel, writing each once (no
repeated k, v, no per-head copies of their gradients; deterministic as the multi-head
backward). The jnp specification is `blujax.kernels.xla.attention` / `attention_with_lse`.
"""

from __future__ import annotations

import math
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from blujax._ffi import current_platform, require_kernels
from blujax.kernels._util import check_dtype, check_float64_platform, match_vma, result_type

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float64)
# Head sizes the CUDA kernels are compiled for (xla_ext/cuda/attention.cu, WithHeadDim).
GPU_HEAD_DIMS = (64, 128)
# The name (checkpoint_name) of the forward's output and log-sum-exp: a recomputation policy
# that saves it keeps what the backward reads, so the forward kernel need not run again
# (blujax.model.stack's "selective").
CHECKPOINT_NAME = "attention"


def attention(q, k, v, *, causal: bool = True, scale: float | None = None):
    """softmax(scale * q k^T [+ causal mask]) v per batch and head.

    q: [B, Tq, H, D]; k, v: [B, Tk, KV, D], one dtype (float32, bfloat16, or float64 on the
    CPU). KV == H is multi-head attention; KV < H dividing H is grouped-query attention: query
    head i attends to key/value head i // (H / KV) (Hugging Face's repeat_kv order), with no
    repeated copy of k, v made, and the gradients of k, v summed over each group's query heads.
    On a GPU, D must be 64 or 128 (GPU_HEAD_DIMS). causal=True masks keys after the query and
    needs Tq == Tk. scale defaults to 1/sqrt(D); it reaches the kernels as a float64, which
    they use at their precision (float64 for float64, float32 otherwise). Returns
    [B, Tq, H, D] in q's dtype.
    """
    return _attention_op("attention", q, k, v, causal, scale)[0]


def attention_with_lse(q, k, v, *, causal: bool = True, scale: float | None = None):
    """(attention(q, k, v), lse): lse is [B, H, Tq] (H: q's heads), the natural-log
    log-sum-exp of each query's scaled (and masked) scores, float32 (float64 for float64). Both
    are differentiable.
    """
    return _attention_op("attention_with_lse", q, k, v, causal, scale)


def attention_qkv(qkv, *, causal: bool = True, scale: float | None = None):
    """attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]) for the output of a fused QKV
    projection, qkv: [B, T, 3, H, D] (multi-head only: as many key/value heads as query
    heads). Returns [B, T, H, D].

    The same kernels as `attention`; the backward writes dq, dk and dv straight into one
    [B, T, 3, H, D] gradient, so no pass of the program concatenates them (a transformer's
    backward otherwise copies that whole tensor once a layer).
    """
    op = "attention_qkv"
    if not hasattr(qkv, "ndim") or not hasattr(qkv, "dtype"):
        raise TypeError(f"{op}: qkv must be an array, got {type(qkv).__name__}")
    if qkv.ndim != 5 or qkv.shape[2] != 3:
        raise ValueError(f"{op}: qkv must have shape [B, T, 3, H, D], got {qkv.shape}")
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scale = _check(op, q, k, v, causal, scale)
    require_kernels(op)
    return _attention_qkv(qkv, bool(causal), scale)


def _attention_op(op, q, k, v, causal, scale):
    scale = _check(op, q, k, v, causal, scale)
    require_kernels(op)
    q, k, v = match_vma(q, k, v)
    return _attention(q, k, v, bool(causal), scale)


def _check(op, q, k, v, causal, scale) -> float:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not hasattr(x, "ndim") or not hasattr(x, "dtype"):
            raise TypeError(f"{op}: {name} must be an array, got {type(x).__name__}")
        if x.ndim != 4:
            raise ValueError(f"{op}: {name} must have shape [B, T, H, D], got {x.shape}")
        check_dtype(op, name, x, _DTYPES)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{op}: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"{op}: k and v must have the same shape, got {k.shape} and {v.shape}")
    (b, tq, h, d), (bk, tk, hk, dk) = q.shape, k.shape
    if bk != b:
        raise ValueError(f"{op}: q has batch {b} but k, v have batch {bk} (shapes {q.shape}, "
                         f"{k.shape})")
    if hk != h and (hk < 1 or hk > h or h % hk):
        raise ValueError(f"{op}: q has {h} heads but k, v have {hk} (shapes {q.shape}, "
                         f"{k.shape}); the key/value heads must divide the query heads "
                         f"(grouped-query attention: query head i attends to key/value "
                         f"head i // (H / KV))")
    if dk != d:
        raise ValueError(f"{op}: q has head size {d} but k, v have {dk} (shapes {q.shape}, "
                         f"{k.shape})")
    if tq < 1 or tk < 1 or d < 1:
        raise ValueError(f"{op}: sequence lengths and head size must be >= 1, got q {q.shape}, "
                         f"k {k.shape}")
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"{op}: causal must be True or False, got {causal!r}")
    if causal and tq != tk:
        raise ValueError(
            f"{op}: causal=True needs as many queries as keys, got Tq={tq} and Tk={tk}; "
            f"use causal=False for attention of a query block to another key block"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if not (isinstance(scale, (int, float, np.floating)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"{op}: scale must be a finite number > 0, got {scale!r}")
    check_float64_platform(op, q.dtype)
    if current_platform() == "gpu" and d not in GPU_HEAD_DIMS:
        raise ValueError(
            f"{op}: head size D={d} has no CUDA kernel; supported on the GPU: "
            f"{', '.join(map(str, GPU_HEAD_DIMS))} (shapes q {q.shape}, k {k.shape}); for "
            f"other head sizes use blujax.kernels.xla.{op}"
        )
    return float(scale)


def _lse_dtype(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _fwd_call(q, k, v, causal, scale):
    b, tq, h, _ = q.shape
    # The third result is scratch, dropped: one int32 in which the Hopper kernel's CTAs count
    # off their units of work (handlers do not allocate).
    out, lse, _ = jax.ffi.ffi_call(
        "blujax_attention_fwd",
        (result_type(q), result_type(q, (b, h, tq), _lse_dtype(q.dtype)),
         result_type(q, (1,), jnp.int32)),
        vmap_method="sequential",
    )(q, k, v, causal=causal, scale=np.float64(scale))
    return checkpoint_name(out, CHECKPOINT_NAME), checkpoint_name(lse, CHECKPOINT_NAME)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention(q, k, v, causal, scale):
    return _fwd_call(q, k, v, causal, scale)


def _attention_fwd(q, k, v, causal, scale):
    out, lse = _fwd_call(q, k, v, causal, scale)
    return (out, lse), (q, k, v, out, lse)


def xla_deterministic() -> bool:
    """Whether XLA_FLAGS asks for XLA's deterministic mode (--xla_gpu_deterministic_ops)."""
    for flag in os.environ.get("XLA_FLAGS", "").split():
        name, _, value = flag.partition("=")
        if name == "--xla_gpu_deterministic_ops":
            return value.lower() in ("", "true", "1")
    return False


def _workspace(q, lse, sum_dq: bool):
    """The backward's float32 workspace, [B, H, Tq + extra]: delta in its first B * H * Tq
    values. With sum_dq (see _sums_dq) it also has room for the float32 dQ tiles that the
    dK/dV kernel sums into (B * H * ceil(Tq / 64) tiles of 64 x D, 2x dq's bytes), and that
    kernel then runs instead of a separate dQ kernel: 5 matrix products per tile pair rather
    than 7, with float32 sums in a varying order. XLA's deterministic mode keeps the two
    kernels, which write every element of dq once (bit-for-bit reruns). The backward's sum_dq
    attribute says which size it is; the handlers check that the two agree."""
    b, tq, h, d = q.shape
    extra = dq_room(tq, d) if sum_dq else 0
    return result_type(lse, (b, h, tq + extra), lse.dtype)


# Causal calls of up to this many keys (by head size) keep the two-kernel backward (_sums_dq).
CAUSAL_TWO_KERNEL_KEYS = {64: 512, 128: 768}


def _sums_dq(dtype, causal, tk: int, d: int) -> bool:
    """Whether the backward sums dQ in its dK/dV kernel (see _workspace). Not for short causal
    calls (CAUSAL_TWO_KERNEL_KEYS): a query tile there gets the shares of few key blocks, half
    of them on average, too few to repay zeroing the float32 sums and converting them: the
    thresholds are where the summing kernel overtook the two kernels on an H100 (forward +
    backward; the measurements are in benchmarks/LOG.md)."""
    if dtype != jnp.bfloat16 or not _hopper() or xla_deterministic():
        return False
    return not (causal and tk <= CAUSAL_TWO_KERNEL_KEYS.get(d, 0))


def dq_room(tq: int, d: int) -> int:
    """Values per (batch, head) the workspace adds after delta for the summed dQ tiles: its
    ceil(Tq / 64) tiles of 64 x D, and 4 more for the 16-byte alignment of the first tile
    (AttentionDqRoom in xla_ext/common/attention.h)."""
    return -(-tq // 64) * 64 * d + 4


def _hopper() -> bool:
    """Whether the kernels run on a Hopper GPU (compute capability 9.0) with its own kernels
    (BLUJAX_NO_WGMMA=1 keeps the portable ones, which have no use for the dQ room)."""
    if current_platform() != "gpu" or os.environ.get("BLUJAX_NO_WGMMA") == "1":
        return False
    return getattr(jax.devices("gpu")[0], "compute_capability", None) == "9.0"


def _attention_bwd(causal, scale, res, cts):
    q, k, v, out, lse = res
    dout, dlse = cts
    # Cotangents arrive as zeros when an output is unused (attention() drops lse); their dtype
    # must be what the handler checks.
    dout, dlse = dout.astype(q.dtype), dlse.astype(lse.dtype)
    dout, dlse = match_vma(dout, dlse, q)[:2]
    # delta [B, H, Tq] is the kernels' scratch (rowsum(dout * out) - dlse), an output because
    # handlers do not allocate; it is dropped here.
    sum_dq = _sums_dq(q.dtype, causal, k.shape[1], q.shape[3])
    dq, dk, dv, _ = jax.ffi.ffi_call(
        "blujax_attention_bwd",
        (result_type(q), result_type(k), result_type(v), _workspace(q, lse, sum_dq)),
        vmap_method="sequential",
    )(q, k, v, out, lse, dout, dlse, causal=causal, scale=np.float64(scale), sum_dq=sum_dq)
    return dq, dk, dv


_attention.defvjp(_attention_fwd, _attention_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _attention_qkv(qkv, causal, scale):
    return _fwd_call(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal, scale)[0]


def _attention_qkv_fwd(qkv, causal, scale):
    # The slices are what the forward kernel reads; XLA writes them in the pass that produces
    # qkv (the projection's bias add), so they cost no pass of their own.
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    out, lse = _fwd_call(q, k, v, causal, scale)
    return out, (q, k, v, out, lse)


def _attention_qkv_bwd(causal, scale, res, dout):
    q, k, v, out, lse = res
    dout = match_vma(dout.astype(q.dtype), q)[0]
    dlse = jnp.zeros(lse.shape, lse.dtype)
    dlse = match_vma(dlse, q)[0]
    b, t, h, d = q.shape
    sum_dq = _sums_dq(q.dtype, causal, t, d)
    dqkv, _ = jax.ffi.ffi_call(
        "blujax_attention_qkv_bwd",
        (result_type(q, (b, t, 3, h, d)), _workspace(q, lse, sum_dq)),
        vmap_method="sequential",
    )(q, k, v, out, lse, dout, dlse, causal=causal, scale=np.float64(scale), sum_dq=sum_dq)
    return (dqkv,)


_attention_qkv.defvjp(_attention_qkv_fwd, _attention_qkv_bwd)
