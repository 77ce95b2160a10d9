"""The GELU forward, ours vs XLA's fusion, timed per kernel on the device from a profiler trace.

    python -m benchmarks.probes.gelu_device_time [--dtype float32] [--calls 16] [--trace-dir DIR]

benchmarks.kernels times whole programs from the host, which also counts the gaps around
them. Here each implementation runs a jitted program of --calls calls (distinct inputs) three
times under `jax.profiler.trace`; the median duration of the op's kernels on the device and
the gaps between consecutive ones are read from the Perfetto trace. Cases: the flat and the
bias forward at 16384 x 3072, 32768 x 3072 and 16384 x 4096 (benchmarks/cases/gelu.py's
shapes). Needs a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import jax
import jax.numpy as jnp

from benchmarks.harness import normal, trace_device_events
from blujax import kernels
from blujax.kernels import xla

SHAPES = [(16384, 3072), (32768, 3072), (16384, 4096)]


def device_kernels(trace_dir: str, min_us: float) -> list[tuple[float, float]]:
    """(start, duration) in us of the device events of at least min_us in a Perfetto trace."""
    return [(t, d) for t, d, _ in trace_device_events(trace_dir) if d >= min_us]


def measure(fn, args, trace_dir: str, min_us: float) -> tuple[float, float]:
    """Median kernel duration and median gap between consecutive kernels, in us."""
    program = jax.jit(lambda sets: [fn(*a) for a in sets])
    jax.block_until_ready(program(args))  # compile and warm up
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(3):
            out = program(args)
        jax.block_until_ready(out)
    ks = device_kernels(trace_dir, min_us)
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(ks, ks[1:])]
    return statistics.median(d for _, d in ks), statistics.median(gaps)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.probes.gelu_device_time", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="element type (default float32)")
    p.add_argument("--calls", type=int, default=16, help="calls per traced program (default 16)")
    p.add_argument("--trace-dir", help="where the traces go (default: a temporary directory)")
    a = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        raise SystemExit("gelu_device_time.py needs a GPU: it reads kernel times from the device")
    dtype = jnp.dtype(a.dtype)
    root = a.trace_dir or tempfile.mkdtemp(prefix="gelu_trace_")
    print("| case | ours us | XLA us | XLA / ours | median gap ours / XLA us |")
    print("|---|---|---|---|---|")
    for bias in (False, True):
        for rows, cols in SHAPES:
            def make(i, rows=rows, cols=cols):
                k1, k2 = jax.random.split(jax.random.key(i))
                return normal(k1, (rows, cols), dtype), normal(k2, (cols,), dtype, 0.1)
            args = jax.block_until_ready([make(i) for i in range(a.calls)])
            # A tenth of the copy time of the tensor: the op's kernels, not small fusions.
            min_us = rows * cols * dtype.itemsize * 2 / 3e12 * 1e6 / 10
            ours = (lambda x, b: kernels.gelu(x, b)) if bias else (lambda x, b: kernels.gelu(x))
            ref = (lambda x, b: xla.gelu(x, b)) if bias else (lambda x, b: xla.gelu(x))
            name = f"{'bias_' if bias else ''}gelu {rows}x{cols}"
            t_ours, g_ours = measure(ours, args, f"{root}/{name.replace(' ', '_')}_ours", min_us)
            t_xla, g_xla = measure(ref, args, f"{root}/{name.replace(' ', '_')}_xla", min_us)
            print(f"| {name} | {t_ours:.1f} | {t_xla:.1f} | {t_xla / t_ours:.3f} | "
                  f"{g_ours:.2f} / {g_xla:.2f} |", flush=True)


if __name__ == "__main__":
    main()
