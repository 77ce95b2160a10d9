"""LayerNorm forward and backward: ours vs the jnp spec compiled by XLA. Also the residual add
with the preceding matmul's bias folded in (add_layer_norm's x_bias, GPT-2's width), beside
"ours_unfused": XLA adds the bias (and sums its gradient) around our add_layer_norm."""

import jax
import jax.numpy as jnp

from benchmarks.harness import Case, itemsize, normal
from blujax import kernels
from blujax.kernels import xla

SHAPES = [(16384, 768), (32768, 768), (16384, 3072), (16384, 4096)]
IMPLS = {"ours": kernels.layer_norm, "xla": xla.layer_norm}
ADD_BIAS_SHAPES = [(16384, 768), (32768, 768)]
ADD_BIAS_IMPLS = {
    "ours": lambda x, xb, r, w, b: kernels.add_layer_norm(x, r, w, b, x_bias=xb),
    "xla": lambda x, xb, r, w, b: xla.add_layer_norm(x, r, w, b, x_bias=xb),
    "ours_unfused": lambda x, xb, r, w, b: kernels.add_layer_norm(x + xb, r, w, b),
}


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
        for rows, c in ADD_BIAS_SHAPES[:1] if quick else ADD_BIAS_SHAPES:
            out += _add_bias_cases(rows, c, dtype)
    return out


def _add_bias_cases(rows, c, dtype):
    s = itemsize(dtype)

    def inputs(key):
        kx, kr, kp, kd, ks = jax.random.split(key, 5)
        x, w, b, dy = _inputs(kx, rows, c, dtype)
        xb = normal(kp, (c,), dtype, 0.1)
        return (x, xb, normal(kr, (rows, c), dtype), w, b), (dy, normal(ks, (rows, c), dtype))

    def make_fwd(impl, key):
        return ADD_BIAS_IMPLS[impl], inputs(key)[0]

    def make_bwd(impl, key):
        args, cts = inputs(key)
        _, vjp = jax.vjp(ADD_BIAS_IMPLS[impl], *args)
        # The gradients of x and of the residual are one array. Returning it twice would make
        # XLA copy it into a second output buffer, a pass that no train step makes, so the
        # program returns it once.
        return (lambda vjp, cts: vjp(cts)[1:]), (vjp, cts)

    name, dt, impls = f"{rows}x{c}", jnp.dtype(dtype).name, tuple(ADD_BIAS_IMPLS)
    # forward: read x, residual, x_bias, weight, bias; write y, sum, mean, rstd
    fwd_bytes = 4 * rows * c * s + 3 * c * s + 2 * rows * 4
    # backward: read dy, dsum, sum, weight, mean, rstd; write dx (= dresidual), dweight, dbias,
    # dx_bias
    bwd_bytes = 4 * rows * c * s + 4 * c * s + 2 * rows * 4
    return [Case("add_bias_layer_norm", "fwd", name, dt, fwd_bytes, make_fwd, impls=impls),
            Case("add_bias_layer_norm", "bwd", name, dt, bwd_bytes, make_bwd, impls=impls)]
