"""How long HellaSwag's validation set takes to score: blujax.hellaswag.score on GPT-2.

    python -m benchmarks.hellaswag                          # 10,042 synthetic items, GPT-2 124M
    python -m benchmarks.hellaswag --items hellaswag_val.jsonl --ops ffi,xla

Without --items, the items are made up with the official set's shape (a context of 20-120
tokens and four endings of 8-40, random tokens), so the timing needs no download; with a real
file the accuracy printed means something too (a random model's is about 0.25). Each
configuration is scored twice: the first time compiles, the second is the figure.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from blujax import hellaswag
from blujax.model import gpt2
from blujax.model import ops as model_ops


def synthetic_items(n: int, vocab: int, seed: int = 0) -> list[hellaswag.Item]:
    rng = np.random.default_rng(seed)
    items = []
    for _ in range(n):
        ctx = tuple(int(t) for t in rng.integers(0, vocab, rng.integers(20, 121)))
        endings = tuple(tuple(int(t) for t in rng.integers(0, vocab, rng.integers(8, 41)))
                        for _ in range(4))
        items.append(hellaswag.Item(ctx, endings, int(rng.integers(0, 4))))
    return items


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.hellaswag", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2", choices=list(gpt2.PRESETS),
                   help="a GPT-2 preset (default gpt2)")
    p.add_argument("--items", metavar="FILE", help="HellaSwag jsonl (default: 10,042 synthetic "
                                                   "items)")
    p.add_argument("--n", type=int, default=10042, help="synthetic items (default 10042)")
    p.add_argument("--ops", default="ffi", help="ops namespaces, comma-separated (default ffi)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "f32"),
                   help="compute dtype (default bf16)")
    p.add_argument("--rows", type=int, default=64, help="rows per batch (default 64)")
    args = p.parse_args(argv)

    config = gpt2.PRESETS[args.model]
    params = gpt2.init(config, jax.random.key(0))
    items = (hellaswag.load_items(args.items) if args.items
             else synthetic_items(args.n, config.vocab_size))
    dtype = {"bf16": jnp.bfloat16, "f32": jnp.float32}[args.dtype]
    print("| model | items | ops | dtype | rows/batch | first (compiles) s | again s | "
          "items/s | acc_norm |\n|---|---|---|---|---|---|---|---|---|")
    for name in args.ops.split(","):
        times = []
        for _ in range(2):
            start = time.perf_counter()
            result = hellaswag.score(params, config, items, ops=model_ops.get(name), dtype=dtype,
                                     rows_per_batch=args.rows)
            times.append(time.perf_counter() - start)
        print(f"| {args.model} | {len(items)} | {name} | {args.dtype} | {args.rows} | "
              f"{times[0]:.1f} | {times[1]:.1f} | {len(items) / times[1]:,.0f} | "
              f"{result['hellaswag_acc_norm']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
