"""A run on disk: its folder (--out), config.json, and its checkpoints in ckpt/.

config.json records the run's settings, model, training config, data and device; `eval`,
`sample` and `train --resume` read it back. A checkpoint holds the parameters, optimizer
state, step and sampling key (blujax.loop.checkpoint_tree), with the data loader's position
beside them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Callable

import jax

from blujax import loop, model
from blujax.checkpoint import Checkpointer, Restored
from blujax.cli.settings import TrainSettings, UsageError, training_config
from blujax.data import DataSource
from blujax.train import TrainConfig, init_state

RUN_FILES = ("config.json", "metrics.jsonl", "loss.png", "samples.txt")


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


def describe_run(s: TrainSettings, model_config, train_config: TrainConfig,
                 params, source: DataSource, train_tokens: int, fingerprint: str,
                 n_devices: int = 1, n_processes: int = 1, init_from: dict | None = None) -> dict:
    """What config.json holds. init_from: where the initial weights came from
    (blujax.interop.Pretrained.source), for a run started from pretrained weights."""
    device = jax.devices()[0]
    return {
        "settings": dataclasses.asdict(s),
        "init_from": init_from,
        "model": dict(name=s.model, **model.config_to_dict(model_config),
                      params=sum(x.size for x in jax.tree.leaves(params))),
        "train": dataclasses.asdict(train_config),
        "data": {"description": source.description, "spec": s.data,
                 "train": [str(p) for p in source.train], "val": [str(p) for p in source.val],
                 "train_tokens": train_tokens, "fingerprint": fingerprint},
        "device": {"platform": device.platform, "kind": device.device_kind,
                   "count": n_devices, "processes": n_processes},
        "jax": jax.__version__,
    }


def write_json(path: Path, obj):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def clear_run(out: Path):
    """Deletes what an earlier run in `out` wrote, so that a fresh run does not mix with it."""
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(checkpoint_dir(out), ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Checkpoints


def checkpoint_steps(out: Path) -> list[int]:
    """The steps of the run's checkpoints, read-only: a run saving there now is left alone."""
    return Checkpointer(checkpoint_dir(out), read_only=True).steps()


def restore_latest(out: Path, s: TrainSettings, model_config, ops, *,
                   params_only: bool = False,
                   warn: Callable[[str], None] | None = None) -> Restored:
    """The newest checkpoint of the run in `out` that verifies, on this process's first
    device: blujax.loop.restore_latest, which falls back past damaged ones (a line to warn()
    for each)."""
    reader = Checkpointer(checkpoint_dir(out), read_only=True)
    if not reader.steps() and not reader.incomplete_steps():
        raise UsageError(f"{out} holds no checkpoint (nothing in {checkpoint_dir(out)})")
    like = _checkpoint_like(s, model_config, ops)
    try:  # an earlier blujax's parameter layout is converted as it is read
        return loop.restore_latest(checkpoint_dir(out), like, config=model_config,
                                   params_only=params_only, warn=warn)
    except FileNotFoundError:  # deleted since the listing
        raise UsageError(f"{out} holds no checkpoint (nothing in {checkpoint_dir(out)})") \
            from None


def _checkpoint_like(s: TrainSettings, model_config, ops):
    """The structure, shapes and dtypes of a checkpoint's tree, without computing it."""
    train_config = training_config(s)

    def build(key):
        state = init_state(model_config, train_config, key, ops=ops)
        return loop.checkpoint_tree(state, sample_key=key)

    return jax.eval_shape(build, jax.random.key(0))
