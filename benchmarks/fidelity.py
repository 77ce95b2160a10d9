"""Training fidelity: blujax (our kernels, and plain JAX) against PyTorch on the same weights,
the same batches and the same learning rates; the loss gap per window of steps.

    python -m benchmarks.fidelity [--model gpt2] [--batch 16] [--seq 1024] [--steps 400]
                                  [--seeds 0,1,2] [--dtype bf16] [--data PATH] [--json PATH]
    python -m benchmarks.fidelity --quick        # a tiny model for a few steps: a smoke test
    python -m benchmarks.fidelity --report A.json [B.json ...]   # the tables of saved runs

For each seed: the initial weights are gpt2.init(config, key(seed)), exported to Hugging Face's
layout (blujax.interop.export_hf) for the PyTorch side; the batches are drawn once with
blujax's DataLoader (shuffled by the seed) and every variant trains on the same ones in the
same order; every variant gets the learning rate of train.schedule at each step. The variants,
run one after another in this process:

    ours-ffi     train.make_train_step on our kernels (ops "ffi"), fused AdamW kernel
    ours-xla     the same step on plain JAX (ops "xla": jnp ops, cuDNN attention, optax.adamw)
    ours-fp8     ours-ffi with every block product in FP8 (TrainConfig fp8 "all", dynamic
                 scaling); ours-fp8-delayed: the same with delayed scaling
    ours-noise   ours-ffi from the weights times (1 + 1e-3 N(0, 1)) (seeded): our own noise
                 floor, which the FP8 gaps to ours-ffi are read against
    torch        transformers.GPT2LMHeadModel from the exported weights, eager, bf16 autocast
                 around the forward, cross-entropy in float32 on the logits, global-norm
                 clipping (clip_grad_norm_), torch.optim.AdamW(fused=True) with TrainConfig's
                 b1, b2, eps and weight decay on the same parameters as gpt2.decay_mask
                 (embeddings and matrices; not biases or LayerNorm)
    torch-noise  the same PyTorch run from the weights times (1 + 1e-3 N(0, 1)) (seeded): how
                 far two runs that should agree drift apart anyway, the noise floor

--dtype f32 trains in float32 on both sides with TF32 matrix products (JAX's default matmul
precision on a GPU; torch.set_float32_matmul_precision("high")).

Reported: each run's mean training loss over each window of steps (a, b] (--windows gives the
edges; step k is the loss of the k-th batch, before the k-th update), then for each variant its
gap to the PyTorch run of the same seed, per window, as the mean over seeds +- their standard
deviation, and tokens/s (informational: the PyTorch side is eager, not compiled). With FP8
variants, their gap to ours-ffi of the same seed beside ours-noise's (whether it is within twice
that floor) and the largest one-step loss excess over ours-ffi (spikes). --json writes
every run's per-step loss, gradient norm and the learning rates too (rewritten after each run,
so an interrupted benchmark keeps what finished); --report prints the tables of such files
together (say, one seed per invocation).

PyTorch and transformers are needed only for the torch variants and are not blujax
dependencies. JAX and PyTorch share the GPU here: JAX allocates on demand
(XLA_PYTHON_CLIENT_PREALLOCATE=false unless set), so PyTorch finds memory free.
"""

from __future__ import annotations

import os

# Before JAX starts its GPU client: allocate as needed, so that PyTorch, in this process
# after it, finds the memory JAX does not use.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from blujax import data, train  # noqa: E402
from blujax.model import family_of, get_config, gpt2  # noqa: E402
from blujax.model import ops as model_ops  # noqa: E402

VARIANTS = ("ours-ffi", "ours-xla", "ours-fp8", "ours-fp8-delayed", "ours-noise", "torch",
            "torch-noise")
# Our variants' train settings beyond the benchmark's own: ops, TrainConfig fields, noise.
OURS = {"ours-ffi": ("ffi", {}, False), "ours-xla": ("xla", {}, False),
        "ours-fp8": ("ffi", {"fp8": "all", "fp8_scaling": "dynamic"}, False),
        "ours-fp8-delayed": ("ffi", {"fp8": "all", "fp8_scaling": "delayed"}, False),
        "ours-noise": ("ffi", {}, True)}
