"""Where should Llama's rotary embedding run? Train steps of one model, the block written four
ways, side by side in one run.

    python -m benchmarks.probes.llama_rope [--model llama-d12] [--seq 1024] [--batch 16]
                                           [--variants separate,split,rope_qkv,no_rope]

  separate   three projections (q, k, v), then `rope` on q and on k: two kernel calls a way
  split      one fused QKV projection, XLA slices q, k, v out of it, then `rope` on q and k
  rope_qkv   one fused QKV projection, `rope_qkv` splits it with q and k turned: one kernel
             a way (what blujax.model.llama runs)
  no_rope    as split without any rotation: the model is wrong, but its step time bounds what
             moving the rotation into the attention kernels could give (they would still read
             q and k, and turn them on the way in)

Each variant is the same parameters and data through train.make_train_step (ops "ffi", bf16),
compiled, warmed up and timed as benchmarks/train.py times a step (median of --steps). Each
variant is a copy of Llama's stack.Decoder with that block, swapped in for the family's
forward while the step compiles. Needs a GPU to mean anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json

import jax
import jax.numpy as jnp

from benchmarks.train import time_steps
from blujax import model, train
from blujax.model import llama
from blujax.model import ops as model_ops


def _attention_and_mlp(layer, s, q, k, v, *, config, ops, attend, par):
    a, kv = attend.heads(q, k, v)
    a = par.matmul_reduce(a.reshape(*a.shape[:2], -1), layer["wo"])
    h, s = ops.add_rms_norm(a, s, layer["mlp_norm"], eps=config.norm_eps)
    w = layer["w_gate_up"]
    g = par.gather_matmul(h, w.reshape(w.shape[0], -1))
    m = par.matmul_reduce(ops.swiglu(g.reshape(*g.shape[:2], 2, -1)), layer["w_down"])
    return (s, m), kv


def _fused_split(layer, h, par, D):
    wq = layer["wq"]
    qkv = par.gather_matmul(h, jnp.concatenate([wq, layer["wk"], layer["wv"]], axis=-1))
    qkv = qkv.reshape(*qkv.shape[:2], -1, D)
    heads, kv = wq.shape[-1] // D, layer["wk"].shape[-1] // D
    return qkv[:, :, :heads], qkv[:, :, heads:heads + kv], qkv[:, :, heads + kv:]


def block_separate(layer, carry, *, config, ops, attend, par, rope):
    (s, d), (cos, sin) = carry, rope
    D = config.head_dim
    h, s = ops.add_rms_norm(d, s, layer["attn_norm"], eps=config.norm_eps)

    def heads(w):
        x = par.gather_matmul(h, w)
        return x.reshape(*x.shape[:2], -1, D)

    q, k, v = heads(layer["wq"]), heads(layer["wk"]), heads(layer["wv"])
    return _attention_and_mlp(layer, s, ops.rope(q, cos, sin), ops.rope(k, cos, sin), v,
                              config=config, ops=ops, attend=attend, par=par)


def block_split(layer, carry, *, config, ops, attend, par, rope):
    (s, d), (cos, sin) = carry, rope
    h, s = ops.add_rms_norm(d, s, layer["attn_norm"], eps=config.norm_eps)
    q, k, v = _fused_split(layer, h, par, config.head_dim)
    return _attention_and_mlp(layer, s, ops.rope(q, cos, sin), ops.rope(k, cos, sin), v,
                              config=config, ops=ops, attend=attend, par=par)


def block_no_rope(layer, carry, *, config, ops, attend, par, rope):
    s, d = carry
    h, s = ops.add_rms_norm(d, s, layer["attn_norm"], eps=config.norm_eps)
    q, k, v = _fused_split(layer, h, par, config.head_dim)
    return _attention_and_mlp(layer, s, q, k, v, config=config, ops=ops, attend=attend, par=par)


VARIANTS = {"separate": block_separate, "split": block_split, "rope_qkv": llama.model.block,
            "no_rope": block_no_rope}


def run_variant(block, config, seq, batch, steps):
    tcfg = train.TrainConfig(steps=1000, warmup_steps=10, dtype="bf16")
    ops = model_ops.get("ffi")
    saved = llama.forward
    llama.forward = dataclasses.replace(llama.model.DECODER, block=block).forward
    try:
        state = train.init_state(config, tcfg, jax.random.key(0), ops)
        step = train.make_train_step(config, tcfg, ops)
        tokens = jax.random.randint(jax.random.key(1), (1, batch, seq + 1), 0, config.vocab_size)
        x, y = tokens[..., :-1], tokens[..., 1:]
        compiled = step.lower(state, x, y).compile()
    finally:
        llama.forward = saved
    state, m, step_s = time_steps(compiled, state, x, y, steps)
    del state, compiled
    gc.collect()
    return step_s, float(m["loss"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.llama_rope",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-d12", help="a Llama preset (default llama-d12)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant (median)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of all variants")
    p.add_argument("--variants", default=",".join(VARIANTS))
    a = p.parse_args(argv)
    config = model.get_config(a.model)
    names = a.variants.split(",")
    times = {n: [] for n in names}
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; {a.model}, "
          f"B={a.batch}, T={a.seq}, bf16", flush=True)
    for _ in range(a.rounds):
        for n in names:
            step_s, loss = run_variant(VARIANTS[n], config, a.seq, a.batch, a.steps)
            times[n].append(step_s)
            print(json.dumps({"variant": n, "step_ms": step_s * 1e3, "loss": loss}), flush=True)
    base = min(times["rope_qkv"]) if "rope_qkv" in times else None
    print("| variant | step ms (best round) | tokens/s | vs rope_qkv |")
    print("|---|---|---|---|")
    for n in names:
        t = min(times[n])
        rel = f"{base / t:.3f}x" if base else ""
        print(f"| {n} | {t * 1e3:.2f} | {a.batch * a.seq / t / 1e3:.1f}K | {rel} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
