"""Per-device memory of a train step on a mesh: XLA's memory analysis of the compiled step
beside an analytic formula, without running anything.

    python -m benchmarks.memory --model llama-8b --seq 8192 --batch 1 --fsdp 8
                                [--dp N] [--tp N] [--cp N] [--zero] [--keep-gathered]
                                [--remat none|selective|full] [--dtype bf16] [--ops ffi]
                                [--runs fsdp8,fsdp4tp2,dp8:zero] [--platform cpu|gpu]
                                [--json PATH]
    python -m benchmarks.memory --report PATH      # the table of rows saved with --json

The step (train.make_train_step, one micro-batch) is lowered on abstract arrays placed as
train.init_state places them and compiled, never run; on the CPU (the default) the process
gets as many emulated devices as the largest mesh has (XLA_FLAGS
--xla_force_host_platform_device_count, set before JAX starts), so an 8B model's step on 8
devices compiles on a laptop (layers under lax.scan there, a few seconds of compile).
--platform gpu takes the real devices instead. device_gb is XLA's figure per device: arguments
+ outputs + temporaries - aliases (the donated state), in GB of 1e9 bytes. --batch counts the
sequences of one device along the batch axes ("data" x "fsdp"): the global batch is batch x
dp x fsdp; --runs (comma-separated, as benchmarks.parallel's: sizes dp/fsdp/tp/cp, options
after colons: zero, kg = keep-gathered) gives several meshes in one invocation and overrides
--dp/--fsdp/--tp/--cp/--zero/--keep-gathered.

The formula (all per device; `Layout.of` gives each leaf's split):
  params_gb  the float32 master weights: each leaf's local shape after its "tensor" and "fsdp"
             splits (Layout's tensor_axes, fsdp_axes; a family's whole axes stay whole).
  grads_gb   the float32 gradient, the same shapes: the step accumulates it whole per device
             before reducing (ZeRO-1 reduce-scatters it only afterwards).
  opt_gb     AdamW's m and v, float32, the params' local shapes, each also split over "data"
             along its ZeRO axis with --zero.
  act_gb     what the backward needs beyond the state, for N = batch x seq / cp tokens per
             device (the column-parallel products' outputs hold all N: heads, KV heads and the
             MLP split over "tensor"), and N / tp for the sequence-parallel residual stream;
             e = the compute dtype's bytes. Per layer the backward keeps (`saved_per_layer`):
               full       the block's input carry (s, d): 2 (N / tp) C e.
               selective  the carry; the outputs named MATMUL and ATTENTION: qkv N (H+2KV) D e,
                          attention's output N H D e and its float32 log-sum-exp N H 4, the
                          output projection (N / tp) C e, gate/up N 2F e, down (N / tp) C e.
               none       no checkpoint: what each op's backward reads (its residuals, from
                          the kernels' custom_vjp): both add_rms_norm sums 2 (N / tp) C e and
                          float32 rstd, the norms' outputs as the products read them (N C e
                          each, gathered over "tensor"), the roped q, k, v N (H+2KV) D e (rope's
                          backward needs only cos / sin, so not the qkv product), attention's
                          output and lse, gate/up N 2F e (SwiGLU's input), SwiGLU's output
                          N F e; and (fsdp > 1) the layer's weights gathered, in e bytes. Not
                          kept: the carry, and the two output projections (nothing reads them).
             --keep-gathered adds the gathered weights to selective / full as well.
             Those L times, plus the larger of two transients live beside them:
               the head  at the start of the backward: the logits N V e (their gradient
                         written in place by the cross-entropy kernel), the LM head gathered
                         in e bytes, its gradient in e bytes and in float32 before the
                         reduce-scatter (V: the padded vocabulary / tp).
               a layer   inside one layer's backward (selective / full): the layer's forward
                         recomputed (its "none" set), its weights gathered again, and their
                         gradient in e bytes and float32 before the reduce-scatter.
  formula_gb = params + grads + opt + act; ratio = formula_gb / device_gb. For Llama 8B at
  T 8192 the formula and XLA's CPU analysis agree within a few percent; tiny presets are
  dominated by the vocabulary and by small buffers the formula leaves out (loose agreement).
  Only Llama-style blocks (the llama and qwen2 families) have an activation formula; for
  other families act_gb is None.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

from benchmarks import meshes
from benchmarks.meshes import SIZES, Run

OPTIONS = ("zero", "kg")


def parse_run(text: str) -> Run:
    """'fsdp4tp2', 'dp8:zero', 'fsdp8:kg' (kg: keep the gathered weights) -> a Run."""
    return meshes.parse_run(text, OPTIONS, single=False)


def _nbytes(shape, itemsize) -> int:
    return math.prod(shape) * itemsize


def state_bytes(config, sizes: dict, zero: bool) -> dict:
    """params, grads, opt: per-device bytes of the float32 params, their gradient and AdamW's
    two moments, from the Layout's per-leaf splits."""
    import jax

    from blujax import model, train
    from blujax.sharding.layout import Layout, local_shape

    family = model.family_of(config)
    params = jax.eval_shape(lambda k: family.init(config, k), jax.random.key(0))
    layout = Layout.of(params, family.logical_axes(config), sizes, zero,
                       train.whole_axes(config, sizes))
    leaves = jax.tree.leaves(params)
    p = o = 0
    for x, t, f, z in zip(leaves, layout.tensor_axes, layout.fsdp_axes, layout.zero_axes):
        local = local_shape(x.shape, sizes, t, f)
        p += _nbytes(local, 4)
        if z is not None:
            local[z] //= sizes["data"]
        o += 2 * _nbytes(local, 4)
    return {"params": p, "grads": p, "opt": o}


