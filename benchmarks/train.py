"""Train-step throughput of any model preset (GPT-2, Llama): our kernels (ops=ffi) vs the
plain-JAX model (ops=xla, with cuDNN attention on a GPU), side by side in one run.

    python -m benchmarks.train [--model gpt2] [--seq 1024] [--batch 16,32,64] [--ops ffi,xla]
                               [--dtype bf16,f32] [--fp8 off,on] [--steps 10] [--profile DIR]

For each (dtype, batch, ops): the jitted step (donated state, one micro-batch) is compiled,
run twice to warm up, then timed step by step (each waited for) for --steps steps; the median
step time gives tokens/s and MFU. FLOPs per token are the family's `flops_per_token` (6 per
weight of every matrix product, the LM head at the padded vocabulary, attention's products in
full), against `train.PEAK_FLOPS` for the device (and, in --json rows, the 989 TFLOP/s
datasheet peak of an H100 that peers quote). Peak memory is
the step program's own (XLA's memory analysis: arguments + outputs + temporaries - donated
aliases), which is what the state and one step need. --profile DIR also writes a profiler
trace of 3 steps of the first configuration, prints where the device time goes and writes
the step's optimized HLO beside the trace (DIR/step.hlo.txt, to look up XLA's fusions by name).
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import time
from pathlib import Path

import jax

from benchmarks import fp8 as fp8_bench
from blujax import fp8 as fp8_lib, model, train
from blujax.model import ops as model_ops
from blujax.model.stack import REMAT


def program_bytes(compiled) -> int | None:
    try:
        m = compiled.memory_analysis()
        return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                - m.alias_size_in_bytes)
    except Exception:  # not every backend reports it
        return None


def run_one(config, seq, batch, ops_name, dtype, steps, remat="none", profile_dir=None,
            scan_layers=None, fp8="off"):
    mode, *opts = fp8.split(":")
    scaling = next((o for o in opts if o in fp8_lib.SCALINGS), fp8_lib.DEFAULT_SCALING)
    if set(opts) - {scaling, "unfused"}:
        raise SystemExit(f"benchmarks.train: unknown --fp8 option in {fp8!r}")
    tcfg = train.TrainConfig(steps=1000, warmup_steps=10, dtype=dtype, remat=remat,
                             scan_layers=scan_layers, fp8=mode, fp8_scaling=scaling,
                             fp8_fuse="unfused" not in opts)
    ops = model_ops.get(ops_name)
    state = train.init_state(config, tcfg, jax.random.key(0), ops)
    step = train.make_train_step(config, tcfg, ops)
    tokens = jax.random.randint(jax.random.key(1), (1, batch, seq + 1), 0, config.vocab_size)
    x, y = tokens[..., :-1], tokens[..., 1:]
    if state.fp8 is not None:  # delayed scaling's first step is its own program: take it
        state, _ = step(state, x, y)
    t0 = time.perf_counter()
    compiled = step.lower(state, x, y).compile()
    compile_s = time.perf_counter() - t0
    mem = program_bytes(compiled)
    hlo = compiled.as_text() or ""
    state, m, step_s = time_steps(compiled, state, x, y, steps)
    if profile_dir:
        _profile(compiled, state, x, y, profile_dir)
    tok_s = batch * seq / step_s
    peak = train.peak_flops(jax.devices()[0], dtype)
    flops = model.family_of(config).flops_per_token(config, seq) * tok_s
    row = {"ops": ops_name, "dtype": dtype, "fp8": fp8, "batch": batch, "seq": seq,
           "remat": remat, "scan_layers": scan_layers,
           "step_ms": step_s * 1e3, "tokens_per_s": tok_s, "tflops": flops / 1e12,
           "mfu": flops / peak if peak else None, "mfu_989": flops / 989e12,
           "program_gb": mem / 1e9 if mem is not None else None,
           "compile_s": compile_s, "loss": float(m["loss"]),
           # FP8 products as XLA runs them: cuBLASLt FP8 calls (Triton FP8 GEMMs aside).
           "cublas_f8_calls": sum(fp8_bench.f8_calls(hlo).values())}
    del state, compiled, step
    gc.collect()
    return row


def time_steps(compiled, state, x, y, steps):
    """Two warm-up steps, then `steps` steps each waited for: (state, last metrics, median
    seconds per step)."""
    for _ in range(2):
        state, m = compiled(state, x, y)
    jax.block_until_ready(m)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = compiled(state, x, y)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t0)
    return state, m, statistics.median(times)


PROFILE_STEPS = 3


def trace_steps(compiled, state, x, y, out_dir) -> Path | None:
    """A profiler trace of PROFILE_STEPS steps in out_dir, each waited for as time_steps waits
    (so the device's idle time between steps is in it); the Perfetto JSON trace's path."""
    out_dir = Path(out_dir)
    jax.profiler.start_trace(str(out_dir), create_perfetto_trace=True)
    for _ in range(PROFILE_STEPS):
        state, m = compiled(state, x, y)
        jax.block_until_ready(m["loss"])
    jax.profiler.stop_trace()
    traces = sorted(out_dir.rglob("*.trace.json.gz"))
    return traces[-1] if traces else None


def _profile(compiled, state, x, y, out_dir):
    trace = trace_steps(compiled, state, x, y, out_dir)
    (Path(out_dir) / "step.hlo.txt").write_text(compiled.as_text())
    if trace:
        print(kernel_time_summary(trace, steps=PROFILE_STEPS, top=40))


def kernel_time_summary(path, steps: int, top: int = 25) -> str:
    """Device time per kernel name over the traced steps, from a Perfetto JSON trace."""
    import gzip
    events = json.load(gzip.open(path)).get("traceEvents", [])
    threads = {(e.get("pid"), e.get("tid")): e.get("args", {}).get("name", "")
               for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    pids = {e.get("pid"): e.get("args", {}).get("name", "")
            for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    total: dict[str, float] = {}
    spans = []  # (start, end, name) of every kernel, microseconds
    for e in events:
        if e.get("ph") != "X":
            continue
        proc = pids.get(e.get("pid"), "")
        if "/device:GPU" not in proc or "Stream" not in threads.get((e["pid"], e["tid"]), ""):
            continue
        total[e["name"]] = total.get(e["name"], 0.0) + e.get("dur", 0.0)
        spans.append((e["ts"], e["ts"] + e.get("dur", 0.0), e["name"]))
    busy = sum(total.values())
    lines = [f"device time per step: {busy / steps / 1e3:.2f} ms (kernels, summed over streams)",
             idle_summary(spans, steps), category_table(total, steps),
             "| kernel | ms / step | share |", "|---|---|---|"]
    for name, us in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"| {name[:90]} | {us / steps / 1e3:.3f} | {us / max(busy, 1e-9):.1%} |")
    return "\n".join(lines)


# Where a step's device time goes, by kernel name (first match): the matrix products (cuBLAS's
# kernels), our attention, our other kernels, and what XLA generates around them (the FP8
# casts and amaxes are its convert and reduce fusions).
CATEGORIES = (
    ("matrix products (cuBLAS)", r"gemm|nvjet|xmma|cutlass|cublas"),
    ("attention (ours)", r"Attention|DqFromSums"),
    ("our other kernels", r"Kernel|ReducePartials"),
    ("XLA reduce fusions", r"reduce"),
    ("XLA convert fusions", r"convert"),
    ("XLA other fusions", r"fusion|loop_|input_"),
    ("copies and the rest", r""),
)


def category_table(total: dict, steps: int) -> str:
    """total ({kernel name: us}) summed by CATEGORIES, per step."""
    sums = {name: 0.0 for name, _ in CATEGORIES}
    for kernel, us in total.items():
        name = next(n for n, rx in CATEGORIES if re.search(rx, kernel))
        sums[name] += us
    busy = max(sum(sums.values()), 1e-9)
    rows = [f"| {n} | {us / steps / 1e3:.2f} | {us / busy:.1%} |" for n, us in sums.items()]
    return "\n".join(["| where | ms / step | share |", "|---|---|---|", *rows])


def idle_summary(spans, steps: int, top: int = 4, min_us: float = 20.0) -> str:
    """How long the device ran no kernel between the traced steps' first and last kernel, per
    step, and the longest such gaps (at least min_us) with the kernels on either side: where a
    step waits on the host (a conditional's predicate read, a launch that comes late)."""
    spans = sorted(spans)
    gaps, end, last = [], None, None
    for start, stop, name in spans:
        if end is not None and start > end:
            gaps.append((start - end, last, name))
        if end is None or stop > end:
            end, last = stop, name
    idle = sum(g for g, _, _ in gaps)
    big = sorted((g for g in gaps if g[0] >= min_us), reverse=True)[:top]
    text = f"device idle per step: {idle / steps / 1e3:.2f} ms (between kernels)"
    if big:
        text += "; longest gaps: " + "; ".join(
            f"{g / 1e3:.2f} ms after {a[:40]} before {b[:40]}" for g, a, b in big)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.train", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2",
                   help="a model preset, of any family: gpt2, llama-d12, ... (default gpt2)")
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence (default 1024)")
    p.add_argument("--batch", default="16,32,64", help="batch sizes, comma-separated")
    p.add_argument("--ops", default="ffi,xla", help="ops namespaces to compare: ffi, xla")
    p.add_argument("--dtype", default="bf16,f32", help="compute dtypes: bf16, f32")
    p.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    p.add_argument("--remat", default="none", choices=REMAT,
                   help="what the backward recomputes: none, selective (norms and "
                        "activations) or full (each block) (default none)")
    p.add_argument("--scan-layers", default="auto", choices=("auto", "on", "off"),
                   help="run the blocks under lax.scan (on), as a Python loop (off), or as "
                        "gpt2.forward picks: a loop on GPUs (auto, the default)")
    p.add_argument("--fp8", default="off",
                   help="FP8 block products, comma-separated: off, on (where they pay), all, "
                        "each with an optional :dynamic or :delayed scaling (default: "
                        f"{fp8_lib.DEFAULT_SCALING}) and :unfused (the gated MLP product by "
                        "product, not as one FP8 piece) (default off)")
    p.add_argument("--profile", metavar="DIR", help="trace 3 steps of the first configuration")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON lines")
    a = p.parse_args(argv)
    config = model.get_config(a.model)
    rows = []
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}; {a.model}, "
          f"T={a.seq}, {model.family_of(config).flops_per_token(config, a.seq) / 1e6:.1f}M "
          f"FLOP/token", flush=True)
    scan_layers = {"auto": None, "on": True, "off": False}[a.scan_layers]
    first = True
    for dtype in a.dtype.split(","):
        for batch in (int(b) for b in a.batch.split(",")):
            for ops_name in a.ops.split(","):
                for fp8 in a.fp8.split(","):
                    try:
                        row = run_one(config, a.seq, batch, ops_name, dtype, a.steps, a.remat,
                                      a.profile if first else None, scan_layers, fp8)
                    except Exception as e:  # out of memory, say: record it, go on
                        msg = str(e).splitlines()[0][:160]
                        row = {"ops": ops_name, "dtype": dtype, "fp8": fp8, "batch": batch,
                               "seq": a.seq, "error": msg}
                    first = False
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    if a.json:
        Path(a.json).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(table(rows))
    return 0


