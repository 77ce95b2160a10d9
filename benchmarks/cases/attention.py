"""Attention, bfloat16: ours vs cuDNN's flash attention and XLA, in TFLOP/s.

Contenders: "ours" is blujax.kernels.attention; "cudnn" is
jax.nn.dot_product_attention(implementation="cudnn") (GPU only; noted as skipped elsewhere);
"xla" is jax.nn.dot_product_attention(implementation="xla"), which materialises the [T, T]
scores (and may not fit at the longest sequences: noted as skipped).

Shapes: 65536 tokens per call (B = 65536 / T) at T = 1024 to 8192, H = 12 heads of D = 64
(GPT-2) and of D = 128, so B * H runs from 768 down to 96. FLOPs count the two matrix
products of the forward, 4 B H T^2 D, halved when causal (the masked half is never computed);
fwd+bwd counts 3.5 times that (the backward's five products are 2.5 forwards).
"""

import jax
import jax.numpy as jnp

from benchmarks.harness import Case, itemsize, normal
from blujax import kernels

TOKENS = 65536
SEQ_LENS = (1024, 2048, 4096, 8192)
HEADS = 12
HEAD_DIMS = (64, 128)
QUICK = [(2, 128, 2, 64)]  # (B, T, H, D): a smoke test that also runs on the CPU


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


def _inputs(key, b, t, h, d, dtype, with_dout):
    keys = jax.random.split(key, 4)
    qkv = tuple(normal(kk, (b, t, h, d), dtype) for kk in keys[:3])
    return qkv + ((normal(keys[3], (b, t, h, d), dtype),) if with_dout else ())


def cases(quick: bool = False):
    dtype = jnp.bfloat16
    on_gpu = jax.default_backend() == "gpu"
    # cuDNN only where there is a GPU; there it is optional too (a shape it rejects is a note).
    impls = ("ours", "cudnn", "xla") if on_gpu else ("ours", "xla")
    shapes = QUICK if quick else [(TOKENS // t, t, HEADS, d) for d in HEAD_DIMS for t in SEQ_LENS]
    out = []
    for b, t, h, d in shapes:
        for causal in (True, False):
            s = itemsize(dtype)

            def make_fwd(impl, key, b=b, t=t, h=h, d=d, causal=causal):
                return _impl(impl, causal), _inputs(key, b, t, h, d, dtype, False)

            def make_fwd_bwd(impl, key, b=b, t=t, h=h, d=d, causal=causal):
                return _fwd_bwd(_impl(impl, causal)), _inputs(key, b, t, h, d, dtype, True)

            name = f"B{b} T{t} H{h} D{d}{' causal' if causal else ''}"
            fwd_flops = 4 * b * h * t * t * d // (2 if causal else 1)
            tensor = b * t * h * d * s
            common = dict(impls=impls, optional=("cudnn", "xla"), calls=4)
            # bytes (for reference only): q, k, v read and out written; the backward also
            # reads out and dout and writes dq, dk, dv
            out.append(Case("attention", "fwd", name, "bfloat16", 4 * tensor, make_fwd,
                            flops=fwd_flops, **common))
            out.append(Case("attention", "fwd+bwd", name, "bfloat16", 10 * tensor,
                            make_fwd_bwd, flops=fwd_flops * 7 // 2, **common))
    return out
