"""blujax.startup: the state a run trains from (resumed, pretrained or new, on one device or a
mesh), and the parameters of a run's latest checkpoint, from plain objects; checkpoints of an
earlier parameter layout included. A tiny GPT-2 in float32 on the CPU."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blujax import loop, sharding, startup, train
from blujax.checkpoint import Checkpointer, CheckpointError
from blujax.model import gpt2

CONFIG = dataclasses.replace(gpt2.PRESETS["tiny"], vocab_size=512, padded_vocab_size=512)
TCFG = train.TrainConfig(steps=4, learning_rate=1e-3, dtype="f32")
KEY = jax.random.key(0)


def assert_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def stepped():
    """A state as after some steps (every value moved off its initial one), on the host, and
    a sampling key: what a checkpoint holds."""
    state = jax.device_get(train.init_state(CONFIG, TCFG, KEY))
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda x: (x + rng.random(np.shape(x))).astype(x.dtype), state)
    return state, jax.random.key(7)


def _save(folder, state, sample_key, step=1, params=lambda p: p):
    tree = loop.map_params(params, loop.checkpoint_tree(state, sample_key=sample_key))
    with Checkpointer(folder, async_save=False) as ckpt:
        ckpt.save(step, tree, loader={"batch": step})


def test_resumed_pretrained_or_new(stepped, tmp_path):
    state, sample_key = stepped
    extras = {"sample_key": jax.random.key(3)}
    new = startup.initial_state(CONFIG, TCFG, key=KEY, checkpoints=tmp_path, extras=extras)
    assert new.restored is None and new.extras is not extras
    assert_equal(new.state, train.init_state(CONFIG, TCFG, KEY))
    assert_equal(new.extras, extras)

    pretrained = jax.tree.map(lambda x: np.asarray(x, np.float16), state.params)
    start = startup.initial_state(CONFIG, TCFG, key=KEY, params=pretrained)
    assert start.restored is None and int(start.state.step) == 0
    assert_equal(start.state.params, jax.tree.map(lambda x: x.astype(np.float32), pretrained))
    assert_equal(start.state.opt_state, train.make_optimizer(
        TCFG, decay_mask=gpt2.decay_mask).init(start.state.params))

    _save(tmp_path, state, sample_key)
    notes = []
    for params in (None, pretrained):  # a checkpoint comes before pretrained weights
        start = startup.initial_state(CONFIG, TCFG, key=KEY, checkpoints=tmp_path,
                                      params=params, extras=extras, warn=notes.append)
        assert start.restored.step == 1 and start.restored.loader == {"batch": 1}
        assert_equal(start.state, state)
        assert_equal(start.extras, {"sample_key": sample_key})
    assert notes == []
    r = startup.latest_params(tmp_path, CONFIG)
    assert list(r.tree) == ["params"] and r.step == 1
    assert_equal(r.tree["params"], state.params)
    with pytest.raises(FileNotFoundError):
        startup.latest_params(tmp_path / "empty", CONFIG)


@pytest.mark.slow  # compiles on a mesh
def test_on_a_mesh(stepped, tmp_path):
    """New and resumed states on a data x tensor mesh, ZeRO-1: the single-device values, in
    the train step's layout (on 4 of the emulated CPUs where there are not 4 GPUs)."""
    state, sample_key = stepped
    devices = jax.devices() if len(jax.devices()) >= 4 else jax.devices("cpu")
    with jax.default_device(devices[0]):
        _check_on_a_mesh(state, sample_key, sharding.make_mesh(data=2, tensor=2,
                                                               devices=devices[:4]), tmp_path)


def _check_on_a_mesh(state, sample_key, mesh, tmp_path):
    config = dataclasses.replace(CONFIG, n_head=2)  # whole heads over "tensor"
    new = startup.initial_state(config, TCFG, key=KEY, mesh=mesh, shard_optimizer=True)
    want = train.init_state(config, TCFG, KEY, mesh=mesh, shard_optimizer=True)
    assert_equal(new.state, train.init_state(config, TCFG, KEY))
    assert jax.tree.map(lambda x: x.sharding, new.state) == \
        jax.tree.map(lambda x: x.sharding, want)

    _save(tmp_path, state, sample_key)
    start = startup.initial_state(config, TCFG, key=KEY, mesh=mesh, shard_optimizer=True,
                                  checkpoints=tmp_path, extras={"sample_key": sample_key})
    assert start.restored.step == 1
    assert_equal(start.state, state)
    assert jax.tree.map(lambda x: x.sharding, start.state) == \
        jax.tree.map(lambda x: x.sharding, want)


def test_a_checkpoint_of_the_earlier_layout_is_read(stepped, tmp_path):
    """GPT-2 checkpoints of before the QKV weight had its [.., 3, C] axis (fused [.., 3C], in
    the params and AdamW's moments) restore in today's layout, told by their shapes, with a
    note; without the model's config they do not match."""
    state, sample_key = stepped
    _save(tmp_path, state, sample_key, params=gpt2.legacy_params)
    C = CONFIG.n_embd
    saved = Checkpointer(tmp_path).restore()
    assert saved.tree["['params']['blocks']['attn']['w']"].shape == (2, C, 3 * C)
    assert saved.tree["['opt_state'][1].mu['blocks']['attn']['b']"].shape == (2, 3 * C)

    notes = []
    start = startup.initial_state(CONFIG, TCFG, key=KEY, checkpoints=tmp_path,
                                  extras={"sample_key": sample_key}, warn=notes.append)
    assert start.restored.upgraded
    assert_equal(start.state, state)
    assert notes == [f"note: {tmp_path / 'step_00000001'} has an earlier blujax's parameter "
                     f"layout: converted as it is read"]
    assert_equal(startup.latest_params(tmp_path, CONFIG).tree["params"], state.params)
    like = loop.checkpoint_tree(jax.tree.map(jnp.asarray, state), sample_key=sample_key)
    assert_equal(loop.restore_latest(tmp_path, like, config=CONFIG).tree["params"],
                 state.params)
    with pytest.raises(CheckpointError, match=r"\['b'\] has shape \[2, 192\], the tree "
                                              r"\[2, 3, 64\]"):
        loop.restore_latest(tmp_path, like)
