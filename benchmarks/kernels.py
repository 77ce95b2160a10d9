"""Kernel benchmarks: each op of ours side by side with XLA's compiled jnp spec, one run.

    python -m benchmarks.kernels [--ops layernorm,...] [--quick] [--out DIR]

Prints a markdown table (ratios first) and writes kernels.jsonl and kernels.md to --out.
Bandwidth is bytes that must move (inputs read once, outputs written once) over the median
time; "% copy" divides by the device-to-device copy bandwidth measured in the same run (a 2 GiB
scale op), "% same-size copy" compares the op's time with the same scale op moving the op's
own bytes (what a plain copy of that size reaches, launch gaps and all).
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import pkgutil

import jax

import blujax
from benchmarks import cases as cases_pkg
from benchmarks.harness import copy_bandwidth, run_case, table

ALL_OPS = sorted(m.name for m in pkgutil.iter_modules(cases_pkg.__path__))


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.kernels", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", default=",".join(ALL_OPS),
                        help=f"comma-separated ops to run (default: all of {', '.join(ALL_OPS)})")
    parser.add_argument("--quick", action="store_true",
                        help="one shape per op, for a smoke test (e.g. on the CPU)")
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="folder for kernels.jsonl and kernels.md (default: print only)")
    args = parser.parse_args(argv)

    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
          f"blujax kernels: {blujax.kernel_backends()}", flush=True)
    copy_bw = copy_bandwidth(64 << 20 if args.quick else 2 << 30)
    rows = []
    for op in args.ops.split(","):
        if op not in ALL_OPS:
            parser.error(f"unknown op {op!r}; choose from {', '.join(ALL_OPS)}")
        for case in importlib.import_module(f"benchmarks.cases.{op}").cases(args.quick):
            try:
                row = run_case(case, copy_bw)
            except jax.errors.JaxRuntimeError as e:  # a case too large for this device
                print(f"skipped {case.op} {case.direction} {case.shape} {case.dtype}: "
                      f"{str(e).splitlines()[0][:200]}", flush=True)
                continue
            rows.append(row)
            print(json.dumps(row), flush=True)
    text = f"device: {device.device_kind}\n" + table(rows, copy_bw)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kernels.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (args.out / "kernels.md").write_text(text + "\n")
    print("\n" + text)


if __name__ == "__main__":
    main()
