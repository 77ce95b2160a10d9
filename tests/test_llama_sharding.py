"""Llama on meshes whose "tensor" axis does not divide n_kv_head: the key/value projections
replicated over "tensor" (every device computes all the KV heads and attends with those its
query heads use; their gradients summed over "tensor"), against one device, on 8 emulated CPU
devices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from blujax import sharding, train
from blujax.model import llama
from blujax.model import ops as model_ops
from blujax.sharding import parallel
from tests.util import rel_close

FFI, XLA = model_ops.get("ffi"), model_ops.get("xla")
OPS = {"ffi": FFI, "xla": XLA}


def _config(n_head, n_kv_head):
    # Heads of 64; a vocabulary padded to 504 (divisible by tensor 2, 3, 4 and 8).
    return llama.LlamaConfig(n_layer=2, n_head=n_head, n_kv_head=n_kv_head,
                             n_embd=64 * n_head, ffn_hidden=384, block_size=64,
                             vocab_size=500, padded_vocab_size=504)


# n_kv_head % tensor != 0 on each mesh below. Hl = n_head / tensor query heads per device,
# G = n_head / n_kv_head per KV head.
GQA = _config(4, 2)        # tensor 4: Hl 1, G 2 (one KV head per device)
ONE_KV = _config(4, 1)     # tensor 2: Hl 2, G 4 (one KV head, shared by all)
IRREGULAR = _config(6, 2)  # tensor 3: Hl 2, G 3 (device 1: query heads 2, 3 -> KV heads 0, 1)
CONFIGS = {"gqa": GQA, "one_kv": ONE_KV, "irregular": IRREGULAR}


def _devices():
    devices = jax.devices()
    return devices if len(devices) >= 8 else jax.devices("cpu")


def _mesh(shape):
    return sharding.make_mesh(*shape, devices=_devices()[:int(np.prod(shape))])


@pytest.fixture(autouse=True)
def _platform():
    with jax.default_device(_devices()[0]), jax.default_matmul_precision("float32"):
        yield


def _id(x):
    """Mesh shapes as test ids: (1, 3, 2) -> "1x3x2"."""
    return "x".join(map(str, x)) if isinstance(x, tuple) else None


def _tokens(seed, shape):
    return jax.random.randint(jax.random.key(seed), shape, 0, 500, jnp.int32)


@functools.cache
def _params(config):
    """Fresh params plus noise, so the RMSNorm scales are not all one."""
    params = llama.init(config, jax.random.key(1))
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    return tree.unflatten([x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


# --- fast: the mesh checks, the layout, the KV heads each device picks ---------------------


def test_check_mesh_keeps_kv_heads_whole_where_they_do_not_split():
    sizes = {"data": 1, "tensor": 4, "context": 1}
    llama.check_mesh(GQA, sizes)  # n_kv_head 2 on tensor 4: accepted, replicated
    assert llama.whole_axes(GQA, sizes) == ("kv_heads",)
    assert llama.whole_axes(GQA, {**sizes, "tensor": 2}) == ()  # 2 divides 2: split
    llama.check_mesh(IRREGULAR, {**sizes, "tensor": 3})
    assert llama.whole_axes(IRREGULAR, {**sizes, "tensor": 3}) == ("kv_heads",)
    # Each device still holds whole query heads.
    with pytest.raises(ValueError, match=r"n_head \(4\) must be divisible by the tensor axis "
                                         r"\(8\)"):
        llama.check_mesh(GQA, {**sizes, "tensor": 8})
    with pytest.raises(ValueError, match=r"n_head \(6\) must be divisible by the tensor axis"):
        train.make_value_and_grad(IRREGULAR, FFI, _mesh((1, 4, 1)))
    with pytest.raises(ValueError, match=r"padded_vocab_size \(504\) must be divisible"):
        llama.check_mesh(_config(5, 1), {**sizes, "tensor": 5})


def test_whole_kv_heads_are_replicated_in_the_state():
    """wk and wv (and their AdamW moments) whole on every device of "tensor" where n_kv_head
    does not divide by it; split as before where it does."""
    tcfg = train.TrainConfig(steps=1, dtype="f32")
    state = jax.eval_shape(lambda k: train.init_state(GQA, tcfg, k), jax.random.key(0))
    axes = llama.logical_axes(GQA)
    for mesh_shape, split in (((2, 4, 1), False), ((4, 2, 1), True)):
        mesh = _mesh(mesh_shape)
        whole = train.whole_axes(GQA, sharding.mesh.mesh_sizes(mesh))
        sh = sharding.state_shardings(state, axes, mesh, shard_optimizer=True, whole=whole)
        blocks, mu = sh.params["blocks"], sh.opt_state[1].mu["blocks"]
        assert blocks["wq"].spec == P(None, None, "tensor")
        assert blocks["wo"].spec == P(None, "tensor", None)
        for name in ("wk", "wv"):
            assert blocks[name].spec == (P(None, None, "tensor") if split else P(None, None, None))
            assert "tensor" in str(mu[name].spec) if split else "tensor" not in str(mu[name].spec)
    # init_state on such a mesh makes them so, and their values are init's.
    mesh = _mesh((1, 2, 1))
    got = train.init_state(ONE_KV, tcfg, jax.random.key(0), mesh=mesh)
    assert got.params["blocks"]["wk"].sharding.spec == P(None, None, None)
    assert got.params["blocks"]["wk"].addressable_shards[0].data.shape == (2, 256, 64)
    np.testing.assert_array_equal(got.params["blocks"]["wv"],
                                  llama.init(ONE_KV, jax.random.key(0))["blocks"]["wv"])


@pytest.mark.parametrize("n_head,n_kv_head,tp", [(4, 2, 4), (4, 1, 2), (6, 2, 3), (12, 4, 3),
                                                 (8, 2, 8), (8, 4, 2)])
def test_each_device_picks_its_query_heads_kv_heads(n_head, n_kv_head, tp):
    """Device r's query heads [r Hl, (r + 1) Hl) read KV heads h // G, as one device's GQA."""
    hl, g = n_head // tp, n_head // n_kv_head
    mesh = _mesh((1, tp, 1))
    k = jnp.broadcast_to(jnp.arange(n_kv_head, dtype=jnp.float32)[:, None], (1, 1, n_kv_head, 2))

    def picked(k):
        local, = parallel._local_kv(hl, n_kv_head, tp, k)
        # Expand to one KV head per local query head, as attention reads them.
        return jnp.repeat(local, hl // local.shape[2], axis=2)

    got = jax.shard_map(picked, mesh=mesh, in_specs=P(), out_specs=P(None, None, "tensor"))(k)
    np.testing.assert_array_equal(got[0, 0, :, 0], np.arange(n_head) // g)


# --- slow: loss and gradients on meshes against one device ---------------------------------


def _check_value_and_grad(config, mesh_shape, ops, collective_matmul=False,
                          reduce_in_backward=False, T=24):
    tokens = _tokens(3, (4, T + 1))
    f = train.make_value_and_grad(config, OPS[ops], _mesh(mesh_shape),
                                  collective_matmul=collective_matmul,
                                  reduce_in_backward=reduce_in_backward)
    loss, grads = f(jax.device_put(_params(config)), tokens[:, :-1], tokens[:, 1:])
    loss_1, grads_1 = jax.jit(jax.value_and_grad(functools.partial(
        train.loss_fn, config=config, ops=OPS[ops])))(_params(config), tokens[:, :-1],
                                                      tokens[:, 1:])
    np.testing.assert_allclose(float(loss), float(loss_1), rtol=1e-5)
    rel_close(train.gather(grads), grads_1, 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("ops", ["ffi", "xla"])
@pytest.mark.parametrize("config,mesh_shape", [
    ("gqa", (1, 4, 1)), ("gqa", (2, 4, 1)), ("one_kv", (1, 2, 1)), ("irregular", (1, 3, 1)),
    ("irregular", (2, 3, 1)), ("one_kv", (1, 2, 2)), ("irregular", (1, 3, 2))], ids=_id)
def test_mesh_loss_and_grads_match_one_device(config, mesh_shape, ops):
    _check_value_and_grad(CONFIGS[config], mesh_shape, ops)


# Hiding communication (the collective matmul's ppermute rings, the gradients reduced inside
# the backward: the replicated wk, wv summed over "tensor" there) gives the same numbers.
@pytest.mark.slow
@pytest.mark.parametrize("config,mesh_shape", [("gqa", (2, 4, 1)), ("irregular", (1, 3, 2)),
                                               ("one_kv", (2, 2, 2))], ids=_id)
def test_mesh_loss_and_grads_with_overlap_match_one_device(config, mesh_shape):
    _check_value_and_grad(CONFIGS[config], mesh_shape, "ffi", collective_matmul=True,
                          reduce_in_backward=True)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape,shard_optimizer,overlap", [
    ((2, 4, 1), True, False), ((2, 2, 2), False, True)], ids=_id)
def test_train_steps_match_one_device(mesh_shape, shard_optimizer, overlap):
    """The whole step: the replicated leaves' gradients reduced over "tensor", counted once in
    grad_norm (clipping exercised), with ZeRO-1 and with both overlap options."""
    config = GQA if mesh_shape[1] == 4 else ONE_KV
    tcfg = train.TrainConfig(steps=3, warmup_steps=1, learning_rate=1e-3, accum_steps=2,
                             dtype="f32")
    one = train.init_state(config, tcfg, jax.random.key(0))
    mesh = _mesh(mesh_shape)
    state = train.place_state(jax.tree.map(np.asarray, one), config, mesh,
                              shard_optimizer=shard_optimizer)
    assert state.params["blocks"]["wk"].sharding.spec == P(None, None, None)
    step_1 = train.make_train_step(config, tcfg)
    step = train.make_train_step(config, tcfg, mesh=mesh, shard_optimizer=shard_optimizer,
                                 collective_matmul=overlap, reduce_in_backward=overlap)
    for i in range(tcfg.steps):
        batch = _tokens(10 + i, (tcfg.accum_steps, 4, 17))
        one, m_1 = step_1(one, batch[..., :-1], batch[..., 1:])
        state, m = step(state, batch[..., :-1], batch[..., 1:])
        if i == 0:
            assert float(m_1["grad_norm"]) > tcfg.grad_clip
        for name in ("loss", "grad_norm", "skipped"):
            np.testing.assert_allclose(float(m[name]), float(m_1[name]), rtol=1e-5,
                                       err_msg=f"step {i} {name}")
    got = train.gather(state.params)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got),
                            jax.tree.leaves(one.params)):
        err = float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        assert err <= 0.25 * tcfg.learning_rate, f"{jax.tree_util.keystr(path)}: {err:.3e}"
