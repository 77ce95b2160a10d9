"""Train steps of any model preset (GPT-2, Llama) on several GPUs (blujax.sharding) against the one-GPU step, in one run.

    python -m benchmarks.parallel [--model gpt2] [--seq 1024] [--batch 16] [--dtype bf16]
                                  [--runs 1,dp2,tp2,cp2,dp2:zero,tp2:cm,dp2:rb] [--steps 10]
                                  [--remat none|selective|full] [--xla-flags FLAGS]
                                  [--label NAME] [--json PATH] [--profile DIR]
    python -m benchmarks.parallel --report PATH     # the table of rows saved with --json

Fully sharded data parallelism on one 8-GPU host (one command each; a run of a model that
does not fit one GPU has no "1" run to compare with, so its efficiency is left out):
    python -m benchmarks.parallel --model llama-1b --seq 2048 --batch 8 \
        --runs 1,fsdp8,fsdp4tp2,dp8:zero --profile fsdp-1b
    python -m benchmarks.parallel --model llama-8b --seq 8192 --batch 1 --remat selective \
        --runs fsdp8,fsdp4tp2 --profile fsdp-8b

A run is the mesh's sizes (dp2, fsdp8, tp2, cp2, fsdp4tp2, ...; "1" is the single-device
step, train.make_train_step) and options after colons:
    zero   the optimizer state sharded over "data" (ZeRO-1)
    cm     collective matmul: the tensor-parallel all-gathers / reduce-scatters as ppermute
           rings overlapping slices of their matrix products
    rb     each layer's gradient reduced inside the backward (overlapping it), not after it
    kg     (fsdp) keep each layer's gathered weights for the backward instead of gathering
           them again (with --remat selective or full; "none" keeps them anyway)
    plain  (with "1" only) the model on plain XLA ops with XLA's own attention, which
           materialises the [B, H, T, T] scores: the way that does not fit at long T
--batch is the batch of one data-parallel rank: a run with dp x fsdp data ranks trains
dp x fsdp x batch sequences per step; tensor and context ranks share theirs. Each run is compiled, warmed up
twice and timed step by step (--steps, median). Reported: tokens/s over the whole mesh, per
GPU, and the scaling efficiency = tokens/s / (GPUs x the "1" run's tokens/s at the same
per-rank batch); the step program's memory per GPU (XLA's memory analysis: arguments + outputs
+ temporaries - donated aliases, what one step needs on each device). A run whose program
needs more than a GPU has is reported, not run. --xla-flags adds XLA flags for this process
(XLA reads them once per process, so comparing flags takes two invocations), say
--xla_gpu_enable_latency_hiding_scheduler=false; --label tags the rows (default: those flags).

--profile DIR traces 3 steps of every run into DIR/<run> and prints, for the first GPU, how
much of a step its compute kernels and its communication (NCCL) kernels take, and how much
of the communication ran while compute kernels ran too (hidden).

T longer than the model's block_size is run with block_size = T (GPT-2's position table or
Llama's rotary tables get T rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import gzip
import json
import os
import re
import sys
import time
import types
from pathlib import Path

import jax

from benchmarks import meshes
from benchmarks.meshes import Run
from benchmarks.train import (PROFILE_STEPS, kernel_time_summary, program_bytes, time_steps,
                              trace_steps)
from blujax import model, sharding, train
from blujax.model import ops as model_ops
from blujax.model.stack import REMAT

OPTIONS = ("zero", "cm", "rb", "plain", "kg")


def parse_run(text: str) -> Run:
    run = meshes.parse_run(text, OPTIONS)
    if run.single and run.options - {"plain"}:
        raise ValueError(f"run {text!r}: the single-device step takes only 'plain'")
    if not run.single and "plain" in run.options:
        raise ValueError(f"run {text!r}: 'plain' is for the single-device step ('1:plain')")
    return run


def _plain_ops():
    """The XLA ops with XLA's own attention (scores in memory), whatever the dtype."""
    def attention(q, k, v, *, causal=True, scale=None):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                            implementation="xla")
    def attention_qkv(qkv, *, causal=True, scale=None):
        return attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=causal, scale=scale)
    return types.SimpleNamespace(**{**vars(model_ops.XLA), "attention": attention,
                                    "attention_qkv": attention_qkv})


