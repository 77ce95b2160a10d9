"""GELU (tanh approximation) forward and backward, with and without the fused bias: ours vs the
jnp spec compiled by XLA."""

import jax
import jax.numpy as jnp

from benchmarks.harness import Case, itemsize, normal
from blujax import kernels
from blujax.kernels import xla

# The GPT-2 MLP hidden activation (4 x 768 = 3072 wide) at 16k and 32k tokens, and a 4096-wide one.
SHAPES = [(16384, 3072), (32768, 3072), (16384, 4096)]
QUICK_SHAPES = [(1024, 3072)]  # a smoke test, small enough for the CPU kernels
IMPLS = {"ours": kernels.gelu, "xla": xla.gelu}


def _inputs(key, rows, c, dtype):
    kx, kb, kd = jax.random.split(key, 3)
    return (normal(kx, (rows, c), dtype, 2.0), normal(kb, (c,), dtype, 0.5),
            normal(kd, (rows, c), dtype))


def cases(quick: bool = False):
    out = []
    for dtype in (jnp.float32, jnp.bfloat16):
        for rows, c in QUICK_SHAPES if quick else SHAPES:
            for with_bias in (False, True):
                s = itemsize(dtype)

                def make_fwd(impl, key, rows=rows, c=c, dtype=dtype, with_bias=with_bias):
                    x, b, _ = _inputs(key, rows, c, dtype)
                    return IMPLS[impl], ((x, b) if with_bias else (x,))

                def make_bwd(impl, key, rows=rows, c=c, dtype=dtype, with_bias=with_bias):
                    x, b, dy = _inputs(key, rows, c, dtype)
                    _, vjp = jax.vjp(IMPLS[impl], *((x, b) if with_bias else (x,)))
                    return (lambda vjp, dy: vjp(dy)), (vjp, dy)

                op = "bias_gelu" if with_bias else "gelu"
                name, dt, n = f"{rows}x{c}", jnp.dtype(dtype).name, rows * c
                bias_bytes = c * s if with_bias else 0
                # forward: read x (and bias); write y
                fwd_bytes = 2 * n * s + bias_bytes
                # backward: read dy, x (and bias); write dx (and dbias)
                bwd_bytes = 3 * n * s + 2 * bias_bytes
                out.append(Case(op, "fwd", name, dt, fwd_bytes, make_fwd))
                out.append(Case(op, "bwd", name, dt, bwd_bytes, make_bwd))
    return out
