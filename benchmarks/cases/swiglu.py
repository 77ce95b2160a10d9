"""SwiGLU forward and backward: ours vs the jnp spec compiled by XLA."""

import jax
import jax.numpy as jnp

from benchmarks.harness import Case, itemsize, normal
from blujax import kernels
from blujax.kernels import xla

# x [tokens, 2, F]: Llama 2 7B's MLP (F = 11008) at 16k tokens, Llama 3 8B's (F = 14336) at 8k,
# and Llama 3.2 1B's (F = 8192) at 32k.
SHAPES = [(16384, 11008), (8192, 14336), (32768, 8192)]
QUICK_SHAPES = [(1024, 1376)]  # a smoke test, small enough for the CPU kernels
IMPLS = {"ours": kernels.swiglu, "xla": xla.swiglu}


def _inputs(key, rows, f, dtype):
    kx, kd = jax.random.split(key)
    return normal(kx, (rows, 2, f), dtype, 2.0), normal(kd, (rows, f), dtype)


def cases(quick: bool = False):
    out = []
    for dtype in (jnp.float32, jnp.bfloat16):
        for rows, f in QUICK_SHAPES if quick else SHAPES:

            def make_fwd(impl, key, rows=rows, f=f, dtype=dtype):
                x, _ = _inputs(key, rows, f, dtype)
                return IMPLS[impl], (x,)

            def make_bwd(impl, key, rows=rows, f=f, dtype=dtype):
                x, dy = _inputs(key, rows, f, dtype)
                _, vjp = jax.vjp(IMPLS[impl], x)
                return (lambda vjp, dy: vjp(dy)), (vjp, dy)

            name, dt, n, s = f"{rows}x2x{f}", jnp.dtype(dtype).name, rows * f, itemsize(dtype)
            # forward: read gate and up; write y
            out.append(Case("swiglu", "fwd", name, dt, 3 * n * s, make_fwd))
            # backward: read dy, gate and up; write d gate and d up
            out.append(Case("swiglu", "bwd", name, dt, 5 * n * s, make_bwd))
    return out
