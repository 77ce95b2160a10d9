"""A run on disk: its folder (--out), config.json, and its checkpoints in ckpt/.

config.json records the run's settings, model, tokenizer, training config, data and device;
`eval`, `sample`, `export` and `train --resume` read it back. A model that speaks its own
tokenizer (one imported with tokenizer.json) has its files copied into tokenizer/, so that
the run travels. A checkpoint holds the parameters, optimizer
state, step and sampling key (blujax.loop.checkpoint_tree), with the data loader's position
beside them; blujax.startup reads it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import jax

from blujax import model, startup
from blujax.checkpoint import Checkpointer
from blujax.cli.report import warn
from blujax.cli.settings import TrainSettings, UsageError, run_model_config
from blujax.data import DataError, DataLoader, DataSource
from blujax.data import tokenizer as tokenizer_lib
from blujax.train import TrainConfig
from blujax.vocab import GPT2_VOCAB_SIZE

RUN_FILES = ("config.json", "metrics.jsonl", "loss.png", "samples.txt")
TOKENIZER_DIR = "tokenizer"


def config_path(out: Path) -> Path:
    return out / "config.json"


def checkpoint_dir(out: Path) -> Path:
    return out / "ckpt"


def load_run(out: Path) -> dict:
    """The config.json of the run in `out`."""
    path = config_path(out)
    if not path.is_file():
        raise UsageError(f"{out} holds no training run (no config.json): train one first with "
                         f"`train --out {out}`")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise UsageError(f"{path} is not valid JSON ({e})") from None


def latest_params(out: Path):
    """(model config, settings, the newest checkpoint's parameters that verify, tokenizer) of
    the run in `out` (restored by blujax.startup.latest_params; the tokenizer run_tokenizer's)."""
    saved = load_run(out)
    config = run_model_config(saved)
    try:
        restored = startup.latest_params(checkpoint_dir(out), config, warn=warn)
    except FileNotFoundError:
        raise UsageError(f"{out} holds no checkpoint (nothing in {checkpoint_dir(out)})") \
            from None
    return (config, TrainSettings(**saved["settings"]), restored,
            run_tokenizer(out, saved, config))


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


def save_tokenizer(out: Path, tokenizer):
    """A Hugging Face tokenizer's files into the run's tokenizer/ (GPT-2's needs none)."""
    folder = out / TOKENIZER_DIR
    if tokenizer is not None and tokenizer.folder is not None \
            and tokenizer.folder.resolve() != folder.resolve():
        shutil.rmtree(folder, ignore_errors=True)
        tokenizer.save(folder)


def run_tokenizer(out: Path, saved: dict, model_config):
    """The tokenizer the run in `out` speaks (None: none, token shards only): its tokenizer/
    folder; else GPT-2's, for runs that record GPT-2's or (written before runs recorded one)
    have a vocabulary that holds GPT-2's ids."""
    folder = out / TOKENIZER_DIR
    recorded = saved.get("tokenizer", "unrecorded")
    try:
        if folder.is_dir():
            return tokenizer_lib.load_tokenizer(folder)
    except DataError as e:
        raise UsageError(str(e)) from None
    if recorded == "unrecorded":
        return tokenizer_lib.gpt2() if model_config.vocab_size >= GPT2_VOCAB_SIZE else None
    if recorded is None:
        return None
    if recorded.get("fingerprint") == tokenizer_lib.GPT2_FINGERPRINT:
        return tokenizer_lib.gpt2()
    raise UsageError(f"{out}: the run speaks {tokenizer_lib.describe(recorded)}, and its files "
                     f"are missing from {folder}: copy them there from the model it was "
                     f"imported from")


def write_json(path: Path, obj):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def clear_run(out: Path):
    """Deletes what an earlier run in `out` wrote, so that a fresh run does not mix with it."""
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(checkpoint_dir(out), ignore_errors=True)
    shutil.rmtree(out / TOKENIZER_DIR, ignore_errors=True)


def has_steps_to_train(out: Path, args, s: TrainSettings, saved: dict | None,
                       stop_after: int, lead: bool = True) -> bool:
    """Whether there is training to do in `out`: resuming (saved: its config.json), a
    checkpoint to continue from that is short of stop_after; starting, no earlier run there
    (unless --overwrite). Only the lead process says so."""
    # Read-only: a run saving there now is left alone.
    existing = Checkpointer(checkpoint_dir(out), read_only=True).steps()
    if args.resume:
        if not existing:
            raise UsageError(f"--resume: {out} holds no checkpoint to continue from (nothing "
                             f"in {checkpoint_dir(out)})")
        if args.steps is not None and existing[-1] >= s.steps:
            # A --steps that extends nothing: not the run's own count, or one already reached.
            extension(saved, s, existing[-1])
        if existing[-1] >= stop_after:
            if lead:
                print(f"{out}: the run is already at step {existing[-1]} (of {s.steps}); "
                      f"nothing to train")
            return False
    elif (existing or config_path(out).exists()) and not args.overwrite:
        raise UsageError(f"{out} already holds a run"
                         + (f" (checkpoint of step {existing[-1]})" if existing else "")
                         + ": --resume continues it, --overwrite starts it again, or choose "
                           "another --out")
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
