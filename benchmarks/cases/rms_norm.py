"""RMSNorm forward and backward, and its fused residual add (the Llama block's
`s = x + residual; rms_norm(s)`): ours vs the jnp spec compiled by XLA."""

import jax
import jax.numpy as jnp

from benchmarks.harness import Case, itemsize, normal
from blujax import kernels
from blujax.kernels import xla

# llama-d12's width (768), Llama 3.2 1B's (2048) and Llama 3 8B's (4096), at 16k and 32k tokens.
SHAPES = [(16384, 768), (16384, 2048), (16384, 4096), (32768, 4096)]
QUICK_SHAPES = [(1024, 2048)]  # a smoke test, small enough for the CPU kernels
IMPLS = {"ours": kernels.rms_norm, "xla": xla.rms_norm}
ADD_IMPLS = {"ours": kernels.add_rms_norm, "xla": xla.add_rms_norm}


def _inputs(key, rows, c, dtype):
    kx, kw, kd = jax.random.split(key, 3)
    return (normal(kx, (rows, c), dtype), 1 + normal(kw, (c,), dtype, 0.1),
            normal(kd, (rows, c), dtype))


def cases(quick: bool = False):
    out = []
    for dtype in (jnp.float32, jnp.bfloat16):
        for rows, c in QUICK_SHAPES if quick else SHAPES:
            out += _plain_cases(rows, c, dtype) + _add_cases(rows, c, dtype)
    return out


def _plain_cases(rows, c, dtype):
    s = itemsize(dtype)

    def make_fwd(impl, key):
        x, w, _ = _inputs(key, rows, c, dtype)
        return IMPLS[impl], (x, w)

    def make_bwd(impl, key):
        x, w, dy = _inputs(key, rows, c, dtype)
        _, vjp = jax.vjp(IMPLS[impl], x, w)
        return (lambda vjp, dy: vjp(dy)), (vjp, dy)

    name, dt = f"{rows}x{c}", jnp.dtype(dtype).name
    # forward: read x, weight; write y, rstd
    fwd_bytes = 2 * rows * c * s + c * s + rows * 4
    # backward: read dy, x, weight, rstd; write dx, dweight
    bwd_bytes = 3 * rows * c * s + 2 * c * s + rows * 4
    return [Case("rms_norm", "fwd", name, dt, fwd_bytes, make_fwd),
            Case("rms_norm", "bwd", name, dt, bwd_bytes, make_bwd)]


def _add_cases(rows, c, dtype):
    s = itemsize(dtype)

    def inputs(key):
        kx, kr, ks = jax.random.split(key, 3)
        x, w, dy = _inputs(kx, rows, c, dtype)
        return (x, normal(kr, (rows, c), dtype), w), (dy, normal(ks, (rows, c), dtype))

    def make_fwd(impl, key):
        return ADD_IMPLS[impl], inputs(key)[0]

    def make_bwd(impl, key):
        args, cts = inputs(key)
        _, vjp = jax.vjp(ADD_IMPLS[impl], *args)
        # The gradients of x and of the residual are one array. Returning it twice would make
        # XLA copy it into a second output buffer, a pass that no train step makes, so the
        # program returns it once.
        return (lambda vjp, cts: vjp(cts)[1:]), (vjp, cts)

    name, dt = f"{rows}x{c}", jnp.dtype(dtype).name
    # forward: read x, residual, weight; write y, sum, rstd
    fwd_bytes = 4 * rows * c * s + c * s + rows * 4
    # backward: read dy, dsum, sum, weight, rstd; write dx (= dresidual), dweight
    bwd_bytes = 4 * rows * c * s + 2 * c * s + rows * 4
    return [Case("add_rms_norm", "fwd", name, dt, fwd_bytes, make_fwd),
            Case("add_rms_norm", "bwd", name, dt, bwd_bytes, make_bwd)]
