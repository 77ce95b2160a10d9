"""Timing for the kernel benchmarks: bytes moved over time, against measured copy bandwidth
(or, for a compute-bound op such as attention, floating-point operations over time).

Method: one jitted program runs the op on 4 to 32 distinct input sets, together far larger
than the L2 cache (so memory, not cache, is measured). One sample is the wall time of 4 such
programs queued back to back (after warm-up, until `block_until_ready`) over the number of
calls; the median of several samples is reported. The host's work per program overlaps the
device's, so what remains is device time plus the gaps between kernels.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import gzip
import json
import statistics
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

@dataclasses.dataclass
class Case:
    """One row of the table: an op, one direction, one shape and dtype, and its contenders.

    make(impl, key) returns (fn, args): fn(*args) runs the op once with impl ("ours", "xla",
    or another name in impls; a fn wrapped in TorchFn is a PyTorch contender, its args torch
    tensors); bytes is the fewest bytes the op must move (each input read once, each output
    written once). donate: the timed program donates its inputs, as a
    train step donates its state (for ops that update buffers in place); fn should then return
    its outputs in the order of the inputs they replace, since JAX pairs donated inputs with
    outputs of the same shape and dtype in order.

    flops: for a compute-bound op, the floating-point operations of one call; the row then
    reports TFLOP/s and goes to a table of its own. optional: impls that may be unavailable
    on this device or too large for it (cuDNN on a CPU, a jnp spec that materialises
    [T, T]); their failure is noted in the row instead of dropping the case. calls: input
    sets per timed program, where the default (enough to overflow L2) would be wasteful.
    """

    op: str
    direction: str
    shape: str
    dtype: str
    bytes: int
    make: Callable[[str, jax.Array], tuple[Callable, tuple]]
    impls: Sequence[str] = ("ours", "xla")
    donate: bool = False
    flops: int = 0
    optional: Sequence[str] = ()
    calls: int | None = None


@dataclasses.dataclass(frozen=True)
class TorchFn:
    """A contender written in PyTorch, a peer framework rather than JAX: fn(*args) takes torch
    tensors (to_torch) and runs eagerly, so run_case times it with time_torch, not time_op."""

    fn: Callable


def to_torch(x: jax.Array, requires_grad: bool = False):
    """A torch tensor sharing x's memory on x's device (DLPack: no copy)."""
    import torch

    return torch.from_dlpack(jax.block_until_ready(x)).requires_grad_(requires_grad)


def default_calls(bytes_per_call: int) -> int:
    """Input sets per timed program: 4 to 32, about 4 GiB in all (see time_op)."""
    return min(32, max(4, -(-(4 << 30) // max(bytes_per_call, 1))))


def time_op(fn, make_args, bytes_per_call: int, samples: int = 7, calls: int | None = None,
            programs: int = 4, donate: bool = False):
    """Median seconds per call of fn(*args).

    Every call in the program gets its own input set (identical calls on identical inputs
    would be merged by XLA's CSE), enough of them to be far beyond the L2 cache and to make
    the one dispatch per program negligible, within about 4 GiB of inputs. Several programs
    are queued before waiting, so the host's per-program work (passing dozens of arrays in and
    out) overlaps the device running the previous one. With donate, a program consumes its
    inputs, so each queued program gets fresh ones, made before the clock starts.
    """
    if calls is None:
        calls = default_calls(bytes_per_call)
    if donate:
        programs = 2  # each queued program holds its own inputs

    def inputs():
        return jax.block_until_ready([make_args(i) for i in range(calls)])

    def program(arg_sets):
        return [fn(*args) for args in arg_sets]

    program = jax.jit(program, donate_argnums=(0,) if donate else ())
    jax.block_until_ready(program(inputs()))  # compile and warm up
    shared = None if donate else inputs()
    times = []
    for _ in range(samples):
        queued = [inputs() for _ in range(programs)] if donate else [shared] * programs
        t0 = time.perf_counter()
        for arg_sets in queued:
            out = program(arg_sets)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / (programs * calls))
        del out, queued
    return statistics.median(times)


def time_torch(fn, make_args, calls: int, samples: int = 7, programs: int = 4) -> float:
    """Median seconds per call of a PyTorch fn(*args), timed as time_op times a JAX program:
    `calls` input sets, `programs` passes over them queued back to back per sample, the clock
    stopped once the device is done. PyTorch dispatches each op from the host as it goes, so its
    per-call host work overlaps the device's work on the calls before it."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    arg_sets = [make_args(i) for i in range(calls)]
    for args in arg_sets:  # warm up: kernel choice, the caching allocator's pools
        out = fn(*args)
    sync()
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(programs):
            for args in arg_sets:
                out = fn(*args)
        sync()
        times.append((time.perf_counter() - t0) / (programs * calls))
    del out
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device bandwidth in bytes/s of a 2 GiB scale op (read once, write once)."""
    n = nbytes // 4

    def make(i):
        return (jnp.full((n,), 1.0 + i, jnp.float32),)

    seconds = time_op(lambda x: x * 2.0, make, 2 * nbytes, samples=9, calls=3)
    return 2 * nbytes / seconds


@functools.lru_cache(maxsize=None)
def matched_copy_seconds(nbytes: int) -> float:
    """Seconds per call of XLA's scale op moving nbytes (half read, half written), timed the
    same way as the ops: what a plain copy of an op's bytes reaches in this harness. Small
    calls fall short of the 2 GiB copy figure (ramp-up, tail, gaps between kernels), and the
    ops pay the same."""
    fn, make = same_size_copy(nbytes)
    return time_op(fn, make, max(1, nbytes // 8) * 8)


def same_size_copy(nbytes: int):
    """(fn, make_args) of XLA's scale op moving nbytes: n float32 read, n written."""
    n = max(1, nbytes // 8)
    return (lambda x: x * 2.0), (lambda i: (jnp.full((n,), 1.0 + i, jnp.float32),))


def run_case(case: Case, copy_bw: float, seed: int = 0) -> dict:
    row = dict(op=case.op, direction=case.direction, shape=case.shape, dtype=case.dtype,
               bytes=case.bytes)
    if case.flops:
        row["flops"] = case.flops
    for impl in case.impls:
        try:
            fn, _ = case.make(impl, jax.random.key(seed))

            def make_args(i, impl=impl):
                return case.make(impl, jax.random.key(seed + i))[1]

            if isinstance(fn, TorchFn):
                seconds = time_torch(fn.fn, make_args, case.calls or default_calls(case.bytes))
            else:
                seconds = time_op(fn, make_args, case.bytes, calls=case.calls,
                                  donate=case.donate)
        except Exception as e:  # noqa: BLE001 - any failure of an optional contender is a note
            if impl not in case.optional:
                raise
            row[f"{impl}_skipped"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            continue
        row[f"{impl}_us"] = seconds * 1e6
        row[f"{impl}_gbs"] = case.bytes / seconds / 1e9
        row[f"{impl}_copy_frac"] = case.bytes / seconds / copy_bw
        if case.flops:
            row[f"{impl}_tflops"] = case.flops / seconds / 1e12
    if "xla_us" in row and "ours_us" in row:
        row["speedup_vs_xla"] = row["xla_us"] / row["ours_us"]
    if not case.flops and "ours_us" in row:
        # Past 2 GiB a copy runs at the 2 GiB figure (and a copy that large may not fit).
        seconds = (matched_copy_seconds(case.bytes) if case.bytes <= 2 << 30
                   else case.bytes / copy_bw)
        row["matched_copy_us"] = seconds * 1e6
        row["ours_matched_copy_frac"] = row["matched_copy_us"] / row["ours_us"]
    return row


def table(rows: list[dict], copy_bw: float) -> str:
    """A markdown table, ratios first; compute-bound rows (with flops) in a second table."""
    flop_rows = [r for r in rows if r.get("flops")]
    rows = [r for r in rows if not r.get("flops")]
    lines = [
        f"copy bandwidth (scale op, read + write): {copy_bw / 1e9:.0f} GB/s",
    ]
    if rows or not flop_rows:
        lines += [
            "",
            "| op | dir | rows x C | dtype | ours / XLA | ours % copy | XLA % copy | "
            "ours % same-size copy | ours GB/s | XLA GB/s | ours us | XLA us |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    for r in rows:
        lines.append(
            f"| {r['op']} | {r['direction']} | {r['shape']} | {r['dtype']} | "
            f"{r.get('speedup_vs_xla', float('nan')):.2f}x | {100 * r['ours_copy_frac']:.0f}% | "
            f"{100 * r.get('xla_copy_frac', float('nan')):.0f}% | "
            f"{100 * r.get('ours_matched_copy_frac', float('nan')):.0f}% | {r['ours_gbs']:.0f} | "
            f"{r.get('xla_gbs', float('nan')):.0f} | {r['ours_us']:.1f} | "
            f"{r.get('xla_us', float('nan')):.1f} |"
        )
    if flop_rows:
        lines += ["", flop_table(flop_rows)]
    return "\n".join(lines)


def flop_table(rows: list[dict]) -> str:
    """Compute-bound rows: TFLOP/s of ours, XLA and any other contender (e.g. cuDNN)."""
    def others(r):
        names = sorted({k[:-3] for k in r if k.endswith("_us")} - {"ours", "xla"}
                       | {k[:-8] for k in r if k.endswith("_skipped")} - {"ours", "xla"})
        return ", ".join(f"{n} {r[n + '_tflops']:.4g} ({r[n + '_us'] / r['ours_us']:.2f}x)"
                         if n + "_tflops" in r else f"{n} skipped" for n in names) or "-"

    def num(r, key, fmt):
        impl = key.rsplit("_", 1)[0]
        return format(r[key], fmt) if key in r else "skipped" if impl + "_skipped" in r else "-"

    lines = [
        "| op | dir | shape | dtype | ours / XLA | ours TFLOP/s | XLA TFLOP/s | others TFLOP/s "
        "(ours / them) | ours us | XLA us |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        speedup = f"{r['speedup_vs_xla']:.2f}x" if "speedup_vs_xla" in r else "-"
        lines.append(
            f"| {r['op']} | {r['direction']} | {r['shape']} | {r['dtype']} | {speedup} | "
            f"{num(r, 'ours_tflops', '.4g')} | {num(r, 'xla_tflops', '.4g')} | {others(r)} | "
            f"{num(r, 'ours_us', '.1f')} | {num(r, 'xla_us', '.1f')} |"
        )
    return "\n".join(lines)


def normal(key, shape, dtype, scale=1.0):
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def itemsize(dtype) -> int:
    return np.dtype(jnp.dtype(dtype)).itemsize


def trace_device_events(trace_dir: str) -> list[tuple[float, float, str]]:
    """(start us, duration us, name) of every device event in the Perfetto trace that
    `jax.profiler.trace(trace_dir, create_perfetto_trace=True)` wrote, by start."""
    path = glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True)[0]
    events = json.load(gzip.open(path))
    events = events["traceEvents"] if isinstance(events, dict) else events
    process = {e["pid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
    return sorted((e["ts"], e.get("dur", 0), e.get("name", "")) for e in events
                  if e.get("ph") == "X" and not process.get(e["pid"], "").startswith("/host"))


def traced_program(fn, arg_sets, trace_dir: str) -> list[tuple[float, float, str]]:
    """The device events (trace_device_events) of one jitted program that calls fn on every
    input set, compiled and run twice before the traced run."""
    program = jax.jit(lambda sets: [fn(*a) for a in sets])
    for _ in range(2):
        jax.block_until_ready(program(arg_sets))
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        jax.block_until_ready(program(arg_sets))
    return trace_device_events(trace_dir)
