"""The token loader beside a plain numpy-memmap loader: tokens/s, batch latency, memory.

    python -m benchmarks.dataloader [--batch 64] [--seq 1024] [--shards 2]
                                    [--shard-tokens 100M] [--batches 3000] [--step-ms 1]

Writes synthetic llm.c shards (random GPT-2 token ids) into a temporary folder (or --dir, kept
and reused), then runs each loader in a fresh Python process of its own, so that their memory
is measured apart:

- blujax: blujax.data.DataLoader (shuffled chunks, prefetch thread, new arrays per batch).
- blujax-reused: the same with reuse_buffers=True (buffers allocated once and reused).
- numpy-memmap: nanoGPT's get_batch: np.memmap of a shard, B random offsets, np.stack of the
  rows, astype(int32); synchronous.

Two passes per loader, each over `--batches` batches after a warm-up:
- "tight": next() back to back, nothing else: the most tokens/s the loader gives.
- "with step": the consumer sleeps `--step-ms` between batches (a training step, which waits
  on the device with the GIL released); latency is the time next() blocks, what a training
  loop sees.
RSS is the process's peak resident memory (VmHWM) over both passes; "imports" is the RSS
before the loader is made (blujax imports jax; the baseline imports numpy only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def rss_kib(field="VmRSS") -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def write_shards(directory: Path, shards: int, tokens: int) -> list[Path]:
    from blujax.data import read_header, write_shard  # here: the baseline's process needs no jax

    paths = []
    rng = np.random.default_rng(0)
    for i in range(shards):
        path = directory / f"bench_train_{i:06d}.bin"
        try:
            ok = read_header(path) == tokens
        except (OSError, ValueError):
            ok = False
        if not ok:
            write_shard(path, rng.integers(0, 50257, tokens, dtype=np.uint16))
        paths.append(path)
    return paths


class NumpyMemmapLoader:
    """nanoGPT's train.py get_batch, in numpy: a fresh memmap per batch (nanoGPT does so to
    avoid a memory leak), random row offsets."""

    def __init__(self, paths, batch, seq, seed=0):
        self.paths, self.batch, self.seq = paths, batch, seq
        self.rng = np.random.default_rng(seed)

    def __next__(self):
        path = self.paths[self.rng.integers(len(self.paths))]
        data = np.memmap(path, dtype=np.uint16, mode="r", offset=1024)
        ix = self.rng.integers(len(data) - self.seq - 1, size=self.batch)
        x = np.stack([data[i:i + self.seq] for i in ix]).astype(np.int32)
        y = np.stack([data[i + 1:i + 1 + self.seq] for i in ix]).astype(np.int32)
        return x, y


LOADERS = ("blujax", "blujax-reused", "numpy-memmap")


def run_child(args) -> dict:
    """One loader, in this (fresh) process."""
    paths = [Path(p) for p in args.paths]
    baseline = rss_kib()
    if args.child.startswith("blujax"):
        from blujax.data import DataLoader  # here, so that "imports" measures it
        imports = rss_kib()
        start = time.perf_counter()
        loader = DataLoader(paths, batch_size=args.batch, seq_len=args.seq, seed=0,
                            process_index=0, process_count=1, prefetch=args.prefetch,
                            reuse_buffers=args.child == "blujax-reused")
    else:
        imports = baseline
        start = time.perf_counter()
        loader = NumpyMemmapLoader(paths, args.batch, args.seq)
    next(loader)
    first_batch_s = time.perf_counter() - start
    for _ in range(args.warmup):
        next(loader)
    out = {"imports_mib": imports / 1024, "first_batch_s": first_batch_s}
    tokens = args.batch * args.seq
    for mode in ("tight", "step"):
        lat = np.empty(args.batches, np.int64)
        t0 = time.perf_counter()
        for i in range(args.batches):
            a = time.perf_counter_ns()
            next(loader)
            lat[i] = time.perf_counter_ns() - a
            if mode == "step":
                time.sleep(args.step_ms / 1e3)
        elapsed = time.perf_counter() - t0
        out[mode] = {
            "tokens_per_s": tokens * args.batches / (elapsed if mode == "tight"
                                                     else lat.sum() / 1e9),
            "median_us": float(np.median(lat)) / 1e3,
            "p99_us": float(np.percentile(lat, 99)) / 1e3,
            "max_us": float(lat.max()) / 1e3,
        }
    out["peak_rss_mib"] = rss_kib("VmHWM") / 1024
    if hasattr(loader, "close"):
        loader.close()
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.dataloader", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--shard-tokens", type=float, default=100e6)
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--step-ms", type=float, default=1.0)
    parser.add_argument("--prefetch", type=int, default=4)
    parser.add_argument("--dir", type=Path, help="keep the shards here (reused if present)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--child", choices=LOADERS, help=argparse.SUPPRESS)
    parser.add_argument("--paths", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_child(args)))
        return

    with tempfile.TemporaryDirectory(prefix="blujax-bench-") as tmp:
        directory = args.dir or Path(tmp)
        directory.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        paths = write_shards(directory, args.shards, int(args.shard_tokens))
        print(f"{args.shards} shards x {int(args.shard_tokens):,} tokens in {directory} "
              f"({time.perf_counter() - t0:.1f} s); B x T = {args.batch} x {args.seq}; "
              f"{args.batches} batches per pass; step {args.step_ms} ms; "
              f"CPUs: {os.cpu_count()}")
        results = {}
        for name in LOADERS:
            # This module again, in a fresh process (found as this one was: from the working
            # directory or PYTHONPATH, which the child inherits).
            cmd = [sys.executable, "-m", "benchmarks.dataloader", "--child", name, "--paths",
                   *(str(p.resolve()) for p in paths)]
            for flag in ("batch", "seq", "batches", "warmup", "step_ms", "prefetch"):
                cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
            run = subprocess.run(cmd, capture_output=True, text=True, check=True)
            results[name] = json.loads(run.stdout.strip().splitlines()[-1])

    rows = [("tokens/s, tight loop (M)", lambda r: f"{r['tight']['tokens_per_s'] / 1e6:,.0f}"),
            ("latency median, tight (us)", lambda r: f"{r['tight']['median_us']:.1f}"),
            ("latency p99, tight (us)", lambda r: f"{r['tight']['p99_us']:.1f}"),
            ("latency median, with step (us)", lambda r: f"{r['step']['median_us']:.1f}"),
            ("latency p99, with step (us)", lambda r: f"{r['step']['p99_us']:.1f}"),
            ("latency max, with step (us)", lambda r: f"{r['step']['max_us']:.0f}"),
            ("peak RSS (MiB)", lambda r: f"{r['peak_rss_mib']:.0f}"),
            ("RSS after imports (MiB)", lambda r: f"{r['imports_mib']:.0f}"),
            ("first batch after start (ms)", lambda r: f"{r['first_batch_s'] * 1e3:.0f}")]
    names = list(results)
    print(f"\n| measure | {' | '.join(names)} |\n|---|{'---|' * len(names)}")
    for label, fmt in rows:
        print(f"| {label} | {' | '.join(fmt(results[n]) for n in names)} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
