"""Memory-bound ops timed on the device from a profiler trace, beside a copy of the same bytes.

    python -m benchmarks.device_time [--ops layernorm,...] [--filter TEXT] [--calls N]

benchmarks.kernels times programs from the host: what it reports also holds the gaps
between kernels and between programs, which on calls of tens of microseconds are several
percent (a host dispatching a program of 32 such calls is close to the device's pace). Here
each implementation's program (the same cases and input sets as kernels.py) runs once under
`jax.profiler.trace`, and the table gives per call: the device time from the program's first
kernel to its last ("span") and the time kernels ran ("busy"), and the same for XLA's scale op
moving the op's bytes ("copy"). "% copy" is the copy's span over the op's: the fraction of a
plain copy's rate, in device time. "GB/s" is the op's byte count (as kernels.py counts it) over
its span, and "% 2 GiB copy" divides that by kernels.py's copy figure (a 2 GiB scale op, timed
in this run; at that size the host's dispatch is negligible). Cases with a FLOP count
(attention) are left out. Needs a GPU.
"""

from __future__ import annotations

import argparse
import importlib
import tempfile

import jax

from benchmarks.harness import copy_bandwidth, default_calls, same_size_copy, traced_program
from benchmarks.kernels import ALL_OPS


def traced(fn, arg_sets, trace_dir: str) -> tuple[float, float, int]:
    """Span and busy device time in us, and the number of device events, of one program that
    calls fn on every input set (compiled and run twice before the traced run)."""
    events = traced_program(fn, arg_sets, trace_dir)
    span = events[-1][0] + events[-1][1] - events[0][0]
    return span, sum(d for _, d, _ in events), len(events)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.device_time", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", default=",".join(ALL_OPS),
                   help=f"comma-separated ops (default: all of {', '.join(ALL_OPS)}; those "
                        "with a FLOP count have no rows)")
    p.add_argument("--filter", default="",
                   help="keep only cases whose 'op dir shape dtype' contains this text")
    p.add_argument("--calls", type=int, default=0,
                   help="calls per program (default: as kernels.py, 4 to 32 input sets, "
                        "about 4 GiB in all)")
    a = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        raise SystemExit("device_time.py needs a GPU: it reads kernel times from the device")
    root = tempfile.mkdtemp(prefix="device_time_")
    copy_bw = copy_bandwidth(2 << 30)
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; 2 GiB copy "
          f"{copy_bw / 1e9:.0f} GB/s")
    print("| op | dir | rows x C | dtype | ours us | XLA us | copy us | ours % copy | "
          "XLA % copy | ours busy % | ours kernels | ours GB/s | ours % 2 GiB copy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for op in a.ops.split(","):
        if op not in ALL_OPS:
            p.error(f"unknown op {op!r}; choose from {', '.join(ALL_OPS)}")
        for case in importlib.import_module(f"benchmarks.cases.{op}").cases(False):
            name = f"{case.op} {case.direction} {case.shape} {case.dtype}"
            if case.flops or a.filter not in name:
                continue
            calls = a.calls or default_calls(case.bytes)
            us = {}
            for impl in ("ours", "xla"):
                fn, _ = case.make(impl, jax.random.key(0))
                sets = jax.block_until_ready(
                    [case.make(impl, jax.random.key(i))[1] for i in range(calls)])
                us[impl] = traced(fn, sets, f"{root}/{len(us)}_{name.replace(' ', '_')}")
                del sets
            fn, make = same_size_copy(case.bytes)
            sets = jax.block_until_ready([make(i) for i in range(calls)])
            copy = traced(fn, sets, f"{root}/copy_{name.replace(' ', '_')}")
            del sets
            ours, xla = us["ours"], us["xla"]
            gbs = case.bytes / (ours[0] / calls) / 1e3  # bytes per us -> GB/s
            print(f"| {case.op} | {case.direction} | {case.shape} | {case.dtype} | "
                  f"{ours[0] / calls:.1f} | {xla[0] / calls:.1f} | {copy[0] / calls:.1f} | "
                  f"{copy[0] / ours[0]:.0%} | {copy[0] / xla[0]:.0%} | {ours[1] / ours[0]:.0%} "
                  f"| {ours[2] / calls:.2f} | {gbs:.0f} | {gbs * 1e9 / copy_bw:.1%} |", flush=True)


if __name__ == "__main__":
    main()
