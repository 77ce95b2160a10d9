"""add_rms_norm three ways: the plain kernel (y and the sum in bfloat16); the plain kernel and
then the cast an FP8 product makes of y (its FP8 copy, the copy's transpose and y's amax, as
XLA fuses them); and add_rms_norm's FP8 form, which writes those instead of y.

    python -m benchmarks.probes.fp8_norm [--tokens 65536] [--widths 2048,4096] [--steps 20]

Each is one jitted call on x, residual [M, C] bfloat16, timed as the median of --steps calls;
GB/s counts the bytes each must move at least (read x and residual, write the sum and y or
its two FP8 copies).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import blujax.kernels as K
from benchmarks.fp8 import time_it
from blujax.kernels import xla

FORMS = ("plain", "plain + cast", "fp8 form")


def form(name, M, C):
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (M, C), jnp.bfloat16)
    r = jax.random.normal(k[1], (M, C), jnp.bfloat16)
    w = (1 + 0.1 * jax.random.normal(k[2], (C,))).astype(jnp.bfloat16)
    scale = jnp.float32(1 / 64)

    def f(x, r, w, scale):
        if name == "fp8 form":
            return K.add_rms_norm_fwd_fp8(x, r, w, scale)
        y, s = K.add_rms_norm(x, r, w)
        return (y, s) if name == "plain" else (*xla.fp8_copy(y, scale, jnp.float8_e4m3fn), s)

    return jax.jit(f), (x, r, w, scale)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.fp8_norm",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="65536", help="M values, comma-separated")
    p.add_argument("--widths", default="2048,4096", help="C values, comma-separated")
    p.add_argument("--steps", type=int, default=20, help="timed calls (median)")
    a = p.parse_args(argv)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    print("| M x C | plain ms | plain + cast ms | FP8 form ms | (plain + cast) / form | "
          "form GB/s |")
    print("|---|---|---|---|---|---|")
    for M in map(int, a.tokens.split(",")):
        for C in map(int, a.widths.split(",")):
            ms = {n: 1e3 * time_it(*form(n, M, C), a.steps) for n in FORMS}
            moved = M * C * (2 + 2 + 2 + 1 + 1)  # x, residual, sum (bf16); q, qt (1 byte)
            print(f"| {M}x{C} | {ms['plain']:.3f} | {ms['plain + cast']:.3f} | "
                  f"{ms['fp8 form']:.3f} | {ms['plain + cast'] / ms['fp8 form']:.3f}x | "
                  f"{moved / ms['fp8 form'] / 1e6:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
