"""blujax.loop used from plain objects, without the command line: a tiny GPT-2 (f32, on the
CPU) for a few steps. A resumed run equals a straight one bit for bit; checkpoints come at the
save cadence; evaluation hooks add their fields to the records, which every sink receives;
a run of non-finite steps and a data error mid-run each stop it after a checkpoint, and so
does a signal."""

import dataclasses
import json
import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blujax import data, loop, metrics, train
from blujax.checkpoint import Checkpointer
from blujax.model import gpt2

pytestmark = pytest.mark.slow  # end to end: outside the fast tier (-m "not slow")

# Tiny shapes: a run of a few steps takes a second.
CONFIG = dataclasses.replace(gpt2.PRESETS["tiny"], vocab_size=512, padded_vocab_size=512)
TCFG = train.TrainConfig(steps=6, learning_rate=1e-3, dtype="f32")
B, T = 4, 32


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """A training shard of random tokens, and two validation batches."""
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("shards")
    path = data.write_shard(root / "tokens_train_000001.bin",
                            rng.integers(0, CONFIG.vocab_size, 20 * B * T + 1))
    val = rng.integers(0, CONFIG.vocab_size, (2, B, T + 1)).astype(np.int32)
    return path, [(v[:, :-1], v[:, 1:]) for v in val]


@pytest.fixture(scope="module")
def steps():
    """The jitted train and eval steps, compiled once for the module."""
    return train.make_train_step(CONFIG, TCFG), train.make_eval_step(CONFIG, TCFG)


@pytest.fixture(scope="module")
def initial():
    """Step 0's state, on the host: each run takes its own copy (the step donates it)."""
    return jax.device_get(train.init_state(CONFIG, TCFG, jax.random.key(0)))


def _fresh(initial):
    return jax.tree.map(lambda x: jnp.asarray(np.array(x)), initial)


def _loader(shards):
    return data.DataLoader(shards[0], batch_size=B, seq_len=T, seed=0,
                           vocab_size=CONFIG.vocab_size)


def _train(out, shards, steps, initial, config, *, resume=False, batches=None,
           train_step=None, evals=None, sinks=(), **kwargs):
    """loop.run into out/ckpt and out/metrics.jsonl, from step 0 or the latest checkpoint;
    the evaluations: the validation loss and a hook that names the step. (state, stop, the
    records the sinks got)."""
    records = []
    if evals is None:
        evals = [loop.val_loss_hook(steps[1], shards[1]),
                 lambda step, state: {"evaluated_at": step}]
    with _loader(shards) as loader, Checkpointer(out / "ckpt", keep=None) as ckpt:
        state = _fresh(initial)
        if resume:
            restored = loop.restore_latest(out / "ckpt", loop.checkpoint_tree(state))
            state = loop.state_of(restored.tree)
            loader.load_state(restored.loader)
        state, stop = loop.run(
            state, train_step or steps[0], batches(loader) if batches else loader, config,
            checkpointer=ckpt, evals=evals,
            sinks=[records.append, metrics.MetricsFile(out / "metrics.jsonl"), *sinks],
            **kwargs)
    return state, stop, records


def test_resume_equals_a_straight_run(shards, steps, initial, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for out in (straight, resumed):
        out.mkdir()
    state, stop, records = _train(straight, shards, steps, initial,
                                  loop.LoopConfig(steps=6, save_every=4, eval_every=3))
    assert stop == loop.Stop(loop.FINISHED, 6) and int(state.step) == 6
    # Every step reaches the sinks; the evaluations' fields at their steps.
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert metrics.read_metrics(straight / "metrics.jsonl") == json.loads(json.dumps(records))
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    assert [r.get("evaluated_at") for r in records] == [None, None, 3, None, None, 6]
    assert set(records[0]) == set(metrics.STEP_FIELDS)
    assert records[0]["tokens_per_s"] is None and records[1]["tokens_per_s"] > 0
    assert all(np.isfinite(r["loss"]) and not r["skipped"] for r in records)
    # Every save_every steps, and the last.
    assert Checkpointer(straight / "ckpt").steps() == [4, 6]

    _, stop, first = _train(resumed, shards, steps, initial,
                            loop.LoopConfig(steps=6, stop_after=3, eval_every=3))
    assert stop == loop.Stop(loop.FINISHED, 3) and [r["step"] for r in first] == [1, 2, 3]
    assert Checkpointer(resumed / "ckpt").steps() == [3]
    state_r, stop, second = _train(resumed, shards, steps, initial,
                                   loop.LoopConfig(steps=6, eval_every=3), resume=True)
    assert stop == loop.Stop(loop.FINISHED, 6)
    for key in ("step", "loss", "grad_norm", "lr", "val_loss", "skipped"):
        assert [r.get(key) for r in first + second] == [r.get(key) for r in records], key
    a, b = Checkpointer(straight / "ckpt").restore(), Checkpointer(resumed / "ckpt").restore()
    assert a.step == b.step == 6 and a.loader == b.loader and a.tree.keys() == b.tree.keys()
    for name in a.tree:
        np.testing.assert_array_equal(a.tree[name], b.tree[name], err_msg=name)
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(state_r)):
        np.testing.assert_array_equal(x, y)