def gathered_bytes(config, sizes: dict, itemsize: int) -> tuple[int, int]:
    """(one layer's weights, the LM head's weight) as a layer uses them: whole over "fsdp",
    split over "tensor", in the compute dtype."""
    import jax

    from blujax import model, train
    from blujax.sharding.layout import Layout, local_shape

    family = model.family_of(config)
    params = jax.eval_shape(lambda k: family.init(config, k), jax.random.key(0))
    no_fsdp = {**sizes, "fsdp": 1}
    layout = Layout.of(params, family.logical_axes(config), no_fsdp, False,
                       train.whole_axes(config, sizes))
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    layer = head = 0
    for (path, x), t in zip(flat, layout.tensor_axes):
        key = jax.tree_util.keystr(path)
        local = local_shape(x.shape, no_fsdp, t, None)
        if key.startswith("['blocks']"):
            layer += _nbytes(local[1:], itemsize)
        elif key in ("['lm_head']",) or (key == "['wte']" and "lm_head" not in params):
            head = _nbytes(local, itemsize)
    return layer, head


def activation_bytes(config, sizes: dict, batch: int, seq: int, remat: str, e: int,
                     keep_gathered: bool = False) -> dict | None:
    """The activation terms of the module's docstring, in bytes (None for a family without
    Llama's block)."""
    if not hasattr(config, "ffn_hidden"):
        return None
    tp, cp, fsdp = sizes["tensor"], sizes["context"], sizes["fsdp"]
    N = batch * seq // cp          # tokens of a column-parallel product's output
    Ns = N // tp                   # tokens of the sequence-parallel residual stream
    C, D, L = config.n_embd, config.head_dim, config.n_layer
    H = config.n_head // tp
    KV = config.n_kv_head // tp if config.n_kv_head % tp == 0 else config.n_kv_head
    F = config.ffn_hidden // tp
    V = config.padded_vocab_size // tp
    layer_w, head_w = gathered_bytes(config, sizes, e)

    carry = 2 * Ns * C * e
    matmuls = (N * (H + 2 * KV) * D * e  # qkv
               + N * H * D * e + N * H * 4  # attention's output and lse
               + Ns * C * e                 # output projection (reduce-scattered)
               + N * 2 * F * e              # gate / up
               + Ns * C * e)                # down
    # What one layer's backward reads (the ops' residuals): no checkpoint keeps exactly this.
    needed = (2 * Ns * C * e + 2 * Ns * 4          # the add_rms_norm sums and rstd
              + 2 * N * C * e                      # the norms' outputs (gathered over "tensor")
              + N * (H + 2 * KV) * D * e           # roped q, k, v
              + N * H * D * e + N * H * 4          # attention's output and lse
              + N * 2 * F * e                      # gate / up (SwiGLU's input)
              + N * F * e)                         # SwiGLU's output (the down product's input)
    gathered = layer_w if fsdp > 1 else 0
    kept = gathered if keep_gathered else 0
    saved = {"none": needed + gathered, "selective": carry + matmuls + kept,
             "full": carry + kept}[remat]
    grad_f32 = layer_w // e * 4
    head = N * V * e + head_w + head_w + head_w // e * 4
    # One layer's backward under remat: its forward recomputed, its weights gathered again
    # (or kept), their gradient in e bytes and float32.
    layer = 0 if remat == "none" else needed + 2 * layer_w + grad_f32
    return {"saved_per_layer": saved, "layers": L * saved, "head": head, "layer": layer,
            "act": L * saved + max(head, layer)}


