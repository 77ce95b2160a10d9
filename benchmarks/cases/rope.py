"""Rotary position embedding forward and backward: ours vs the jnp spec compiled by XLA."""

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import Case, itemsize, normal
from blujax import kernels
from blujax.kernels import xla

# x [B, T, N, D]: Llama 2 7B's queries (32 heads of 128) at 8 x 2048 tokens, Llama 3 8B's keys
# (8 KV heads) at 4 x 4096, and 64-wide heads (12 of them, llama-d12's queries) at 16 x 1024.
SHAPES = [(8, 2048, 32, 128), (4, 4096, 8, 128), (16, 1024, 12, 64)]
QUICK_SHAPES = [(2, 256, 4, 64)]  # a smoke test, small enough for the CPU kernels
IMPLS = {"ours": kernels.rope, "xla": xla.rope}


def _tables(t, d, theta=500000.0):
    inv_freq = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    angles = np.arange(t, dtype=np.float64)[:, None] * inv_freq[None, :]
    return jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)


def cases(quick: bool = False):
    out = []
    for dtype in (jnp.float32, jnp.bfloat16):
        for b, t, n, d in QUICK_SHAPES if quick else SHAPES:

            def make_fwd(impl, key, shape=(b, t, n, d), dtype=dtype):
                cos, sin = _tables(shape[1], shape[3])
                return IMPLS[impl], (normal(key, shape, dtype), cos, sin)

            def make_bwd(impl, key, shape=(b, t, n, d), dtype=dtype):
                cos, sin = _tables(shape[1], shape[3])
                kx, kd = jax.random.split(key)
                x, dy = normal(kx, shape, dtype), normal(kd, shape, dtype)
                # The tables are closed over: only dx is asked for, as in a train step.
                _, vjp = jax.vjp(lambda x: IMPLS[impl](x, cos, sin), x)
                return (lambda vjp, dy: vjp(dy)), (vjp, dy)

            name, dt = f"{b}x{t}x{n}x{d}", jnp.dtype(dtype).name
            x_bytes, table_bytes = b * t * n * d * itemsize(dtype), 2 * t * (d // 2) * 4
            # either direction: read x (dy) and the tables once; write y (dx)
            nbytes = 2 * x_bytes + table_bytes
            out.append(Case("rope", "fwd", name, dt, nbytes, make_fwd))
            out.append(Case("rope", "bwd", name, dt, nbytes, make_bwd))
    return out