def run_one(run: Run, config, seq, batch, dtype, steps, ops_name="ffi", profile_dir=None,
            remat="none"):
    tcfg = train.TrainConfig(steps=1000, warmup_steps=10, dtype=dtype, remat=remat)
    ops = _plain_ops() if "plain" in run.options else model_ops.get(ops_name)
    key = jax.random.key(0)
    global_batch = batch * run.ranks
    tokens = jax.random.randint(jax.random.key(1), (1, global_batch, seq + 1), 0,
                                config.vocab_size)
    x, y = tokens[..., :-1], tokens[..., 1:]
    if run.single:
        state = train.init_state(config, tcfg, key, ops)
        step = train.make_train_step(config, tcfg, ops)
    else:
        mesh = sharding.make_mesh(run.dp, run.tp, run.cp, devices=jax.devices()[:run.devices],
                                  fsdp=run.fsdp)
        zero = "zero" in run.options
        state = train.init_state(config, tcfg, key, ops, mesh, shard_optimizer=zero)
        step = train.make_train_step(
            config, tcfg, ops, mesh, shard_optimizer=zero,
            collective_matmul="cm" in run.options, reduce_in_backward="rb" in run.options,
            keep_gathered="kg" in run.options)
        x, y = (jax.device_put(a, train.batch_sharding(mesh)) for a in (x, y))
    t0 = time.perf_counter()
    compiled = step.lower(state, x, y).compile()
    compile_s = time.perf_counter() - t0
    mem = program_bytes(compiled)
    row = {"run": run.name, "gpus": run.devices, "dtype": dtype, "batch": global_batch,
           "seq": seq, "program_gb": mem / 1e9 if mem is not None else None,
           "compile_s": compile_s}
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    if mem is not None and limit and mem > limit:
        row["error"] = (f"needs {mem / 1e9:.1f} GB per GPU, more than the {limit / 1e9:.1f} GB "
                        f"it has")
        return row
    state, m, step_s = time_steps(compiled, state, x, y, steps)
    row.update(step_ms=step_s * 1e3, tokens_per_s=global_batch * seq / step_s,
               loss=float(m["loss"]))
    if profile_dir:
        out = Path(profile_dir) / re.sub(r"[^A-Za-z0-9_.-]", "_", run.name)
        trace = trace_steps(compiled, state, x, y, out)
        if trace:
            row.update(overlap_summary(trace, steps=PROFILE_STEPS))
            summary = kernel_time_summary(trace, steps=PROFILE_STEPS * run.devices, top=15)
            print(f"{run.name}: {summary.replace('per step', 'per step and GPU')}", flush=True)
    del state, compiled, step
    gc.collect()
    return row