def program_bytes(compiled) -> dict | None:
    try:
        m = compiled.memory_analysis()
    except Exception:  # not every backend reports it
        return None
    if m is None:
        return None
    return {"args": m.argument_size_in_bytes, "outputs": m.output_size_in_bytes,
            "temp": m.temp_size_in_bytes, "alias": m.alias_size_in_bytes,
            "device": (m.argument_size_in_bytes + m.output_size_in_bytes
                       + m.temp_size_in_bytes - m.alias_size_in_bytes)}


def compile_step(config, run: Run, batch: int, seq: int, remat: str, dtype: str, ops_name: str):
    """(the compiled train step on run's mesh, seconds to compile): nothing allocated or run."""
    import jax
    import jax.numpy as jnp

    from blujax import model, sharding, train
    from blujax.model import ops as model_ops
    from blujax.sharding.layout import state_shardings

    tcfg = train.TrainConfig(steps=1000, dtype=dtype, remat=remat)
    ops = model_ops.get(ops_name)
    mesh = sharding.make_mesh(run.dp, run.tp, run.cp, fsdp=run.fsdp,
                              devices=jax.devices()[:run.devices])
    family = model.family_of(config)
    state = jax.eval_shape(lambda k: train.init_state(config, tcfg, k, ops), jax.random.key(0))
    shardings = state_shardings(state, family.logical_axes(config), mesh, "zero" in run.options,
                                train.whole_axes(config, run.sizes))
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         state, shardings)
    tokens = jax.ShapeDtypeStruct((1, batch * run.dp * run.fsdp, seq), jnp.int32,
                                  sharding=train.batch_sharding(mesh))
    step = train.make_train_step(config, tcfg, ops, mesh, shard_optimizer="zero" in run.options,
                                 keep_gathered="kg" in run.options)
    t0 = time.perf_counter()
    compiled = step.lower(state, tokens, tokens).compile()
    return compiled, time.perf_counter() - t0


def run_one(run: Run, config, model_name, batch, seq, remat, dtype, ops_name="ffi") -> dict:
    import gc

    from blujax.train import DTYPES

    e = DTYPES[dtype](0).dtype.itemsize
    row = {"model": model_name, "seq": seq, "batch": batch, "run": run.name,
           "mesh": f"dp{run.dp} fsdp{run.fsdp} tp{run.tp} cp{run.cp}", "devices": run.devices,
           "zero": "zero" in run.options, "keep_gathered": "kg" in run.options, "remat": remat, "dtype": dtype}
    state = state_bytes(config, run.sizes, "zero" in run.options)
    act = activation_bytes(config, run.sizes, batch, seq, remat, e, "kg" in run.options)
    row.update({f"{k}_gb": v / 1e9 for k, v in state.items()})
    row["act_gb"] = act["act"] / 1e9 if act else None
    if act:
        row.update({f"act_{k}_gb": act[k] / 1e9 for k in ("saved_per_layer", "head", "layer")})
    formula = sum(state.values()) + (act["act"] if act else 0)
    row["formula_gb"] = formula / 1e9
    compiled, row["compile_s"] = compile_step(config, run, batch, seq, remat, dtype, ops_name)
    mem = program_bytes(compiled)
    if mem is not None:
        row.update({f"{k}_gb": v / 1e9 for k, v in mem.items()})
        row["ratio"] = formula / mem["device"] if act else None
    else:
        row.update(device_gb=None, ratio=None)
    del compiled
    gc.collect()
    return row


