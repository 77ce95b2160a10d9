"""What the command line says as a run trains, beside blujax.metrics (metrics.jsonl, the loss
plot, the progress display, throughput and MFU): the run's first and last lines, notes,
warnings, and the plot's title.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import jax
import numpy as np

from blujax import model
from blujax.cli.settings import PARALLEL_KEYS, TrainSettings, training_config
from blujax.train import schedule


def warn(text: str):
    """A warning line, on stderr, at once."""
    print(text, file=sys.stderr, flush=True)


def header(s: TrainSettings, model_config, config: dict, source, tokens: int, n_processes: int,
           resumed_at: int | None, out: Path) -> str:
    """The line that says what trains, where, on what, and where it writes."""
    device = jax.devices()[0]
    where = f"{device.device_kind} ({device.platform})"
    if s.n_devices > 1:
        where = (f"{s.n_devices} x {where}"
                 + (f" in {n_processes} processes" if n_processes > 1 else "")
                 + f", {_mesh(vars(s))}")
    return (f"{model.family_of(model_config).TITLE} {s.model}: "
            f"{config['model']['params'] / 1e6:.1f}M parameters"
            + (f" from {s.init_from}" if s.init_from else "") + f", {s.ops} ops, {s.dtype}"
            + (f" with FP8 products ({s.fp8}, {s.fp8_scaling} scaling)" if s.fp8 != "off"
               else "")
            + f", on {where}; data: {source.description}, {tokens:,} training tokens; "
            f"{s.batch} x {s.seq} tokens per step"
            + (f" in {s.accum} micro-batches" if s.accum > 1 else "")
            + (f"; resuming after step {resumed_at}" if resumed_at is not None else "")
            + f"; writing to {out}")


def summary(records: list[dict], last: int, out: Path) -> str:
    timed = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
    val = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    return (f"done: step {last}, loss {records[-1]['loss']:.4f}"
            + (f", val loss {val[-1]:.4f}" if val else "")
            + (f", {np.median(timed):,.0f} tokens/s (median)" if timed else "")
            + f"; metrics.jsonl, loss.png, config.json and ckpt/ are in {out}")


def note_mesh_change(old: dict, s: TrainSettings):
    was = {k: old.get(k, getattr(TrainSettings, k)) for k in PARALLEL_KEYS}
    if was != {k: getattr(s, k) for k in PARALLEL_KEYS}:
        print(f"note: the run was on {_mesh(was)}, it continues on {_mesh(vars(s))}: the same "
              f"numbers up to rounding, not bit for bit", flush=True)


def note_extension(extension: dict, s: TrainSettings):
    """Says what a new --steps does to the learning-rate schedule, which spans --steps."""
    at, before = extension["at_step"], extension["steps_before"]
    old = schedule(dataclasses.replace(training_config(s), steps=before))
    new = schedule(training_config(s))
    # Step k's learning rate is the schedule's at k - 1 (steps taken before it).
    print(f"note: --steps {s.steps} {'extends' if s.steps > before else 'shortens'} the run "
          f"from {before} steps: the learning-rate schedule (warmup {s.warmup}, cosine decay "
          f"to {s.min_lr_ratio:g} x lr) now spans {s.steps} steps, so step {at + 1} trains at "
          f"lr {float(new(at)):.3g} where the run's schedule had {float(old(at)):.3g}; "
          f"config.json records the change", flush=True)


def plot_title(s: TrainSettings, model_config) -> str:
    return (f"{model.family_of(model_config).TITLE} {s.model} ({model_config.n_layer} layers, "
            f"{model_config.n_embd} wide), {s.batch}x{s.seq} tokens/step, lr {s.lr:g}")


def _mesh(d: dict) -> str:
    fsdp = f"fsdp {d['fsdp']} x " if d.get("fsdp", 1) > 1 else ""
    return (f"dp {d['dp']} x {fsdp}tp {d['tp']} x cp {d['cp']}"
            + (", ZeRO-1" if d["zero"] else ""))
