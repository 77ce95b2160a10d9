"""The train step on a mesh (blujax.train with blujax.sharding) on 8 emulated CPU devices
against one device: loss
and every gradient, five optimizer steps (with and without the optimizer state sharded over
"data"), and the errors for meshes and batches that do not split."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from blujax import sharding, train
from blujax.model import gpt2
from blujax.model import ops as model_ops
from tests.util import rel_close, without_key_bias

pytestmark = pytest.mark.slow  # end to end: outside the fast tier (-m "not slow")

# head_dim 64 (the GPU attention kernel's size), heads divisible by tensor = 4, a small
# vocabulary (padded to 512, which 8 divides) to keep the CPU fast.
CONFIG = gpt2.GPT2Config(n_layer=2, n_head=4, n_embd=256, block_size=64, vocab_size=500,
                         padded_vocab_size=512)
FFI, XLA = model_ops.get("ffi"), model_ops.get("xla")
B, T = 8, 32  # B divisible by data = 8; T by 2 x context = 16 and T / context by tensor
MESHES = [(8, 1, 1), (1, 4, 1), (1, 1, 8), (2, 2, 2), (4, 1, 2), (2, 4, 1)]
TCFG = train.TrainConfig(steps=5, warmup_steps=1, learning_rate=1e-3, accum_steps=2, dtype="f32")


def _devices():
    """Eight devices: the default backend's where it has them (8 GPUs), else the emulated CPUs
    (a machine with one GPU runs this file on its CPU)."""
    devices = jax.devices()
    return devices if len(devices) >= 8 else jax.devices("cpu")


@pytest.fixture(autouse=True, scope="module")
def _mesh_platform():
    # Full float32 dots on a GPU too (XLA's default there is TF32), as the tolerances assume.
    with jax.default_device(_devices()[0]), jax.default_matmul_precision("float32"):
        yield


def _mesh(shape):
    """A mesh over the first data x tensor x context devices ((1, 4, 1) uses 4 of the 8)."""
    return sharding.make_mesh(*shape, devices=_devices()[:int(np.prod(shape))])


def _tokens(seed, shape):
    return jax.random.randint(jax.random.key(seed), shape, 0, CONFIG.vocab_size, jnp.int32)




@functools.cache
def _perturbed_params():
    """Fresh params plus noise, so biases, LayerNorms and the padded wte rows are not special."""
    params = gpt2.init(CONFIG, jax.random.key(1))
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    return tree.unflatten([x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


@functools.cache
def _one_device_grads():
    tokens = _tokens(3, (B, T + 1))
    f = jax.value_and_grad(train.loss_fn)
    return jax.jit(lambda p: f(p, tokens[:, :-1], tokens[:, 1:], config=CONFIG, ops=FFI))(
        _perturbed_params())


@functools.cache
def _one_device_steps():
    """Five steps of train.make_train_step on one device: (per-step metrics, final params)."""
    state = train.init_state(CONFIG, TCFG, jax.random.key(0))
    step = train.make_train_step(CONFIG, TCFG)
    metrics = []
    for i in range(TCFG.steps):
        batch = _tokens(10 + i, (TCFG.accum_steps, B, T + 1))
        state, m = step(state, batch[..., :-1], batch[..., 1:])
        metrics.append(m)
    return metrics, state.params


@pytest.fixture(autouse=True)
def exact_matmuls():
    # On a GPU, XLA's float32 dots default to TF32; both sides of a comparison use full f32.
    with jax.default_matmul_precision("float32"):
        yield


# Then, hiding communication behind compute gives the same numbers: the tensor-parallel
# collectives as ppermute rings interleaved with slices of their products (tensor 2 and 4, and
# with context), each layer's gradient reduced inside the backward.
@pytest.mark.parametrize("mesh_shape,collective_matmul,reduce_in_backward", [
    *((m, False, False) for m in MESHES),
    ((1, 4, 1), True, False), ((2, 2, 2), True, True), ((8, 1, 1), False, True),
    ((2, 4, 1), True, True)])
def test_loss_and_grads_match_one_device(mesh_shape, collective_matmul, reduce_in_backward):
    f = train.make_value_and_grad(CONFIG, FFI, _mesh(mesh_shape),
                                  collective_matmul=collective_matmul,
                                  reduce_in_backward=reduce_in_backward)
    tokens = _tokens(3, (B, T + 1))
    params = jax.device_put(_perturbed_params())
    loss, grads = f(params, tokens[:, :-1], tokens[:, 1:])
    loss_1, grads_1 = _one_device_grads()
    np.testing.assert_allclose(float(loss), float(loss_1), rtol=1e-5)
    rel_close(train.gather(grads), grads_1, 1e-5)


def test_eval_step_on_xla_ops():
    """The plain-XLA ops namespace runs sharded too (its attention_with_lse and vocabulary-
    parallel cross-entropy are the jnp specifications)."""
    tcfg = train.TrainConfig(steps=1, dtype="f32")
    tokens = _tokens(4, (B, T + 1))
    params = _perturbed_params()
    f = train.make_eval_step(CONFIG, tcfg, XLA, _mesh((2, 2, 2)))
    loss = f(jax.device_put(params), tokens[:, :-1], tokens[:, 1:])
    loss_1 = train.make_eval_step(CONFIG, tcfg, XLA)(params, tokens[:, :-1], tokens[:, 1:])
    np.testing.assert_allclose(float(loss), float(loss_1), rtol=1e-5)


# The data-parallel meshes run the optimizer state sharded over "data" (ZeRO-1); the others,
# and (2, 2, 2) once more, keep it whole.
# (2, 4, 1) with ZeRO also hides its communication (both options), over two micro-batches.
@pytest.mark.parametrize("mesh_shape,shard_optimizer", [
    ((8, 1, 1), True), ((1, 4, 1), False), ((1, 1, 8), False), ((2, 2, 2), False),
    ((4, 1, 2), True), ((2, 4, 1), True)])
def test_five_steps_match_one_device(mesh_shape, shard_optimizer):
    mesh = _mesh(mesh_shape)
    state = train.place_state(train.init_state(CONFIG, TCFG, jax.random.key(0)), CONFIG, mesh,
                              shard_optimizer=shard_optimizer)
    overlap = mesh_shape == (2, 4, 1)
    step = train.make_train_step(CONFIG, TCFG, mesh=mesh, shard_optimizer=shard_optimizer,
                                 collective_matmul=overlap, reduce_in_backward=overlap)
    metrics_1, params_1 = _one_device_steps()
    for i in range(TCFG.steps):
        batch = _tokens(10 + i, (TCFG.accum_steps, B, T + 1))
        state, m = step(state, batch[..., :-1], batch[..., 1:])
        for name in ("loss", "grad_norm", "lr", "skipped"):
            np.testing.assert_allclose(float(m[name]), float(metrics_1[i][name]), rtol=1e-5,
                                       err_msg=f"step {i} {name}")
    assert float(metrics_1[0]["grad_norm"]) > TCFG.grad_clip  # the clipping was exercised
    # Adam's step is m / sqrt(v): where the gradients of the five steps nearly cancel in m,
    # their 1e-6 differences move the step by a visible fraction of lr. So the params are
    # compared in Adam steps: each within a quarter of one step (lr) of the one-device run.
    # (Measured: up to 0.12 lr; our kernels and XLA's, both on one device, differ by 0.06 lr.
    # The losses above, at 1e-5 every step, are the tight check of the trajectory.)
    got = without_key_bias(train.gather(state.params))
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got),
                            jax.tree.leaves(without_key_bias(params_1))):
        err = float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
        assert err <= 0.25 * TCFG.learning_rate, f"{jax.tree_util.keystr(path)}: {err:.3e}"
    # Where the state lives: vocabulary rows over "tensor"; with ZeRO the moments over "data".
    dp, tp, C = mesh_shape[0], mesh_shape[1], CONFIG.n_embd
    assert state.params["wte"].addressable_shards[0].data.shape == (512 // tp, C)
    mu = state.opt_state[1].mu["blocks"]["mlp_fc"]["w"]  # [L, C, 4C]
    assert mu.addressable_shards[0].data.size == mu.size // tp // (dp if shard_optimizer else 1)


@pytest.mark.parametrize("mesh_shape,shard_optimizer", [((8, 1, 1), True), ((2, 2, 2), False)])
def test_grad_clip_zero_matches_one_device(mesh_shape, shard_optimizer):
    """grad_clip 0 is no clipping in the sharded step too (it used to zero every update)."""
    tcfg = train.TrainConfig(steps=2, learning_rate=1e-3, grad_clip=0.0, dtype="f32")
    batches = [_tokens(20 + i, (1, B, T + 1)) for i in range(tcfg.steps)]
    one = train.init_state(CONFIG, tcfg, jax.random.key(0))
    mesh = _mesh(mesh_shape)
    # Its own copy: both steps donate their state.
    state = train.place_state(jax.tree.map(np.asarray, one), CONFIG, mesh,
                              shard_optimizer=shard_optimizer)
    step_1 = train.make_train_step(CONFIG, tcfg)
    step = train.make_train_step(CONFIG, tcfg, mesh=mesh, shard_optimizer=shard_optimizer)
    for b in batches:
        one, m_1 = step_1(one, b[..., :-1], b[..., 1:])
        state, m = step(state, b[..., :-1], b[..., 1:])
        assert float(m["grad_norm"]) > 0.1
        for name in ("loss", "grad_norm", "lr", "skipped"):
            np.testing.assert_allclose(float(m[name]), float(m_1[name]), rtol=1e-5,
                                       err_msg=name)
    got = without_key_bias(train.gather(state.params))
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(without_key_bias(one.params))):
        assert float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) <= 0.25 * tcfg.learning_rate


# Data parallel with ZeRO, tensor parallel with both overlap options, and all three axes.
@pytest.mark.parametrize("mesh_shape,shard_optimizer,overlap", [
    ((8, 1, 1), True, False), ((2, 4, 1), False, True), ((2, 2, 2), False, False)])
def test_non_finite_step_is_skipped(mesh_shape, shard_optimizer, overlap):
    """As train.make_train_step: a NaN loss leaves params and AdamW state bit for bit, the
    step counter advances, skipped is 1; a finite step has skipped 0."""
    tcfg = train.TrainConfig(steps=5, learning_rate=1e-3, dtype="f32")
    mesh = _mesh(mesh_shape)
    step = train.make_train_step(CONFIG, tcfg, mesh=mesh, shard_optimizer=shard_optimizer,
                                 collective_matmul=overlap, reduce_in_backward=overlap)
    batch = _tokens(30, (1, B, T + 1))
    state = train.place_state(train.init_state(CONFIG, tcfg, jax.random.key(0)), CONFIG, mesh,
                              shard_optimizer=shard_optimizer)
    state, m = step(state, batch[..., :-1], batch[..., 1:])
    assert float(m["skipped"]) == 0.0
    one = train.gather(state)
    wte = one.params["wte"].at[3, 5].set(jnp.nan)  # every later loss and gradient is NaN
    one = jax.tree.map(np.asarray, one._replace(params={**one.params, "wte": wte}))
    state = train.place_state(one, CONFIG, mesh, shard_optimizer=shard_optimizer)
    state, m = step(state, batch[..., :-1], batch[..., 1:])
    assert np.isnan(float(m["loss"])) and float(m["skipped"]) == 1.0
    after = train.gather(state)
    assert int(after.step) == 2
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(after[1:]),
                            jax.tree.leaves(one[1:])):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_init_state_on_a_mesh_is_init_state():
    mesh = _mesh((2, 2, 2))
    state = train.init_state(CONFIG, TCFG, jax.random.key(0), mesh=mesh, shard_optimizer=True)
    ref = train.init_state(CONFIG, TCFG, jax.random.key(0))
    for a, b in zip(jax.tree.leaves(train.gather(state.params)),
                    jax.tree.leaves(ref.params)):
        np.testing.assert_array_equal(a, b)
    assert state.params["blocks"]["attn"]["w"].sharding.spec == P(None, None, None, "tensor")


@pytest.mark.parametrize("shard_optimizer", [False, True])
def test_state_round_trip_through_the_single_device_layout(shard_optimizer):
    """place_state then gather gives back the single-device state bit for bit (what a
    checkpoint keeps), the AdamW moments included."""
    state = train.init_state(CONFIG, TCFG, jax.random.key(0))
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(3), len(leaves))
    state = tree.unflatten([x + jax.random.normal(k, x.shape, x.dtype)
                            if jnp.issubdtype(x.dtype, jnp.floating) else x
                            for x, k in zip(leaves, keys)])  # moments not all zero
    back = train.gather(train.place_state(state, CONFIG, _mesh((2, 2, 2)),
                                          shard_optimizer=shard_optimizer))
    assert jax.tree.structure(back) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        assert a.shape == b.shape
        np.testing.assert_array_equal(a, b)


def test_ring_attention_matches_causal_attention():
    """The ring on its own: zig-zag queries against the whole sequence, forward and backward."""
    n = 4
    mesh = _mesh((2, 1, n))
    q, k, v = (jax.random.normal(jax.random.key(i), (2, 8 * n, 2, 16)) for i in range(3))

    def ring(q, k, v):
        return sharding.ring_attention(q, k, v, attention_with_lse=FFI.attention_with_lse,
                                       axis_name="context", axis_size=n)

    spec = P("data", "context")
    sharded = jax.shard_map(ring, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)

    def loss(f, q, k, v):
        return jnp.sum(jnp.sin(f(q, k, v)))

    z = functools.partial(sharding.zigzag, n=n, axis=1)
    got = jax.jit(jax.value_and_grad(lambda *a: loss(sharded, *map(z, a)), argnums=(0, 1, 2)))(
        q, k, v)
    want = jax.value_and_grad(lambda *a: loss(FFI.attention, *a), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    rel_close(got[1], want[1], 1e-5)


def test_bad_meshes_and_batches_raise():
    with pytest.raises(ValueError, match="must equal the device count"):
        sharding.make_mesh(2, 2, 1, devices=_devices())
    tcfg = train.TrainConfig(steps=1, dtype="f32")
    with pytest.raises(ValueError, match=r"n_head \(4\) must be divisible by the tensor axis"):
        train.make_train_step(CONFIG, tcfg, mesh=_mesh((1, 8, 1)))
    wrong = jax.make_mesh((2, 4), ("data", "model"), devices=_devices())
    with pytest.raises(ValueError, match="must have the axes"):
        train.make_train_step(CONFIG, tcfg, mesh=wrong)
    mesh = _mesh((2, 2, 2))
    state = train.place_state(train.init_state(CONFIG, tcfg, jax.random.key(0)), CONFIG, mesh)
    step = train.make_train_step(CONFIG, tcfg, mesh=mesh)
    for shape, match in [((1, 8, 34), r"divisible by 2 x context = 4"),
                         ((1, 3, 32), r"batch size \(3\) must be divisible by data x fsdp"),
                         ((2, 8, 32), r"accum_steps")]:
        with pytest.raises(ValueError, match=match):
            step(state, _tokens(0, shape), _tokens(1, shape))
    # Sequence parallelism splits each device's T / context tokens over "tensor".
    mesh = _mesh((1, 4, 2))
    step = train.make_train_step(CONFIG, tcfg, mesh=mesh)
    with pytest.raises(ValueError, match=r"\(12 / context 2 = 6\) must be divisible by the tensor"):
        step(train.place_state(train.init_state(CONFIG, tcfg, jax.random.key(0)), CONFIG, mesh),
             _tokens(0, (1, 8, 12)), _tokens(1, (1, 8, 12)))
