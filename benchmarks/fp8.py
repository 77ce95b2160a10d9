"""FP8 against bfloat16 for one block product, forward and backward: the measurement behind
blujax.fp8.pays (which products the `--fp8` rule puts in FP8).

    python -m benchmarks.fp8 [--tokens 16384,65536] [--shapes 768x2304,2048x8192,...]
                             [--scaling dynamic,delayed] [--steps 20]

For each (tokens M, product K x N): the jitted forward + backward of y = x [M, K] @ w [K, N]
(y and its vjp against a random bfloat16 cotangent r [M, N], so all three products run), in
bfloat16, and with blujax.fp8.matmul (its casts, amaxes and three FP8 products included),
timed as medians of --steps calls; the ratio is bf16 time / fp8 time (above 1: FP8 pays).
The default shapes are the block products of GPT-2 124M, llama-d12, llama-1b and llama-8b.
It also says whether XLA turned the FP8 products into cuBLASLt FP8 calls (the optimized HLO's
custom calls).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import jax
import jax.numpy as jnp

from blujax import fp8

# (K, N) of the block products: GPT-2 124M (qkv, out, up, down), llama-d12, llama-1b, 8b.
SHAPES = ("768x2304,768x768,768x3072,3072x768,"
          "768x1280,2048x768,768x4096,"
          "2048x3072,2048x2048,2048x16384,8192x2048,"
          "4096x6144,4096x4096,4096x28672,14336x4096")


def product(M, K, N, recipe):
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (M, K), jnp.bfloat16)
    w = (0.02 * jax.random.normal(k[1], (K, N))).astype(jnp.bfloat16)
    r = jax.random.normal(k[2], (M, N), jnp.bfloat16)

    def forward(x, w, h):
        return x @ w if recipe is None else fp8.matmul(
            x, w, h if recipe.delayed else None, recipe=recipe)

    def step(x, w, h, r):
        # The product and its vjp against r, all three returned: none of the three products
        # is dead code (a loss sum(y * r) would leave the forward's unused).
        y, vjp = jax.vjp(forward, x, w, h)
        return y, vjp(r)

    # r is an argument, not a constant of the program (XLA would fold its amax at compile
    # time); the delayed history a warm one (the tensors' own amaxes).
    h = jnp.stack([jnp.full((16,), fp8.amax(t)) for t in (x, w, r)])
    return jax.jit(step), (x, w, h, r)


def f8_calls(hlo: str) -> dict[str, int]:
    """The cuBLASLt FP8 calls of an optimized HLO, counted by their output type."""
    outs = re.findall(r"= \((\w+)\[[^\]]*\][^)]*\) custom-call\([^\n]*cublas\$lt\$matmul\$f8",
                      hlo)
    return {t: outs.count(t) for t in sorted(set(outs))}


def gemm_kinds(hlo: str) -> str:
    """How XLA runs the products of an optimized HLO: its cuBLAS(Lt) calls and Triton GEMM
    fusions, counted, and the FP8 among them (what the forward and both backward products of
    an FP8 matmul should all be)."""
    lines = [ln for ln in hlo.splitlines() if "custom_call_target=" in ln or "gemm" in ln]
    f8 = [ln for ln in lines if "f8e" in ln.split("=")[1][:200].lower() or "$f8" in ln]
    cublas = sum("__cublas" in ln for ln in lines)
    triton = sum("triton_gemm" in ln or "nested_gemm" in ln for ln in lines)
    return (f"{cublas} cuBLAS calls ({sum(f8_calls(hlo).values())} FP8), {triton} "
            f"Triton GEMM lines, {len(f8)} lines with FP8 operands")


def time_it(f, args, steps):
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.fp8",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="16384,65536", help="M values, comma-separated")
    p.add_argument("--shapes", default=SHAPES, help="KxN products, comma-separated")
    p.add_argument("--scaling", default="dynamic,delayed", help="FP8 scalings to time")
    p.add_argument("--steps", type=int, default=20, help="timed calls (median)")
    p.add_argument("--hlo", metavar="PATH", help="write the first FP8 program's optimized HLO")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON lines")
    a = p.parse_args(argv)
    rows = []
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    scalings = a.scaling.split(",")
    checked = set()
    for M in (int(m) for m in a.tokens.split(",")):
        for shape in a.shapes.split(","):
            K, N = (int(v) for v in shape.split("x"))
            row = {"M": M, "K": K, "N": N}
            f, args = product(M, K, N, None)
            row["bf16_ms"] = time_it(f, args, a.steps) * 1e3
            for s in scalings:
                f, args = product(M, K, N, fp8.Recipe(s))
                if s not in checked:
                    hlo = f.lower(*args).compile().as_text()
                    print(f"{s}: {gemm_kinds(hlo)}", flush=True)
                    if a.hlo and not checked:
                        with open(a.hlo, "w") as fh:
                            fh.write(hlo)
                    checked.add(s)
                row[f"{s}_ms"] = time_it(f, args, a.steps) * 1e3
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)
    head = " | ".join(f"{s} ms | bf16/{s}" for s in scalings)
    print(f"| M | K x N | bf16 ms | {head} | rule |")
    print("|---" * (4 + 2 * len(scalings)) + "|")
    for r in rows:
        cells = " | ".join(f"{r[f'{s}_ms']:.3f} | {r['bf16_ms'] / r[f'{s}_ms']:.2f}x"
                           for s in scalings)
        rule = "fp8" if fp8.pays(r["K"], r["N"]) else "bf16"
        print(f"| {r['M']} | {r['K']}x{r['N']} | {r['bf16_ms']:.3f} | {cells} | {rule} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
