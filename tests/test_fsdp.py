"""Fully sharded data parallelism (the "fsdp" mesh axis, ZeRO-3) on 8 emulated CPU devices,
for GPT-2 and Llama, against one device: the loss and every gradient, several optimizer steps,
where the state lives, a checkpoint written on one mesh resumed on another, the recomputation
settings, and the errors for meshes that do not split."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blujax import loop, sharding, startup, train
from blujax.checkpoint import Checkpointer
from blujax.model import gpt2, llama
from blujax.model import ops as model_ops
from tests.util import rel_close, without_key_bias

pytestmark = pytest.mark.slow  # end to end: outside the fast tier (-m "not slow")

FFI = model_ops.get("ffi")
# Heads of 64, widths that 8 divides, vocabularies padded to 512 (8 divides it too).
CONFIGS = {
    "gpt2": gpt2.GPT2Config(n_layer=2, n_head=4, n_embd=256, block_size=64, vocab_size=500,
                            padded_vocab_size=512),
    "llama": llama.LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=256, ffn_hidden=384,
                               block_size=64, vocab_size=500, padded_vocab_size=512),
}
B, T = 8, 32
TCFG = train.TrainConfig(steps=3, warmup_steps=1, learning_rate=1e-3, accum_steps=2, dtype="f32")
# (data, tensor, context, fsdp): fsdp alone, with tensor, with data and tensor, with context.
MESHES = {"fsdp8": (1, 1, 1, 8), "fsdp4-tp2": (1, 2, 1, 4), "dp2-fsdp2-tp2": (2, 2, 1, 2),
          "fsdp2-cp2": (1, 1, 2, 2)}


def _devices():
    devices = jax.devices()
    return devices if len(devices) >= 8 else jax.devices("cpu")


@pytest.fixture(autouse=True, scope="module")
def _platform():
    with jax.default_device(_devices()[0]), jax.default_matmul_precision("float32"):
        yield


def _mesh(name):
    dp, tp, cp, fsdp = MESHES[name]
    return sharding.make_mesh(dp, tp, cp, fsdp=fsdp, devices=_devices()[:dp * tp * cp * fsdp])


def _tokens(seed, shape):
    return jax.random.randint(jax.random.key(seed), shape, 0, 500, jnp.int32)


@functools.cache
def _params(family):
    """Fresh params plus noise, so norms, biases and the padded rows are not special."""
    config = CONFIGS[family]
    params = train.family_of(config).init(config, jax.random.key(1))
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    return tree.unflatten([x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


@functools.cache
def _one_device_grads(family):
    tokens = _tokens(3, (B, T + 1))
    return train.make_value_and_grad(CONFIGS[family], FFI)(_params(family), tokens[:, :-1],
                                                           tokens[:, 1:])


def _batches(n, seed=10):
    return [_tokens(seed + i, (TCFG.accum_steps, B, T + 1)) for i in range(n)]


def _run(state, step, batches):
    metrics = []
    for b in batches:
        state, m = step(state, b[..., :-1], b[..., 1:])
        metrics.append({k: float(v) for k, v in m.items()})
    return state, metrics


@functools.cache
def _one_device_steps(family):
    config = CONFIGS[family]
    state = train.init_state(config, TCFG, jax.random.key(0))
    state, metrics = _run(state, train.make_train_step(config, TCFG), _batches(TCFG.steps))
    return metrics, state.params


def _same_run(metrics, params, metrics_1, params_1):
    """Losses and gradient norms to 1e-5 every step; the params within a quarter of an Adam
    step (lr) of each other (test_sharding.py says why that is the right scale)."""
    for i, (m, m_1) in enumerate(zip(metrics, metrics_1)):
        for name in ("loss", "grad_norm", "lr", "skipped"):
            np.testing.assert_allclose(m[name], m_1[name], rtol=1e-5, err_msg=f"step {i} {name}")
    if "attn" in params["blocks"]:  # GPT-2's key bias: its gradient is rounding noise
        params, params_1 = without_key_bias(params), without_key_bias(params_1)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(params),
                            jax.tree.leaves(params_1)):
        err = float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        assert err <= 0.25 * TCFG.learning_rate, f"{jax.tree_util.keystr(path)}: {err:.3e}"


# Every gradient on each mesh, each family on two of them (test_steps_match_one_device runs
# both families on all four).
@pytest.mark.parametrize("family,mesh_name", [
    ("gpt2", "fsdp8"), ("gpt2", "fsdp2-cp2"), ("llama", "fsdp4-tp2"),
    ("llama", "dp2-fsdp2-tp2")])
def test_loss_and_grads_match_one_device(family, mesh_name):
    f = train.make_value_and_grad(CONFIGS[family], FFI, _mesh(mesh_name))
    tokens = _tokens(3, (B, T + 1))
    loss, grads = f(jax.device_put(_params(family)), tokens[:, :-1], tokens[:, 1:])
    loss_1, grads_1 = _one_device_grads(family)
    np.testing.assert_allclose(float(loss), float(loss_1), rtol=1e-5)
    rel_close(train.gather(grads), grads_1, 1e-5)
    # The gradient comes out in the parameters' layout: split over "fsdp" along the width.
    assert _matrix(family, grads).sharding.spec[1] == "fsdp"


def _matrix(family, params):
    """The MLP's first weight, [L, C, ...]: split over "fsdp" along C."""
    return params["blocks"]["mlp_fc"]["w"] if family == "gpt2" else params["blocks"]["w_gate_up"]


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("family", CONFIGS)
def test_steps_match_one_device(family, mesh_name):
    """Three optimizer steps of two micro-batches; with data 2, AdamW's moments also split over
    "data" (ZeRO-1 on top)."""
    config, mesh = CONFIGS[family], _mesh(mesh_name)
    zero = MESHES[mesh_name][0] > 1
    state = train.place_state(train.init_state(config, TCFG, jax.random.key(0)), config, mesh,
                              shard_optimizer=zero)
    step = train.make_train_step(config, TCFG, mesh=mesh, shard_optimizer=zero)
    state, metrics = _run(state, step, _batches(TCFG.steps))
    _same_run(metrics, train.gather(state.params), *_one_device_steps(family))
    # Every parameter, gradient and moment with a width is split over "fsdp": each device
    # holds 1 / (fsdp x tensor) of a matrix (and 1 / data more of its moments with ZeRO).
    dp, tp, _, fsdp = MESHES[mesh_name]
    w, mu = _matrix(family, state.params), _matrix(family, state.opt_state[1].mu)
    assert w.addressable_shards[0].data.size == w.size // (tp * fsdp)
    assert mu.addressable_shards[0].data.size == mu.size // (tp * fsdp * (dp if zero else 1))
    assert state.params["wte"].sharding.spec[1] == "fsdp"


