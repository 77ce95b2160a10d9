"""LayerNorm's device time split into a cost per call and a cost per row, beside XLA.

    python -m benchmarks.probes.layernorm_fixed_cost [--dtype bfloat16] [--cols 768] [--rows R,...]

A memory-bound kernel on a small tensor pays for its start and its end (the first loads'
latency, the last rows' drain, a second kernel) as well as for its bytes. Here our LayerNorm
forward and backward run over several row counts, each timed on the device from a profiler
trace (kernel time a call, the backward's two kernels summed), beside two XLA elementwise
ops that move the same bytes the same way: y = 2 x (one read, one write, as the forward) and
z = 2 x + y (two reads, one write, as the backward). A straight line fitted over the larger
row counts gives each a fixed cost a call and a rate per byte. Needs a GPU.
"""

from __future__ import annotations

import argparse
import collections
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import itemsize, normal, traced_program
from blujax import kernels


def kernel_us(fn, sets, trace_dir: str) -> dict[str, float]:
    """Device time a call of each kernel fn runs, by kernel name."""
    total = collections.Counter()
    for _, dur, name in traced_program(fn, sets, trace_dir):
        total[name] += dur / len(sets)
    return dict(total)


def is_backward(name: str) -> bool:
    return "Bwd" in name or "ReducePartials" in name


def main(argv=None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.probes.layernorm_fixed_cost",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="element type of x, dy and the outputs (default bfloat16)")
    p.add_argument("--cols", type=int, default=768, help="C, the normalised axis (default 768)")
    p.add_argument("--rows", default="2112,4224,8448,16384,32768,65536",
                   help="comma-separated row counts to time (default 2112 to 65536)")
    p.add_argument("--fit-from", type=int, default=8448,
                   help="fit the line over row counts from this one up (default 8448)")
    a = p.parse_args(argv)
    if jax.default_backend() != "gpu":
        raise SystemExit("layernorm_fixed_cost.py needs a GPU: it reads kernel times from the "
                         "device")
    dtype, cols = jnp.dtype(a.dtype), a.cols
    rows_list = [int(r) for r in a.rows.split(",")]
    root = tempfile.mkdtemp(prefix="layernorm_fixed_cost_")
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, {a.dtype}, C = {cols}")
    print("| rows | ours fwd us | ours bwd us | XLA 2x us | XLA 2x + y us |")
    print("|---|---|---|---|---|")

    def backward(x, w, b, dy):
        return jax.vjp(kernels.layer_norm, x, w, b)[1](dy)

    programs = {
        "fwd": (lambda x, w, b, dy: kernels.layer_norm(x, w, b),
                lambda k: sum(v for n, v in k.items() if "Fwd" in n)),
        "bwd": (backward, lambda k: sum(v for n, v in k.items() if is_backward(n))),
        "1r1w": (lambda x, w, b, dy: x * 2, lambda k: sum(k.values())),
        "2r1w": (lambda x, w, b, dy: x * 2 + dy, lambda k: sum(k.values())),
    }
    measured = []
    for rows in rows_list:
        tensor = rows * cols * itemsize(dtype)
        calls = int(np.clip((2 << 30) // (3 * tensor), 4, 32))
        sets = []
        for i in range(calls):
            k = jax.random.split(jax.random.key(i), 4)
            sets.append((normal(k[0], (rows, cols), dtype), 1 + normal(k[1], (cols,), dtype, .1),
                         normal(k[2], (cols,), dtype, .1), normal(k[3], (rows, cols), dtype)))
        sets = jax.block_until_ready(sets)
        us = {name: pick(kernel_us(fn, sets, f"{root}/{name}_{rows}"))
              for name, (fn, pick) in programs.items()}
        del sets
        measured.append((rows, us))
        print(f"| {rows} | {us['fwd']:.2f} | {us['bwd']:.2f} | {us['1r1w']:.2f} | "
              f"{us['2r1w']:.2f} |", flush=True)

    fit = [(r, us) for r, us in measured if r >= a.fit_from]
    if len(fit) < 2:
        return
    print(f"\nFitted over rows >= {a.fit_from} (tensor bytes: rows x C x {itemsize(dtype)}):")
    print("| what | fixed us a call | us per 16384 rows | GB/s per byte moved |")
    print("|---|---|---|---|")
    rows = np.array([r for r, _ in fit], float)
    moved = {"fwd": 2, "bwd": 3, "1r1w": 2, "2r1w": 3}  # tensors read or written a call
    labels = {"fwd": "ours forward", "bwd": "ours backward", "1r1w": "XLA 2x",
              "2r1w": "XLA 2x + y"}
    for name in programs:
        slope, fixed = np.polyfit(rows, [us[name] for _, us in fit], 1)
        rate = moved[name] * cols * itemsize(dtype) / (slope * 1e-6) / 1e9
        print(f"| {labels[name]} | {fixed:.2f} | {slope * 16384:.2f} | {rate:.0f} |")


if __name__ == "__main__":
    main()
