"""What the command line settles about a run folder (blujax.runs): the state and tokenizer to
evaluate from, what config.json records of a run, whether --out has training to do, and
--steps extending a run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax

from blujax import model, runs, startup
from blujax.checkpoint import Checkpointer
from blujax.cli.report import warn
from blujax.cli.settings import TrainSettings, UsageError, run_model_config
from blujax.data import DataLoader, DataSource
from blujax.train import TrainConfig


def latest_params(out: Path):
    """(model config, settings, the newest checkpoint's parameters that verify, tokenizer) of
    the run in `out` (restored by blujax.startup.latest_params; the tokenizer run_tokenizer's)."""
    saved = runs.load_run(out, warn=warn)
    config = run_model_config(saved)
    try:
        restored = startup.latest_params(runs.checkpoint_dir(out), config, warn=warn)
    except FileNotFoundError:
        raise UsageError(f"{out} holds no checkpoint (nothing in {runs.checkpoint_dir(out)})") \
            from None
    return (config, TrainSettings(**saved["settings"]), restored,
            runs.run_tokenizer(out, saved, config))


def describe_run(s: TrainSettings, model_config, train_config: TrainConfig, params,
                 source: DataSource, loader: DataLoader, n_processes: int = 1,
                 init_from: dict | None = None, tokenizer=None) -> dict:
    """What config.json holds. init_from: where the initial weights came from
    (blujax.interop.Pretrained.source), for a run started from pretrained weights. tokenizer:
    the model's (None: it has none, and trains on token shards)."""
    device = jax.devices()[0]
    return {
        "settings": dataclasses.asdict(s),
        "init_from": init_from,
        "tokenizer": tokenizer and tokenizer.identity(),
        "model": dict(name=s.model, **model.config_to_dict(model_config),
                      params=sum(x.size for x in jax.tree.leaves(params))),
        "train": dataclasses.asdict(train_config),
        "data": {"description": source.description, "spec": s.data,
                 "train": [str(p) for p in source.train], "val": [str(p) for p in source.val],
                 "train_tokens": sum(loader.counts), "fingerprint": loader.state()["shards"]},
        "device": {"platform": device.platform, "kind": device.device_kind,
                   "count": s.n_devices, "processes": n_processes},
        "jax": jax.__version__,
    }


def has_steps_to_train(out: Path, args, s: TrainSettings, saved: dict | None,
                       stop_after: int, lead: bool = True) -> bool:
    """Whether there is training to do in `out`: resuming (saved: its config.json), a
    checkpoint to continue from that is short of stop_after; starting, no earlier run there
    (unless --overwrite). Only the lead process says so."""
    # Read-only: a run saving there now is left alone.
    existing = Checkpointer(runs.checkpoint_dir(out), read_only=True).steps()
    if args.resume:
        if not existing:
            raise UsageError(f"--resume: {out} holds a run with no checkpoint to continue from "
                             f"(nothing in {runs.checkpoint_dir(out)}): --overwrite starts it "
                             f"again")
        if args.steps is not None and existing[-1] >= s.steps:
            # A --steps that extends nothing: not the run's own count, or one already reached.
            extension(saved, s, existing[-1])
        if existing[-1] >= stop_after:
            if lead:
                print(f"{out}: the run is already at step {existing[-1]} (of {s.steps}); "
                      f"nothing to train")
            return False
    elif existing and not args.overwrite:
        raise UsageError(f"{out} already holds a run (checkpoint of step {existing[-1]}): "
                         f"--resume continues it, --overwrite starts it again, or choose "
                         f"another --out")
    elif runs.config_path(out).exists() and not args.overwrite:
        raise UsageError(f"{out} holds a run with no checkpoint (it stopped before its first "
                         f"save): --overwrite starts it again, or choose another --out")
    return True


def extension(saved: dict, s: TrainSettings, at_step: int) -> dict | None:
    """A resumed run given another --steps: the record config.json keeps of it (None if
    --steps is the run's). It must leave steps to train after the checkpoint."""
    before = saved["settings"]["steps"]
    if s.steps == before:
        return None
    if s.steps <= at_step:
        raise UsageError(f"--resume --steps {s.steps}: the run is already at step {at_step} "
                         f"(of {before}); give more steps than that to extend it")
    return {"at_step": at_step, "steps_before": before, "steps_after": s.steps}
