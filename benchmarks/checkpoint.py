"""Checkpoint cost for a GPT-2 124M-sized training state: what the training loop waits for.

    python -m benchmarks.checkpoint [--saves 3] [--dtype float32] [--dir DIR]

The state is GPT-2 small's parameter shapes (random values) and an AdamW state for them, on
JAX's default device. Each save is followed by "training" (a jitted, donating update of the
whole state) while the background write runs; reported per save: the stall save() caused
(device-to-host copy), the background write time, and then the time of a verified restore.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from blujax.checkpoint import Checkpointer


def gpt2_small(dtype, vocab=50304, ctx=1024, d=768, layers=12):
    key = iter(jax.random.split(jax.random.key(0), 16 * layers + 4))
    normal = lambda shape: (0.02 * jax.random.normal(next(key), shape)).astype(dtype)  # noqa
    blocks = [{"ln1": {"w": jnp.ones(d, dtype), "b": jnp.zeros(d, dtype)},
               "attn": {"w": normal((d, 3 * d)), "b": jnp.zeros(3 * d, dtype),
                        "proj_w": normal((d, d)), "proj_b": jnp.zeros(d, dtype)},
               "ln2": {"w": jnp.ones(d, dtype), "b": jnp.zeros(d, dtype)},
               "mlp": {"fc_w": normal((d, 4 * d)), "fc_b": jnp.zeros(4 * d, dtype),
                       "proj_w": normal((4 * d, d)), "proj_b": jnp.zeros(d, dtype)}}
              for _ in range(layers)]
    return {"wte": normal((vocab, d)), "wpe": normal((ctx, d)), "blocks": blocks,
            "ln_f": {"w": jnp.ones(d, dtype), "b": jnp.zeros(d, dtype)}}


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.checkpoint", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--saves", type=int, default=3, choices=range(1, 100), metavar="N")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--dir", type=Path, help="checkpoint directory (default: a temporary "
                        "one, removed afterwards)")
    args = parser.parse_args(argv)

    params = gpt2_small(jnp.dtype(args.dtype))
    opt = optax.adamw(1e-4)
    state = {"params": params, "opt_state": opt.init(params), "rng": jax.random.key(1)}

    def step(state):  # stands in for a train step: reads and replaces every array
        upd = lambda t: jax.tree.map(lambda x: x * 0.999 if jnp.issubdtype(  # noqa: E731
            x.dtype, jnp.floating) else x, t)
        return {"params": upd(state["params"]), "opt_state": upd(state["opt_state"]),
                "rng": jax.random.fold_in(state["rng"], 1)}

    train = jax.jit(step, donate_argnums=0)
    state = jax.block_until_ready(train(state))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state)
                 if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key))
    n_params = sum(x.size for x in jax.tree.leaves(params))

    with tempfile.TemporaryDirectory(prefix="blujax-ckpt-bench-") as tmp:
        ckpt = Checkpointer(args.dir or tmp, keep=2)
        stalls, writes = [], []
        expect = None
        for i in range(args.saves):
            if i == args.saves - 1:
                expect = jax.tree.map(np.array, state["params"])  # to check the restore
            info = ckpt.save(i, state, loader={"epoch": 0, "batch": i}, config={"i": i})
            t0 = time.perf_counter()
            steps = 0
            while ckpt.in_flight():
                state = jax.block_until_ready(train(state))
                steps += 1
            train_s = time.perf_counter() - t0
            ckpt.wait()
            stalls.append(info.stall_s)
            writes.append(info.write_s)
            print(f"save {i}: stall {info.stall_s * 1e3:.1f} ms, write {info.write_s:.2f} s "
                  f"({nbytes / info.write_s / 1e9:.2f} GB/s); {steps} train steps "
                  f"({train_s:.2f} s) ran meanwhile")
        like = jax.tree.map(lambda x: x, state)
        t0 = time.perf_counter()
        restored = ckpt.restore(like=like)
        jax.block_until_ready(restored.tree)
        restore_s = time.perf_counter() - t0
        ckpt.close()
    same = all(np.array_equal(np.asarray(a), b) for a, b in zip(
        jax.tree.leaves(restored.tree["params"]), jax.tree.leaves(expect)))
    print(f"\n{n_params / 1e6:.1f}M parameters ({args.dtype}) + AdamW state = "
          f"{nbytes / 1e9:.2f} GB on {jax.devices()[0].device_kind}")
    print(f"stall per save: median {statistics.median(stalls) * 1e3:.1f} ms "
          f"(max {max(stalls) * 1e3:.1f}); background write: median "
          f"{statistics.median(writes):.2f} s; verified restore: {restore_s:.2f} s "
          f"({nbytes / restore_s / 1e9:.2f} GB/s){'' if same else '; RESTORE DIFFERS'}")


if __name__ == "__main__":
    main()