DEFAULT_VARIANTS = ("ours-ffi", "ours-xla", "torch", "torch-noise")
NOISE = 1e-3  # the noise floor's relative weight perturbation
# A quick run: a tiny model on the CPU in about a minute.
QUICK = dict(model="tiny", batch=4, seq=64, steps=24, seeds="0")
DEFAULTS = dict(model="gpt2", batch=16, seq=1024, steps=400, seeds="0,1,2")


# --------------------------------------------------------------------------------------------
# What every variant shares: batches, learning rates, initial weights


def draw_batches(shards, batch: int, seq: int, steps: int, seed: int):
    """int32 [steps, B, T] inputs and targets: the first `steps` batches of blujax's loader
    over `shards`, shuffled by `seed`, as a training run with that seed reads them."""
    inputs = np.empty((steps, batch, seq), np.int32)
    targets = np.empty_like(inputs)
    with data.DataLoader(shards, None, batch_size=batch, seq_len=seq, seed=seed,
                         process_index=0, process_count=1) as loader:
        for i in range(steps):
            b = next(loader)
            inputs[i], targets[i] = b.inputs, b.targets
    return inputs, targets


def learning_rates(tcfg: train.TrainConfig) -> list[float]:
    """The learning rate of each step, as our step applies it (train.schedule of the step
    count before the step: 0 at the first)."""
    return [float(x) for x in np.asarray(train.schedule(tcfg)(np.arange(tcfg.steps)))]


def resolve_shards(spec: str | None):
    """The training shards --data names, resolved as `python examples/gpt2.py train --data`
    resolves them (no --data: the tinyshakespeare corpus, offline from $BLUJAX_CORPUS)."""
    return data.resolve(spec, progress=True)


# --------------------------------------------------------------------------------------------
# blujax


class Ours:
    """Runs of train.make_train_step on one ops namespace (and TrainConfig); the step is
    compiled once and reused for every seed (the seed changes only the values). noise: start
    from the seed's weights times (1 + NOISE N(0, 1)), as torch-noise does."""

    def __init__(self, config, tcfg, ops_name, noise=False):
        self.config, self.tcfg, self.ops = config, tcfg, model_ops.get(ops_name)
        self.step = train.make_train_step(config, tcfg, self.ops)
        self.noise = noise

    def run(self, seed, inputs, targets) -> dict:
        params = family_of(self.config).init(self.config, jax.random.key(seed))
        if self.noise:
            leaves, tree = jax.tree.flatten(params)
            keys = jax.random.split(jax.random.key(10_000 + seed), len(leaves))
            params = tree.unflatten([x * (1 + NOISE * jax.random.normal(k, x.shape))
                                     for x, k in zip(leaves, keys)])
        state = train.state_from_params(self.config, params, self.tcfg, self.ops)
        xs, ys = jax.device_put(inputs[:, None]), jax.device_put(targets[:, None])
        steps = len(inputs)
        t_start = timed_from(steps)
        metrics, t0 = [], None
        for i in range(steps):
            if i == t_start:
                jax.block_until_ready(metrics[-1:])
                t0 = time.perf_counter()
            state, m = self.step(state, xs[i], ys[i])
            metrics.append(m)
        metrics = jax.device_get(metrics)
        seconds = time.perf_counter() - t0
        del state, xs, ys
        gc.collect()
        return {"loss": [float(m["loss"]) for m in metrics],
                "grad_norm": [float(m["grad_norm"]) for m in metrics],
                "skipped": int(sum(m["skipped"] for m in metrics)),
                "tokens_per_s": (steps - t_start) * inputs[0].size / seconds}


