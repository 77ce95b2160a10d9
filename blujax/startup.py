"""The state a run trains from, however it starts: resumed from its latest checkpoint, from
pretrained weights, or new; on one device or on any mesh. The command line's `train` starts
here, and so does a script of one's own.

    key = jax.random.key(0)
    start = startup.initial_state(config, tcfg, key=key, mesh=mesh, checkpoints="run/ckpt",
                                  extras={"sample_key": jax.random.fold_in(key, 1)})
    if start.restored is not None:        # resumed: the data where the checkpoint left it
        loader.load_state(start.restored.loader)
    state, stop = loop.run(start.state, step, loader, loop_config, extras=start.extras, ...)

    r = startup.latest_params("run/ckpt", config)   # r.tree["params"]: to evaluate, sample

Checkpoints keep the single-device layout (blujax.train.gather), whatever the mesh, and those
an earlier blujax wrote in its family's earlier parameter layout are converted as they are read
(blujax.loop.restore_latest).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax

from blujax import kernels, loop
from blujax.checkpoint import Checkpointer, Restored
from blujax.model import family_of
from blujax.processes import Processes
from blujax.train import TrainConfig, TrainState, init_state, place_state, state_from_params


@dataclasses.dataclass(frozen=True)
class Start:
    """Where a run starts. state: on the mesh (or the default device); extras: the arrays its
    checkpoints keep beside the state (restored, else those given); restored: the checkpoint
    it resumes (its step, loader state, path), None for a run from step 0."""

    state: TrainState
    extras: dict
    restored: Restored | None = None


def initial_state(config, tcfg: TrainConfig, *, key, ops=kernels, mesh=None,
                  shard_optimizer: bool = False, checkpoints=None, params=None,
                  extras: dict | None = None, processes: Processes = Processes(),
                  warn: Callable[[str], None] | None = None) -> Start:
    """The state to train a model of `config` from, in this order: the newest checkpoint that
    verifies in the folder `checkpoints`, if it holds any (those skipped and any conversion
    said to warn()); else `params` (pretrained weights: blujax.interop.load_pretrained) with
    a fresh optimizer state; else a new model from `key` (its family's init).

    ops, mesh and shard_optimizer as blujax.train.init_state's: a resumed or pretrained state
    is placed on the mesh (any mesh: checkpoints keep the single-device layout), a new one made
    in its shards. extras: arrays a checkpoint keeps beside the state (loop.run's), restored
    with it. The optimizer state's tree follows ops (ours or optax's AdamW), so a run resumes
    with the ops it started with.

    With several processes (`processes`), every process calls it alike: each restores the
    checkpoint for itself, and all of them stop (ProcessError) unless every one restored the
    same step (their folders differ) or if one of them fails."""
    extras = dict(extras or {})
    restored = None
    if checkpoints is not None:
        with processes.together():
            restored = _restore(checkpoints, config, tcfg, key, ops, extras, warn)
        processes.same(-1 if restored is None else restored.step,
                       "the checkpoint to resume from (-1: none; its folder must be one that "
                       "every process sees)")
    if restored is not None:
        state = loop.state_of(restored.tree)
        extras = {name: restored.tree[name] for name in extras}
    elif params is not None:
        state = state_from_params(config, params, tcfg, ops)
    else:  # on a mesh, made in its shards
        return Start(init_state(config, tcfg, key, ops, mesh, shard_optimizer=shard_optimizer),
                     extras)
    if mesh is not None:
        state = place_state(state, config, mesh, shard_optimizer=shard_optimizer)
    return Start(state, extras, restored)


def latest_params(checkpoints, config, *,
                  warn: Callable[[str], None] | None = None) -> Restored:
    """The parameters of the newest checkpoint in the folder `checkpoints` whose parameters
    verify (the optimizer state is neither read nor checked), on this process's first device:
    Restored.tree is {"params": ...}. FileNotFoundError if it holds none."""
    family = family_of(config)
    like = {"params": jax.eval_shape(lambda k: family.init(config, k), jax.random.key(0))}
    return loop.restore_latest(checkpoints, like, config=config, params_only=True, warn=warn)


def _restore(directory, config, tcfg, key, ops, extras, warn) -> Restored | None:
    """The newest checkpoint in `directory` that verifies, on this process's first device;
    None where there is none to resume (a damaged one is: it says why it cannot be)."""
    reader = Checkpointer(directory, read_only=True)
    if not (reader.steps() or reader.incomplete_steps()):
        return None
    like = jax.eval_shape(lambda k, e: loop.checkpoint_tree(init_state(config, tcfg, k, ops),
                                                            **e), key, extras)
    try:
        return loop.restore_latest(directory, like, config=config, warn=warn)
    except FileNotFoundError:  # deleted since the listing
        return None