def overlap_summary(path, steps: int) -> dict:
    """Milliseconds per step on the first GPU of a Perfetto trace: compute kernels busy,
    communication (NCCL) kernels busy, and the part of the latter spent beside compute."""
    events = json.load(gzip.open(path)).get("traceEvents", [])
    pids = {e.get("pid"): e.get("args", {}).get("name", "")
            for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = min((pid for pid, name in pids.items() if "/device:GPU:" in name),
              key=lambda pid: pids[pid], default=None)
    comm, compute = [], []
    for e in events:
        if e.get("ph") == "X" and e.get("pid") == gpu and e.get("dur"):
            span = (e["ts"], e["ts"] + e["dur"])
            (comm if e["name"].lower().startswith("nccl") else compute).append(span)
    comm, compute = _union(comm), _union(compute)
    ms = 1e-3 / steps
    return {"compute_ms": _length(compute) * ms, "comm_ms": _length(comm) * ms,
            "comm_hidden_ms": _length(_intersect(comm, compute)) * ms}


def _union(spans):
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _intersect(xs, ys):
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append([a, b])
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(spans):
    return sum(b - a for a, b in spans)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.parallel", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--model", default="gpt2",
                   help="a model preset, of any family: gpt2, llama-1b, ... (default gpt2)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--batch", type=int, default=16,
                   help="sequences per data-parallel rank and step (default 16)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "f32"),
                   help="compute dtype (default bf16)")
    p.add_argument("--ops", default="ffi", choices=model_ops.NAMES,
                   help="kernels of the runs without 'plain' (default ffi, ours)")
    p.add_argument("--runs", default="1,dp2,tp2,cp2",
                   help="comma-separated runs (see above; default 1,dp2,tp2,cp2)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (default 10)")
    p.add_argument("--remat", default="none", choices=REMAT,
                   help="what the backward recomputes (blujax.model.stack; default none)")
    p.add_argument("--xla-flags", default="", help="XLA flags added for this process's runs")
    p.add_argument("--label", help="a tag written into every row (default: --xla-flags)")
    p.add_argument("--json", metavar="PATH", help="also append the rows as JSON lines")
    p.add_argument("--profile", metavar="DIR",
                   help="trace 3 steps of each run; report compute / communication overlap")
    p.add_argument("--report", metavar="PATH", help="print the table of a --json file, run nothing")
    a = p.parse_args(argv)
    if a.report:
        print(table([json.loads(line) for line in Path(a.report).read_text().splitlines()
                     if line.strip()]))
        return 0
    if a.xla_flags:  # before JAX starts its backends, which read them
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {a.xla_flags}".strip()
    label = a.xla_flags if a.label is None else a.label
    runs = [parse_run(r) for r in a.runs.split(",")]
    config = model.get_config(a.model)
    if a.seq > config.block_size:
        config = dataclasses.replace(config, block_size=a.seq)
    n = max(r.gpus for r in runs)
    if n > len(jax.devices()):
        print(f"the runs need {n} devices, there are {len(jax.devices())}", file=sys.stderr)
        return 2
    print(f"{len(jax.devices())} x {jax.devices()[0].device_kind}, jax {jax.__version__}; "
          f"{a.model}, T={a.seq}, {a.dtype}, {a.ops} ops, batch {a.batch} per data rank"
          + (f"; {label}" if label else ""), flush=True)
    rows = []
    for run in runs:
        try:
            row = run_one(run, config, a.seq, a.batch, a.dtype, a.steps, a.ops, a.profile,
                          a.remat)
        except Exception as e:  # out of memory, say: record it, go on
            row = {"run": run.name, "gpus": run.devices, "dtype": a.dtype, "seq": a.seq,
                   "batch": a.batch * run.ranks, "error": str(e).splitlines()[0][:160]}
        row["label"] = label
        row["model"] = a.model
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
    print(table(rows))
    return 0


def table(rows) -> str:
    def key(r, batch):
        return r.get("model", "gpt2"), r["seq"], batch

    one = {key(r, r["batch"]): r for r in rows if r["run"] == "1" and "tokens_per_s" in r}
    traced = any("comm_ms" in r for r in rows)
    lines = ["| run | GPUs | batch x T | tokens/s | per GPU | efficiency | step ms | GB per GPU "
             "| label |" + (" compute ms | comm ms | comm hidden |" if traced else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if traced else "")]
    for r in rows:
        gb = f"{r['program_gb']:.1f}" if r.get("program_gb") is not None else "n/a"
        shape = f"{r['batch']} x {r['seq']}"
        if "error" in r:
            lines.append(f"| {r['run']} | {r['gpus']} | {shape} | failed: {r['error']} | | | "
                         f"| {gb} | {r['label']} |")
            continue
        base = one.get(key(r, r["batch"] // parse_run(r["run"]).ranks))
        eff = ""
        if base is not None and not r["run"].startswith("1"):
            eff = f"{r['tokens_per_s'] / (r['gpus'] * base['tokens_per_s']):.1%}"
        comm = ""
        if "comm_ms" in r:
            hidden = r["comm_hidden_ms"] / r["comm_ms"] if r["comm_ms"] else 0.0
            comm = f" {r['compute_ms']:.1f} | {r['comm_ms']:.1f} | {hidden:.0%} |"
        elif traced:
            comm = " | | |"
        lines.append(f"| {r['run']} | {r['gpus']} | {shape} | {r['tokens_per_s'] / 1e3:.1f}K | "
                     f"{r['tokens_per_s'] / r['gpus'] / 1e3:.1f}K | {eff} | {r['step_ms']:.1f} "
                     f"| {gb} | {r['label']} |{comm}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