def timed_from(steps: int) -> int:
    """The step from which a run is timed: past the first few (allocation, autotuning)."""
    return min(10, steps // 2)


# --------------------------------------------------------------------------------------------
# PyTorch


def import_torch():
    """(torch, transformers), or SystemExit with what to install."""
    try:
        import torch
        import transformers
    except ImportError as e:
        raise SystemExit(f"fidelity: the torch variants need PyTorch and transformers ({e}); "
                         f"install them (they are not blujax dependencies), or leave the torch "
                         f"variants out: --variants ours-ffi,ours-xla") from None
    return torch, transformers


def import_export_hf():
    try:
        from blujax.interop import export_hf
    except ImportError as e:
        raise SystemExit(f"fidelity: the torch variants start from our initial weights through "
                         f"blujax.interop.export_hf, which did not import ({e})") from None
    return export_hf


def run_torch(model_dir, inputs, targets, lrs, tcfg: train.TrainConfig, *, noise_seed=None):
    """PyTorch's GPT2LMHeadModel trained from the weights in model_dir on the same batches and
    learning rates, with TrainConfig's clipping and AdamW; noise_seed: first multiply every
    weight by (1 + NOISE * N(0, 1)), drawn from a generator with that seed."""
    torch, transformers = import_torch()
    import torch.nn.functional as F

    transformers.utils.logging.disable_progress_bar()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bf16 = tcfg.dtype == "bf16"
    if device.type == "cuda":
        # f32: TF32 matrix products, as JAX's default precision on a GPU. (Under bf16 autocast
        # no float32 matrix product is left.)
        torch.set_float32_matmul_precision("highest" if bf16 else "high")
    # Dropout off: our model has none.
    model = transformers.GPT2LMHeadModel.from_pretrained(
        model_dir, dtype=torch.float32, embd_pdrop=0.0, resid_pdrop=0.0, attn_pdrop=0.0,
        summary_first_dropout=0.0).to(device)
    model.train()
    params = list(model.parameters())  # the tied LM head is wte, listed once
    if noise_seed is not None:
        generator = torch.Generator().manual_seed(noise_seed)
        with torch.no_grad():
            for p in params:
                factor = 1 + NOISE * torch.randn(p.shape, generator=generator)
                p.mul_(factor.to(device))
    # gpt2.decay_mask's leaves, by shape: wte, wpe and every Conv1D weight are the matrices;
    # biases and LayerNorm parameters are vectors.
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tcfg.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=lrs[0], betas=(tcfg.b1, tcfg.b2), eps=tcfg.eps, fused=True)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    xs = torch.from_numpy(inputs).to(device, torch.long)
    ys = torch.from_numpy(targets).to(device, torch.long)
    steps = len(inputs)
    losses = torch.zeros(steps, device=device)
    norms = torch.zeros(steps, device=device)
    t_start, t0 = timed_from(steps), None
    for i in range(steps):
        if i == t_start:
            sync()
            t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lrs[i]
        with autocast:
            logits = model(xs[i], use_cache=False).logits
        # GPT2LMHeadModel's logits are over the real vocabulary; inputs and targets are our
        # pairs already (no shift, unlike its `labels`).
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ys[i].reshape(-1))
        loss.backward()
        if tcfg.grad_clip:
            norms[i] = torch.nn.utils.clip_grad_norm_(params, tcfg.grad_clip)
        else:
            norms[i] = torch.nn.utils.get_total_norm([p.grad for p in params])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses[i] = loss.detach()
        del logits, loss
    sync()
    seconds = time.perf_counter() - t0
    result = {"loss": losses.tolist(), "grad_norm": norms.tolist(),
              "tokens_per_s": (steps - t_start) * inputs[0].size / seconds,
              "attention": getattr(model.config, "_attn_implementation", None)}
    del model, optimizer, params, decay, no_decay, xs, ys
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


# --------------------------------------------------------------------------------------------
# Windows and gaps


def window_means(losses, edges) -> dict[str, float]:
    """The mean loss of steps (a, b] for consecutive edges a, b (steps counted from 1)."""
    return {f"{a}-{b}": float(np.mean(losses[a:b])) for a, b in zip(edges, edges[1:])}


def gaps(runs, variants, windows, base="torch") -> dict:
    """{variant: {window: [gap of each seed]}}: each run's window mean minus that of the
    `base` run of the same seed."""
    by = {(r["seed"], r["variant"]): r["windows"] for r in runs}
    seeds = sorted({r["seed"] for r in runs if r["variant"] == base})
    out = {}
    for v in variants:
        if v == base:
            continue
        have = [s for s in seeds if (s, v) in by]
        if have:
            out[v] = {w: [by[s, v][w] - by[s, base][w] for s in have] for w in windows}
    return out