@pytest.mark.parametrize("family", ["llama"])  # the hooks and the stack are the families'
def test_recomputation_and_kept_gathers_give_the_same_gradients(family):
    """Every remat setting, and keeping the gathered weights for the backward instead of
    gathering again, compute the same loss and gradients on fsdp4 x tp2; with recomputation,
    freeing them gathers each layer's weights twice (forward and backward), keeping them
    once. (The lowered program: the count includes the tensor-parallel activation gathers.)"""
    config, mesh = CONFIGS[family], _mesh("fsdp4-tp2")
    tokens = _tokens(3, (B, T + 1))
    args = (jax.device_put(_params(family)), tokens[:, :-1], tokens[:, 1:])
    loss_1, grads_1 = _one_device_grads(family)
    gathers = {}
    for remat, keep in [("none", False), ("selective", False), ("selective", True),
                        ("full", False)]:
        f = train.make_value_and_grad(config, FFI, mesh, remat=remat, keep_gathered=keep)
        loss, grads = f(*args)
        np.testing.assert_allclose(float(loss), float(loss_1), rtol=1e-5, err_msg=remat)
        rel_close(train.gather(grads), grads_1, 1e-5)
        gathers[remat, keep] = f.lower(*args).as_text().count("all_gather")
    assert gathers["selective", False] > gathers["selective", True]


def test_checkpoint_of_one_mesh_resumes_on_another(tmp_path):
    """Two steps on fsdp4 x tp2, saved; resumed on fsdp2 (and on one device), two more: the
    straight four-step run on fsdp4 x tp2."""
    config = CONFIGS["llama"]
    tcfg = train.TrainConfig(steps=4, warmup_steps=1, learning_rate=1e-3, dtype="f32")
    batches = [_tokens(40 + i, (1, B, T + 1)) for i in range(4)]
    mesh = _mesh("fsdp4-tp2")
    step = train.make_train_step(config, tcfg, mesh=mesh)
    straight = train.init_state(config, tcfg, jax.random.key(0), mesh=mesh)
    straight, want = _run(straight, step, batches)

    state = train.init_state(config, tcfg, jax.random.key(0), mesh=mesh)
    state, first = _run(state, step, batches[:2])
    checkpoints = Checkpointer(tmp_path, async_save=False)
    checkpoints.save(2, loop.checkpoint_tree(train.gather(state)))
    for other in (sharding.make_mesh(fsdp=2, devices=_devices()[:2]), None):
        start = startup.initial_state(config, tcfg, key=jax.random.key(0), mesh=other,
                                      checkpoints=tmp_path)
        assert start.restored.step == 2
        resumed, then = _run(start.state, train.make_train_step(config, tcfg, mesh=other),
                             batches[2:])
        for i, (m, m_1) in enumerate(zip(first + then, want)):
            for name in ("loss", "grad_norm"):
                np.testing.assert_allclose(m[name], m_1[name], rtol=1e-5,
                                           err_msg=f"step {i} {name} on {other}")
        rel_close(train.gather(resumed.params), train.gather(straight.params), 1e-4)


def test_meshes_that_do_not_split_raise():
    tcfg = train.TrainConfig(steps=1, dtype="f32")
    narrow = llama.LlamaConfig(n_layer=1, n_head=2, n_kv_head=1, n_embd=132, ffn_hidden=64,
                               block_size=16, vocab_size=500, padded_vocab_size=512)
    with pytest.raises(ValueError, match=r"n_embd \(132\) must be divisible by the fsdp axis "
                                         r"\(8\)"):
        train.make_train_step(narrow, tcfg, mesh=_mesh("fsdp8"))
    with pytest.raises(ValueError, match="fsdp must be a positive int"):
        sharding.make_mesh(fsdp=0)
    mesh = _mesh("dp2-fsdp2-tp2")
    config = CONFIGS["gpt2"]
    state = train.init_state(config, tcfg, jax.random.key(0), mesh=mesh)
    step = train.make_train_step(config, tcfg, mesh=mesh)
    with pytest.raises(ValueError, match=r"batch size \(6\) must be divisible by data x fsdp "
                                         r"\(2 x 2 = 4\)"):
        step(state, _tokens(0, (1, 6, T)), _tokens(1, (1, 6, T)))