def table(rows) -> str:
    """Markdown rows; ffi / xla compares the same dtype, batch and fp8, and fp8 / off the same
    dtype, batch and ops without FP8."""
    ok = {(r["dtype"], r["batch"], r["ops"], r.get("fp8", "off")): r
          for r in rows if "error" not in r}
    lines = ["| dtype | fp8 | batch | ops | tokens/s | ffi / xla | fp8 / off | step ms | "
             "TFLOP/s | MFU | program GB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fp8 = r.get("fp8", "off")
        if "error" in r:
            lines.append(f"| {r['dtype']} | {fp8} | {r['batch']} | {r['ops']} | failed: "
                         f"{r['error']} | | | | | | |")
            continue
        xla = ok.get((r["dtype"], r["batch"], "xla", fp8))
        ratio = (f"{r['tokens_per_s'] / xla['tokens_per_s']:.2f}x"
                 if xla and r["ops"] == "ffi" else "")
        off = ok.get((r["dtype"], r["batch"], r["ops"], "off"))
        gain = f"{r['tokens_per_s'] / off['tokens_per_s']:.3f}x" if off and fp8 != "off" else ""
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        gb = f"{r['program_gb']:.1f}" if r["program_gb"] is not None else "n/a"
        lines.append(f"| {r['dtype']} | {fp8} | {r['batch']} | {r['ops']} | "
                     f"{r['tokens_per_s'] / 1e3:.1f}K | {ratio} | {gain} | {r['step_ms']:.1f} | "
                     f"{r['tflops']:.0f} | {mfu} | {gb} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
