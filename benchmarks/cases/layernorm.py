"""LayerNorm forward and backward: ours vs the jnp spec compiled by XLA."""

import jax
import jax.numpy as jnp

from benchmarks.harness import Case, itemsize, normal
from blujax import kernels
from blujax.kernels import xla

SHAPES = [(16384, 768), (32768, 768), (16384, 3072), (16384, 4096)]
IMPLS = {"ours": kernels.layer_norm, "xla": xla.layer_norm}


def _inputs(key, rows, c, dtype):
    kx, kw, kb, kd = jax.random.split(key, 4)
    return (normal(kx, (rows, c), dtype), 1 + normal(kw, (c,), dtype, 0.1),
            normal(kb, (c,), dtype, 0.1), normal(kd, (rows, c), dtype))


def cases(quick: bool = False):
    out = []
    for dtype in (jnp.float32, jnp.bfloat16):
        for rows, c in SHAPES[:1] if quick else SHAPES:
            s = itemsize(dtype)

            def make_fwd(impl, key, rows=rows, c=c, dtype=dtype):
                x, w, b, _ = _inputs(key, rows, c, dtype)
                return IMPLS[impl], (x, w, b)

            def make_bwd(impl, key, rows=rows, c=c, dtype=dtype):
                x, w, b, dy = _inputs(key, rows, c, dtype)
                _, vjp = jax.vjp(IMPLS[impl], x, w, b)
                return (lambda vjp, dy: vjp(dy)), (vjp, dy)

            name, dt = f"{rows}x{c}", jnp.dtype(dtype).name
            # forward: read x, weight, bias; write y, mean, rstd
            fwd_bytes = 2 * rows * c * s + 2 * c * s + 2 * rows * 4
            # backward: read dy, x, weight, mean, rstd; write dx, dweight, dbias
            bwd_bytes = 3 * rows * c * s + 3 * c * s + 2 * rows * 4
            out.append(Case("layer_norm", "fwd", name, dt, fwd_bytes, make_fwd))
            out.append(Case("layer_norm", "bwd", name, dt, bwd_bytes, make_bwd))
    return out
