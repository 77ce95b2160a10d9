"""The gated MLP, forward and backward, three ways: in bfloat16, with its two products in FP8
(blujax.fp8.matmul around swiglu: XLA casts swiglu's output and its gradient), and as one FP8
piece (blujax.fp8.swiglu_mlp: swiglu's FP8 forms write those copies themselves).

    python -m benchmarks.probes.fp8_mlp [--tokens 16384] [--shapes 2048x8192,768x2048]
                                        [--ops ffi] [--steps 20]

For each (tokens M, width C x hidden F): y = swiglu(x [M, C] @ w_up [C, 2F]) @ w_down [F, C]
and its vjp against a random cotangent, jitted, timed as medians of --steps calls; delayed
scaling with a warm history (both FP8 forms read the same scales). The ratios are against
the FP8 products.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from benchmarks.fp8 import time_it
from blujax import fp8
from blujax.model import ops as model_ops

FORMS = ("bf16", "products", "piece")


def mlp(M, C, F, form, ops):
    k = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k[0], (M, C), jnp.bfloat16)
    w_up = (0.02 * jax.random.normal(k[1], (C, 2 * F))).astype(jnp.bfloat16)
    w_down = (0.02 * jax.random.normal(k[2], (F, C))).astype(jnp.bfloat16)
    r = jax.random.normal(k[3], (M, C), jnp.bfloat16)
    recipe = fp8.Recipe("delayed", every=True)
    # Warm histories: scales from amaxes near the tensors' own.
    h_up = jnp.stack([jnp.full((16,), v) for v in (4.0, 0.1, 1e-2)])
    h_down = jnp.stack([jnp.full((16,), v) for v in (4.0, 0.1, 1.0)])

    def forward(x, w_up, w_down, h_up, h_down):
        if form == "piece":
            return fp8.swiglu_mlp(x, w_up, w_down, h_up, h_down, recipe=recipe, ops=ops)
        dot = jnp.matmul if form == "bf16" else (
            lambda a, w, h: fp8.matmul(a, w, h, recipe=recipe))
        h = dot(x, w_up) if form == "bf16" else dot(x, w_up, h_up)
        a = ops.swiglu(h.reshape(M, 2, F))
        return dot(a, w_down) if form == "bf16" else dot(a, w_down, h_down)

    def step(x, w_up, w_down, h_up, h_down, r):
        y, vjp = jax.vjp(forward, x, w_up, w_down, h_up, h_down)
        return y, vjp(r)

    return jax.jit(step), (x, w_up, w_down, h_up, h_down, r)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.fp8_mlp",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="16384", help="M values, comma-separated")
    p.add_argument("--shapes", default="2048x8192,768x2048", help="CxF, comma-separated")
    p.add_argument("--ops", default="ffi", choices=model_ops.NAMES)
    p.add_argument("--steps", type=int, default=20, help="timed calls (median)")
    a = p.parse_args(argv)
    ops = model_ops.get(a.ops)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    print("| M | C x F | bf16 ms | FP8 products ms | FP8 piece ms | products / piece | "
          "bf16 / piece |")
    print("|---|---|---|---|---|---|---|")
    for M in map(int, a.tokens.split(",")):
        for shape in a.shapes.split(","):
            C, F = map(int, shape.split("x"))
            ms = {form: 1e3 * time_it(*mlp(M, C, F, form, ops), a.steps) for form in FORMS}
            print(f"| {M} | {C}x{F} | {ms['bf16']:.3f} | {ms['products']:.3f} | "
                  f"{ms['piece']:.3f} | {ms['products'] / ms['piece']:.3f}x | "
                  f"{ms['bf16'] / ms['piece']:.3f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