def mean_sd(values) -> str:
    m = statistics.fmean(values)
    return f"{m:+.4f}" + (f" ± {statistics.stdev(values):.4f}" if len(values) > 1 else "")


def report(runs, variants, windows) -> str:
    runs = sorted(runs, key=lambda r: (r["seed"], VARIANTS.index(r["variant"])))
    lines = ["Mean training loss per window:", "",
             "| seed | variant | " + " | ".join(windows) + " | tokens/s |",
             "|---|---|" + "---|" * len(windows) + "---|"]
    for r in runs:
        lines.append(f"| {r['seed']} | {r['variant']} | "
                     + " | ".join(f"{r['windows'][w]:.4f}" for w in windows)
                     + f" | {r['tokens_per_s'] / 1e3:.1f}K |")
    g = gaps(runs, variants, windows)
    if not g:
        return "\n".join(lines)
    seeds = sorted({r["seed"] for r in runs if r["variant"] == "torch"})
    speed = {v: statistics.fmean(r["tokens_per_s"] for r in runs if r["variant"] == v)
             for v in variants if any(r["variant"] == v for r in runs)}
    lines += ["", f"Loss gap to PyTorch (nats; mean ± sd over seeds {seeds}), steps (a, b]; "
              f"tokens/s: " + ", ".join(f"{v} {s / 1e3:.1f}K" for v, s in speed.items()), "",
              "| window | " + " | ".join(f"{v} − torch" for v in g) + " |",
              "|---|" + "---|" * len(g)]
    for w in windows:
        lines.append(f"| {w} | " + " | ".join(mean_sd(g[v][w]) for v in g) + " |")
    if "torch-noise" in g and "ours-ffi" in g:
        within = ["yes" if abs(statistics.fmean(g["ours-ffi"][w]))
                  <= abs(statistics.fmean(g["torch-noise"][w])) else "no" for w in windows]
        lines += ["", "ours-ffi within the noise floor (|gap| <= |torch-noise gap|): "
                  + ", ".join(f"{w} {v}" for w, v in zip(windows, within))]
    return "\n".join(lines)


def fp8_report(runs, windows) -> str:
    """FP8 against bfloat16 (ours-ffi) of the same seed: the loss gap per window (mean ± sd
    over seeds), beside two noise floors: seed to seed (the standard deviation over seeds of
    ours-ffi's window mean), against which |FP8 gap| <= 2 x floor is judged, and the stricter
    perturbation floor (ours-noise: bfloat16 from perturbed weights on the same batches, its
    mean |gap| to ours-ffi); and spikes: the largest single-step excess of each run's loss
    over bfloat16's."""
    g = gaps(runs, [v for v in VARIANTS if v in ("ours-fp8", "ours-fp8-delayed", "ours-noise")],
             windows, base="ours-ffi")
    fp8s = [v for v in ("ours-fp8", "ours-fp8-delayed") if v in g]
    if not fp8s:
        return ""
    shown = [v for v in (*fp8s, "ours-noise") if v in g]
    base = {w: [r["windows"][w] for r in runs if r["variant"] == "ours-ffi"] for w in windows}
    lines = ["", "FP8 - bf16 (ours-ffi) loss gap (nats; mean ± sd over seeds), steps (a, b]:",
             "", "| window | " + " | ".join(f"{v} − bf16" for v in shown)
             + " | seed-to-seed floor (sd) | within 2x floor |",
             "|---|" + "---|" * (len(shown) + 2)]
    for w in windows:
        cells = [mean_sd(g[v][w]) for v in shown]
        floor = statistics.stdev(base[w]) if len(base[w]) > 1 else float("nan")
        verdict = ", ".join(f"{v} {'yes' if abs(statistics.fmean(g[v][w])) <= 2 * floor else 'no'}"
                            for v in fp8s)
        lines.append(f"| {w} | " + " | ".join(cells) + f" | {floor:.4f} | {verdict} |")
    by = {(r["seed"], r["variant"]): r["loss"] for r in runs}
    excess = {v: max(max(np.asarray(by[s, v]) - np.asarray(by[s, "ours-ffi"]))
                     for s, vv in by if vv == v and (s, "ours-ffi") in by)
              for v in (*fp8s, "ours-noise") if v in g}
    lines += ["", "largest one-step loss excess over bf16 (a spike bf16 does not have): "
              + ", ".join(f"{v} {e:+.4f}" for v, e in excess.items()),
              "largest rise of a step's loss over the median of its run's previous "
              f"{SPIKE_WINDOW} steps (mean over seeds): "
              + ", ".join(f"{v} {statistics.fmean(spike(by[s, vv]) for s, vv in by if vv == v):.4f}"
                          for v in ("ours-ffi", *excess))]
    return "\n".join(lines)


