"""Attention, bfloat16: ours vs cuDNN's flash attention, PyTorch's and XLA, in TFLOP/s.

Contenders: "ours" is blujax.kernels.attention; "cudnn" is
jax.nn.dot_product_attention(implementation="cudnn") (GPU only; noted as skipped elsewhere);
"torch" is PyTorch's torch.nn.functional.scaled_dot_product_attention with its default choice
of kernel, on the same inputs (shared through DLPack, [B, T, H, D] viewed as [B, H, T, D]
without a copy), where PyTorch is installed (it is not a dependency of blujax) and, beside a
GPU, built with CUDA; "xla" is jax.nn.dot_product_attention(implementation="xla"), which
materialises the [T, T] scores (and may not fit at the longest sequences: noted as skipped).
PyTorch allocates outside JAX's memory pool: leave it room (XLA_PYTHON_CLIENT_MEM_FRACTION=.92
leaves 6 GB of an 80 GB GPU, enough here).

Shapes: 65536 tokens per call (B = 65536 / T) at T = 1024 to 8192, H = 12 heads of D = 64
(GPT-2) and of D = 128, so B * H runs from 768 down to 96. Grouped-query rows (k, v with KV
heads, each shared by H / KV query heads, as Llama's): B = 16 at T = 1024 and 2048, H = 12 with
KV = 4 and H = 32 with KV = 8, D = 64; every contender takes k, v as they are (cuDNN and XLA
through jax.nn.dot_product_attention, which takes grouped heads; PyTorch with enable_gqa=True,
PyTorch 2.5 on). FLOPs count the two matrix products of the forward, 4 B H T^2 D (H: the query
heads), halved when causal (the masked half is never computed); fwd+bwd counts 3.5 times that
(the backward's five products are 2.5 forwards).
"""

import importlib.util

import jax
import jax.numpy as jnp

from benchmarks.harness import Case, TorchFn, itemsize, normal, to_torch
from blujax import kernels

TOKENS = 65536
SEQ_LENS = (1024, 2048, 4096, 8192)
HEADS = 12
HEAD_DIMS = (64, 128)
# Grouped-query attention: (B, T, H, KV, D).
GQA_SHAPES = [(16, t, h, kv, 64) for h, kv in ((12, 4), (32, 8)) for t in (1024, 2048)]
# (B, T, H, KV, D): smoke tests that also run on the CPU, multi-head and grouped
QUICK = [(2, 128, 2, 2, 64), (2, 64, 4, 2, 64)]


def _impl(name, causal):
    if name == "ours":
        return lambda q, k, v: kernels.attention(q, k, v, causal=causal)
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                       implementation=name)


def _fwd_bwd(op):
    def run(q, k, v, dout):
        _, vjp = jax.vjp(op, q, k, v)
        return vjp(dout)
    return run


def _torch_available(on_gpu: bool) -> bool:
    """Whether PyTorch can run beside us: installed, and with CUDA where we run on a GPU."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available() or not on_gpu


def _torch_impl(causal, fwd_bwd, gqa):
    import torch
    import torch.nn.functional as F

    # Grouped heads only where asked for (enable_gqa is PyTorch 2.5 on).
    kw = {"enable_gqa": True} if gqa else {}

    def op(q, k, v):  # [B, T, H, D] tensors; PyTorch's layout is [B, H, T, D]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=causal, **kw)
        return out.transpose(1, 2)

    def run(q, k, v, dout):
        return torch.autograd.grad(op(q, k, v), (q, k, v), dout)

    return TorchFn(run if fwd_bwd else op)


def _make(impl, key, b, t, h, kv, d, dtype, causal, fwd_bwd):
    args = _inputs(key, b, t, h, kv, d, dtype, fwd_bwd)
    if impl == "torch":
        # q, k and v are leaves that need gradients; dout is not
        return (_torch_impl(causal, fwd_bwd, kv != h),
                tuple(to_torch(x, requires_grad=fwd_bwd and i < 3) for i, x in enumerate(args)))
    op = _impl(impl, causal)
    return (_fwd_bwd(op) if fwd_bwd else op), args


def _inputs(key, b, t, h, kv, d, dtype, with_dout):
    """q [B, T, H, D], k and v [B, T, KV, D], and dout like q."""
    keys = jax.random.split(key, 4)
    q, k, v = (normal(kk, (b, t, n, d), dtype) for kk, n in zip(keys[:3], (h, kv, kv)))
    return (q, k, v) + ((normal(keys[3], (b, t, h, d), dtype),) if with_dout else ())


def cases(quick: bool = False):
    dtype = jnp.bfloat16
    on_gpu = jax.default_backend() == "gpu"
    # cuDNN only where there is a GPU; there it is optional too (a shape it rejects is a note),
    # as PyTorch is.
    impls = ("ours", "cudnn") if on_gpu else ("ours",)
    impls += ("torch", "xla") if _torch_available(on_gpu) else ("xla",)
    shapes = QUICK if quick else (
        [(TOKENS // t, t, HEADS, HEADS, d) for d in HEAD_DIMS for t in SEQ_LENS] + GQA_SHAPES)
    out = []
    for b, t, h, kv, d in shapes:
        for causal in (True, False):
            s = itemsize(dtype)

            def make_fwd(impl, key, b=b, t=t, h=h, kv=kv, d=d, causal=causal):
                return _make(impl, key, b, t, h, kv, d, dtype, causal, False)

            def make_fwd_bwd(impl, key, b=b, t=t, h=h, kv=kv, d=d, causal=causal):
                return _make(impl, key, b, t, h, kv, d, dtype, causal, True)

            heads = f"H{h}" if kv == h else f"H{h} KV{kv}"
            name = f"B{b} T{t} {heads} D{d}{' causal' if causal else ''}"
            fwd_flops = 4 * b * h * t * t * d // (2 if causal else 1)
            q_bytes, kv_bytes = b * t * h * d * s, b * t * kv * d * s
            common = dict(impls=impls, optional=("cudnn", "torch", "xla"), calls=4)
            # bytes (for reference only): q, k, v read and out written; the backward also
            # reads out and dout and writes dq, dk, dv
            out.append(Case("attention", "fwd", name, "bfloat16", 2 * q_bytes + 2 * kv_bytes,
                            make_fwd, flops=fwd_flops, **common))
            out.append(Case("attention", "fwd+bwd", name, "bfloat16",
                            6 * q_bytes + 4 * kv_bytes, make_fwd_bwd,
                            flops=fwd_flops * 7 // 2, **common))
    return out