def test_extras_are_saved_and_a_damaged_checkpoint_is_skipped(shards, steps, initial,
                                                               tmp_path):
    key = jax.random.key(7)
    _train(tmp_path, shards, steps, initial,
           loop.LoopConfig(steps=6, stop_after=2, save_every=1), extras={"sample_key": key})
    like = loop.checkpoint_tree(_fresh(initial), sample_key=key)
    (tmp_path / "ckpt" / "step_00000002" / "manifest.json").unlink()
    warnings = []
    restored = loop.restore_latest(tmp_path / "ckpt", like, warn=warnings.append)
    assert restored.step == 1 and len(warnings) == 1 and "step_00000002" in warnings[0]
    assert (jax.random.key_data(restored.tree["sample_key"]) == jax.random.key_data(key)).all()
    params = loop.restore_latest(tmp_path / "ckpt", like, params_only=True)
    assert list(params.tree) == ["params"]


def test_non_finite_steps_stop_the_run_with_a_checkpoint(shards, initial, tmp_path):
    # A learning rate this large makes the weights overflow after a step or two.
    tcfg = dataclasses.replace(TCFG, steps=20, learning_rate=1e30)
    notes = []
    state, stop, records = _train(tmp_path, shards, None, initial,
                                  loop.LoopConfig(steps=20, max_nonfinite=3),
                                  train_step=train.make_train_step(CONFIG, tcfg), evals=(),
                                  note=notes.append)
    assert stop.reason == loop.ERROR and isinstance(stop.error, loop.NonFiniteError)
    skipped = [r["step"] for r in records if r["skipped"]]
    assert 3 <= len(skipped) <= 4 and skipped == stop.error.steps
    assert skipped == list(range(skipped[0], skipped[-1] + 1))
    assert records[-1]["step"] == skipped[-1] == stop.step < 20
    assert f"steps {skipped[0]}-{skipped[-1]}" in str(stop.error)
    assert str(tmp_path / "ckpt") in str(stop.error)
    assert len(notes) == 1 and notes[0].startswith(f"warning: step {skipped[0]}: loss ")
    # The checkpoint holds the last finite parameters, which every skipped step left alone.
    saved = Checkpointer(tmp_path / "ckpt").restore()
    assert saved.step == stop.step
    params = [v for k, v in saved.tree.items() if k.startswith("['params']")]
    assert all(np.isfinite(p).all() for p in params)


class _FailingAfter:
    """The loader's batches, until a shard goes bad after `n` of them."""

    def __init__(self, loader, n):
        self.loader, self.n = loader, n

    def __iter__(self):
        return self

    def __next__(self):
        if self.n == 0:
            raise data.ShardError("tokens_train_000001.bin: changed since it was checked")
        self.n -= 1
        return next(self.loader)

    def state(self):
        return self.loader.state()


def test_a_data_error_mid_run_saves_then_stops(shards, steps, initial, tmp_path):
    state, stop, records = _train(tmp_path, shards, steps, initial,
                                  loop.LoopConfig(steps=6, save_every=5),
                                  batches=lambda loader: _FailingAfter(loader, 2))
    assert stop.reason == loop.ERROR and stop.step == 2 == int(state.step)
    assert isinstance(stop.error, data.DataError)
    assert str(stop.error) == (f"tokens_train_000001.bin: changed since it was checked; stopped "
                               f"before step 3, with a checkpoint of step 2 in "
                               f"{tmp_path / 'ckpt'}")
    assert [r["step"] for r in records] == [1, 2]
    saved = Checkpointer(tmp_path / "ckpt").restore()
    assert saved.step == 2 and saved.loader["batch"] == 2


def test_a_signal_stops_after_the_step_with_a_checkpoint(shards, steps, initial, tmp_path):
    def signal_at_step_2(record):
        if record["step"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # handled in this (the main) thread

    before = signal.getsignal(signal.SIGTERM)
    _, stop, records = _train(tmp_path, shards, steps, initial, loop.LoopConfig(steps=6),
                              evals=(), sinks=[signal_at_step_2])
    assert signal.getsignal(signal.SIGTERM) is before
    # Step 2's record is read while step 3 runs: the run stops after step 3.
    assert stop == loop.Stop(loop.SIGNAL, 3) and [r["step"] for r in records] == [1, 2, 3]
    assert Checkpointer(tmp_path / "ckpt").steps() == [3]


def test_loop_config_checks_its_numbers():
    with pytest.raises(ValueError, match="stop_after 7 must lie in"):
        loop.LoopConfig(steps=6, stop_after=7)
    with pytest.raises(ValueError, match="accum must be at least 1"):
        loop.LoopConfig(steps=6, accum=0)
    assert loop.LoopConfig(steps=6).traced(10) == range(13, 16)
