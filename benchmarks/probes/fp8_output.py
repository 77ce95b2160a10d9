"""How should an FP8 product hand back its bfloat16 output? blujax.fp8.scaled_dot written several
ways, side by side in one run: one product's forward + backward (benchmarks.fp8's program), and
optionally a whole train step.

    python -m benchmarks.probes.fp8_output [--forms f32,bf16,bf16-f32] [--shapes 2048x16384]
                                           [--tokens 16384] [--model llama-1b --seq 2048 --batch 8]

  f32       the dot's output type is float32, scaled by sa sb, then cast to bfloat16 (what
            blujax.fp8 did first)
  bf16      the dot's output type is bfloat16 (preferred_element_type), scaled by a bfloat16
            scalar (what blujax.fp8.scaled_dot does)
  bf16-f32  the dot's output bfloat16, scaled in float32 and cast back

For each form: how XLA runs the products (the cuBLASLt FP8 calls and their output types: one
call writing bfloat16 saves a float32 write, its read and the separate cast), its time beside
bfloat16's, and with --model the train step's tokens/s (the form swapped in while it compiles).
Needs a Hopper GPU to mean anything (elsewhere XLA emulates FP8).
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import jax
import jax.numpy as jnp

from benchmarks import fp8 as fp8_bench
from blujax import fp8


def _f32(a, sa, b, sb, dims, dtype):
    acc = jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)
    return (acc * (sa * sb)).astype(dtype)


def _bf16(a, sa, b, sb, dims, dtype):
    acc = jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=dtype)
    return acc * (sa * sb).astype(dtype)


def _bf16_f32(a, sa, b, sb, dims, dtype):
    acc = jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=dtype)
    return (acc.astype(jnp.float32) * (sa * sb)).astype(dtype)


FORMS = {"f32": _f32, "bf16": _bf16, "bf16-f32": _bf16_f32}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.fp8_output",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--forms", default=",".join(FORMS), help="forms, comma-separated")
    p.add_argument("--tokens", type=int, default=16384, help="M of the product")
    p.add_argument("--shapes", default="2048x16384,8192x2048,2048x3072",
                   help="KxN products, comma-separated")
    p.add_argument("--scaling", default="delayed", choices=fp8.SCALINGS)
    p.add_argument("--steps", type=int, default=20, help="timed calls (median)")
    p.add_argument("--model", help="also time this preset's train step per form (--fp8 on)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    a = p.parse_args(argv)
    forms = a.forms.split(",")
    original = fp8.scaled_dot
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    rows = []
    for shape in a.shapes.split(","):
        K, N = (int(v) for v in shape.split("x"))
        f, args = fp8_bench.product(a.tokens, K, N, None)
        row = {"shape": shape, "ref": fp8_bench.time_it(f, args, a.steps) * 1e3}
        for form in forms:
            fp8.scaled_dot = FORMS[form]
            try:
                f, args = fp8_bench.product(a.tokens, K, N, fp8.Recipe(a.scaling))
                t0 = time.perf_counter()
                hlo = f.lower(*args).compile().as_text()
                row[f"{form} compile_s"] = time.perf_counter() - t0
                row[f"{form} hlo"] = f"FP8 calls by output type {fp8_bench.f8_calls(hlo)}"
                row[form] = fp8_bench.time_it(f, args, a.steps) * 1e3
            finally:
                fp8.scaled_dot = original
        rows.append(row)
        print(json.dumps(row), flush=True)
    steps = {}
    if a.model:
        from benchmarks import train as train_bench
        from blujax.model import get_config
        config = get_config(a.model)
        for form in forms:
            fp8.scaled_dot = FORMS[form]
            try:
                r = train_bench.run_one(config, a.seq, a.batch, "ffi", "bf16", 10,
                                        fp8=f"on:{a.scaling}")
            finally:
                fp8.scaled_dot = original
            steps[form] = r
            print(json.dumps(r), flush=True)
            gc.collect()
    print(f"| {a.tokens} x K x N | bf16 product ms | " + " | ".join(f"{f} ms" for f in forms) + " |")
    print("|---" * (2 + len(forms)) + "|")
    for r in rows:
        cells = " | ".join(f"{r[f]:.3f} ({r['ref'] / r[f]:.2f}x)" for f in forms)
        print(f"| {r['shape']} | {r['ref']:.3f} | {cells} |")
    for form in forms:
        print(f"| {form} | " + " | ".join(str(r[f"{form} hlo"]) for r in rows) + " |")
    for form, r in steps.items():
        print(f"| {a.model} {form} | {r['tokens_per_s'] / 1e3:.1f}K tok/s | "
              f"{r['program_gb']:.1f} GB | compile {r['compile_s']:.0f} s | "
              f"{r['cublas_f8_calls']} FP8 calls |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