SPIKE_WINDOW = 10


def spike(losses) -> float:
    """The largest rise of one step's loss over the median of the SPIKE_WINDOW steps before it
    (from step 2 x SPIKE_WINDOW on, past the first fall): how far a run spikes on its own."""
    x = np.asarray(losses)
    start = 2 * SPIKE_WINDOW
    if len(x) <= start:
        return 0.0
    return float(max(x[i] - np.median(x[i - SPIKE_WINDOW:i]) for i in range(start, len(x))))


# --------------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.fidelity", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--model", help="a model preset (default gpt2; --quick: tiny); the torch "
                   "variants need a GPT-2 one")
    p.add_argument("--batch", type=int, help="sequences per step (default 16; --quick: 4)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default 1024; --quick: 64)")
    p.add_argument("--steps", type=int, help="training steps of each run (default 400; "
                                             "--quick: 24)")
    p.add_argument("--seeds", help="seeds, comma-separated: each gives the initial weights, the "
                                   "batch order and the noise (default 0,1,2; --quick: 0)")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (default 6e-4)")
    p.add_argument("--warmup", type=int, help="linear warmup steps (default: a tenth of "
                                              "--steps, 40 of 400); then cosine to lr / 10")
    p.add_argument("--data", help="training data as `examples/gpt2.py train --data` takes it: "
                                  "llm.c shards (a directory, glob or file) or a text file; "
                                  "default: the tinyshakespeare corpus (offline: from "
                                  "$BLUJAX_CORPUS, with TIKTOKEN_CACHE_DIR)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "f32"),
                   help="bf16: mixed precision on both sides (default); f32: float32 with TF32 "
                        "matrix products on a GPU")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"runs per seed, comma-separated, of {', '.join(VARIANTS)} (default "
                        f"all); gaps are taken against torch")
    p.add_argument("--windows", help="window edges in steps, comma-separated: windows (a, b] "
                                     "of consecutive edges (default: quarters of --steps, "
                                     "100,200,300,400 for 400)")
    p.add_argument("--json", metavar="PATH", help="write the settings, every run's per-step "
                                                  "loss and gradient norm, and the gaps")
    p.add_argument("--report", nargs="+", metavar="PATH",
                   help="print the tables of the runs saved with --json in these files "
                        "(together, e.g. one file per seed) and run nothing")
    p.add_argument("--quick", action="store_true",
                   help="a smoke test: " + ", ".join(f"--{k} {v}" for k, v in QUICK.items())
                        + " unless given")
    a = p.parse_args(argv)
    for key, value in (QUICK if a.quick else DEFAULTS).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    a.seeds = [int(s) for s in a.seeds.split(",")]
    a.variants = a.variants.split(",")
    unknown = sorted(set(a.variants) - set(VARIANTS))
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if a.warmup is None:
        a.warmup = a.steps // 10
    edges = ([int(e) for e in a.windows.split(",")] if a.windows
             else [round(a.steps * k / 4) for k in range(1, 5)])
    if any(b <= e for e, b in zip(edges, edges[1:])) or edges[0] < 0 or edges[-1] > a.steps:
        p.error(f"--windows {edges}: edges must increase within [0, --steps {a.steps}]")
    if len(edges) < 2:
        p.error("--windows: at least two edges (one window)")
    a.edges = edges
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.report:
        saved = [json.loads(Path(path).read_text()) for path in a.report]
        runs = [r for s in saved for r in s["runs"]]
        present = {r["variant"] for r in runs}
        windows = saved[0]["settings"]["windows"]
        print(report(runs, [v for v in VARIANTS if v in present], windows))
        print(fp8_report(runs, windows))
        return 0
    wants_torch = any(v.startswith("torch") for v in a.variants)
    if wants_torch:
        import_torch()
        export_hf = import_export_hf()
    config = get_config(a.model)
    if wants_torch and family_of(config).NAME != "gpt2":
        raise SystemExit(f"benchmarks.fidelity: the torch variants train GPT-2 only; --model "
                         f"{a.model} runs our variants alone (--variants ours-ffi,ours-fp8,...)")
    tcfg = train.TrainConfig(steps=a.steps, learning_rate=a.lr, warmup_steps=a.warmup,
                             dtype=a.dtype)
    lrs = learning_rates(tcfg)
    shards = resolve_shards(a.data).train
    windows = [f"{x}-{y}" for x, y in zip(a.edges, a.edges[1:])]
    settings = {"model": a.model, "batch": a.batch, "seq": a.seq, "steps": a.steps,
                "seeds": a.seeds, "dtype": a.dtype, "variants": a.variants,
                "windows": windows, "data": [str(s) for s in shards],
                "train_config": {k: getattr(tcfg, k) for k in tcfg.__dataclass_fields__},
                "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    if wants_torch:
        import torch
        import transformers
        settings.update(torch=torch.__version__, transformers=transformers.__version__,
                        torch_device=(torch.cuda.get_device_name() if torch.cuda.is_available()
                                      else "cpu"))
    print(f"fidelity: {a.model}, B={a.batch}, T={a.seq}, {a.steps} steps, {a.dtype}, seeds "
          f"{a.seeds}, variants {', '.join(a.variants)}; {settings['device']}, jax "
          f"{jax.__version__}" + (f", torch {settings['torch']} on {settings['torch_device']}"
                                   if wants_torch else ""), flush=True)

    ours = {}
    for v in a.variants:
        if v in OURS:
            ops_name, fields, noise = OURS[v]
            ours[v] = Ours(config, dataclasses.replace(tcfg, **fields), ops_name, noise)
    runs = []
    for seed in a.seeds:
        inputs, targets = draw_batches(shards, a.batch, a.seq, a.steps, seed)
        with tempfile.TemporaryDirectory(prefix="blujax-fidelity-") as tmp:
            if wants_torch:
                export_hf(gpt2.init(config, jax.random.key(seed)), config, tmp, tokenizer=False)
            for variant in a.variants:
                t0 = time.perf_counter()
                if variant in ours:
                    r = ours[variant].run(seed, inputs, targets)
                else:
                    r = run_torch(tmp, inputs, targets, lrs, tcfg,
                                  noise_seed=seed if variant == "torch-noise" else None)
                r = {"seed": seed, "variant": variant, **r,
                     "windows": window_means(r["loss"], a.edges),
                     "wall_s": time.perf_counter() - t0}
                runs.append(r)
                print(f"seed {seed} {variant}: loss {r['loss'][0]:.6f} (step 1) -> "
                      f"{r['loss'][-1]:.4f} (step {a.steps}); windows "
                      + ", ".join(f"{w} {m:.4f}" for w, m in r["windows"].items())
                      + f"; {r['tokens_per_s'] / 1e3:.1f}K tokens/s, {r['wall_s']:.0f} s in all",
                      flush=True)
                if a.json:
                    write_json(a.json, settings, lrs, runs, a.variants, windows)
    print()
    print(report(runs, a.variants, windows))
    print(fp8_report(runs, windows))
    return 0


def write_json(path, settings, lrs, runs, variants, windows):
    out = {"settings": settings, "lr": lrs, "runs": runs,
           "gaps": gaps(runs, variants, windows)}
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(out))
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