def table(rows) -> str:
    def gb(x):
        return "n/a" if x is None else f"{x:.2f}"

    lines = ["| model | T | B | mesh | remat | XLA GB | params | grads | opt | act | formula "
             "| formula / XLA | compile s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mesh = r.get("run", r.get("mesh", ""))
        if "error" in r:
            lines.append(f"| {r['model']} | {r['seq']} | {r['batch']} | {mesh} | {r['remat']} "
                         f"| failed: {r['error']} | | | | | | | |")
            continue
        ratio = "n/a" if r.get("ratio") is None else f"{r['ratio']:.3f}"
        lines.append(f"| {r['model']} | {r['seq']} | {r['batch']} | {mesh} | {r['remat']} | "
                     f"{gb(r['device_gb'])} | {gb(r['params_gb'])} | {gb(r['grads_gb'])} | "
                     f"{gb(r['opt_gb'])} | {gb(r['act_gb'])} | {gb(r['formula_gb'])} | {ratio} "
                     f"| {r['compile_s']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.memory", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--model", default="llama-8b",
                   help="a model preset: llama-8b, llama-1b, llama-tiny, ... (default llama-8b)")
    p.add_argument("--seq", type=int, default=8192, help="tokens per sequence (default 8192)")
    p.add_argument("--batch", type=int, default=1,
                   help="sequences per device along the batch axes (global: batch x dp x "
                        "fsdp; default 1)")
    p.add_argument("--dp", type=int, default=1, help='"data" (replicas) size (default 1)')
    p.add_argument("--fsdp", type=int, default=1,
                   help='"fsdp" size: params, grads and AdamW state split (default 1)')
    p.add_argument("--tp", type=int, default=1, help='"tensor" size (default 1)')
    p.add_argument("--cp", type=int, default=1, help='"context" size (default 1)')
    p.add_argument("--zero", action="store_true",
                   help='ZeRO-1: AdamW state split over "data" too')
    p.add_argument("--keep-gathered", action="store_true",
                   help="keep every layer's gathered weights for the backward (no re-gather)")
    p.add_argument("--remat", default="selective", choices=("none", "selective", "full"),
                   help="what the backward recomputes (default selective)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "f32"),
                   help="compute dtype (default bf16)")
    p.add_argument("--ops", default="ffi", choices=("ffi", "xla"),
                   help="kernels: ffi (ours, CPU twins on the CPU) or xla (default ffi)")
    p.add_argument("--runs", help="comma-separated meshes, e.g. fsdp8,fsdp4tp2,dp8:zero "
                                  "(options zero, kg); overrides the single-mesh flags")
    p.add_argument("--platform", default="cpu", choices=("cpu", "gpu"),
                   help="cpu: emulated devices (default); gpu: the real devices")
    p.add_argument("--json", metavar="PATH", help="also append the rows as JSON lines")
    p.add_argument("--report", metavar="PATH", help="print the table of a --json file, run nothing")
    a = p.parse_args(argv)
    if a.report:
        print(table([json.loads(line) for line in Path(a.report).read_text().splitlines()
                     if line.strip()]))
        return 0
    if a.runs:
        runs = [parse_run(r) for r in a.runs.split(",")]
    else:
        name = "".join(f"{k}{getattr(a, k)}" for k in SIZES if getattr(a, k) > 1) or "dp1"
        opts = ":zero" * a.zero + ":kg" * a.keep_gathered
        runs = [parse_run(name + opts)]
    n = max(r.devices for r in runs)
    if "jax" not in sys.modules:  # JAX reads these once, when it starts
        if a.platform == "cpu":
            os.environ["JAX_PLATFORMS"] = "cpu"
            flag = f"--xla_force_host_platform_device_count={n}"
            os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    import jax

    from blujax import model

    if n > len(jax.devices()):
        print(f"the runs need {n} devices, there are {len(jax.devices())} (JAX was started "
              f"before this module could ask for more)", file=sys.stderr)
        return 2
    config = model.get_config(a.model)
    if a.seq > config.block_size:
        config = dataclasses.replace(config, block_size=a.seq)
    print(f"{len(jax.devices())} x {jax.devices()[0].device_kind}, jax {jax.__version__}; "
          f"{a.model}, T={a.seq}, batch {a.batch} per device, {a.dtype}, remat {a.remat}",
          flush=True)
    rows = []
    for run in runs:
        try:
            row = run_one(run, config, a.model, a.batch, a.seq, a.remat, a.dtype, a.ops)
        except Exception as e:  # a mesh the model does not split over, say: record it, go on
            row = {"model": a.model, "seq": a.seq, "batch": a.batch, "run": run.name,
                   "remat": a.remat, "error": str(e).splitlines()[0][:160]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
