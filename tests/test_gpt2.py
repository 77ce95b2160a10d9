"""GPT-2 on our kernels vs the same model on plain XLA ops; the train step; sampling; learning.

The learning test needs, from the environment, BLUJAX_TEST_DATA (a folder with
tinyshakespeare.txt) and TIKTOKEN_CACHE_DIR (or network access) for the GPT-2 tokenizer; it
skips without them.
"""

import dataclasses
import os
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blujax.data
import blujax.model
from blujax import sample, train
from blujax.model import gpt2
from blujax.model import ops as model_ops
from tests.util import rel_close, without_key_bias

# head_dim 64 (the GPU attention kernel's size), a small vocabulary to keep the CPU fast.
CONFIG = gpt2.GPT2Config(n_layer=2, n_head=2, n_embd=128, block_size=64, vocab_size=500,
                         padded_vocab_size=512)
FFI, XLA = model_ops.get("ffi"), model_ops.get("xla")


def _tokens(seed, shape, vocab=CONFIG.vocab_size):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab, jnp.int32)


@pytest.fixture(autouse=True)
def exact_matmuls():
    # On a GPU, XLA's float32 dots default to TF32; both sides of a comparison use full f32.
    with jax.default_matmul_precision("float32"):
        yield


def test_init_follows_gpt2():
    params = gpt2.init(CONFIG, jax.random.key(0))
    b = params["blocks"]
    assert params["wte"].shape == (512, 128) and b["attn"]["w"].shape == (2, 128, 3, 128)
    np.testing.assert_array_equal(params["wte"][500:], 0)  # padded rows start at zero
    assert abs(float(jnp.std(b["attn"]["w"])) - 0.02) < 1e-3
    assert abs(float(jnp.std(b["mlp_proj"]["w"])) - 0.02 / 2.0) < 1e-3  # 1/sqrt(2 * 2 layers)
    np.testing.assert_array_equal(b["ln1"]["w"], 1)
    np.testing.assert_array_equal(b["attn"]["b"], 0)
    mask = gpt2.decay_mask(params)
    assert mask["wte"] and mask["blocks"]["attn"]["w"] and mask["blocks"]["mlp_proj"]["w"]
    assert not mask["blocks"]["attn"]["b"] and not mask["blocks"]["ln2"]["w"]
    assert not mask["ln_f"]["w"]


def test_presets_and_flops():
    c = gpt2.PRESETS["gpt2"]
    n = gpt2.num_params(jax.eval_shape(lambda k: gpt2.init(c, k), jax.random.key(0)))
    assert 124.4e6 < n < 124.5e6  # 124M, with the vocabulary padded to 50304
    assert 854e6 < gpt2.flops_per_token(c, 1024) < 856e6
    with pytest.raises(ValueError, match="presets are"):
        blujax.model.get_config("gpt3")
    with pytest.raises(ValueError, match="multiple of n_head"):
        gpt2.GPT2Config(n_layer=1, n_head=3, n_embd=64)


def test_forward_checks_tokens():
    params = gpt2.init(CONFIG, jax.random.key(0))
    with pytest.raises(ValueError, match="block_size"):
        gpt2.forward(params, _tokens(0, (1, 65)), config=CONFIG, ops=FFI)
    with pytest.raises(TypeError, match="integers"):
        gpt2.forward(params, jnp.zeros((1, 8)), config=CONFIG, ops=FFI)
    with pytest.raises(ValueError, match=r"\[batch, time\]"):
        gpt2.forward(params, _tokens(0, (8,)), config=CONFIG, ops=FFI)


@pytest.mark.parametrize("remat", [False, True, "selective"])
def test_loss_and_grads_match_xla(remat):
    params = gpt2.init(CONFIG, jax.random.key(1))
    # Non-zero biases and LayerNorm parameters, so their gradients are tested too.
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    params = tree.unflatten([x + 0.05 * jax.random.normal(k, x.shape)
                             for x, k in zip(leaves, keys)])
    tokens = _tokens(3, (3, 41))  # T not a power of two
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def grads(ops):
        f = jax.value_and_grad(train.loss_fn)
        return jax.jit(lambda p: f(p, inputs, targets, config=CONFIG, ops=ops, remat=remat))(params)

    (loss, g), (loss_x, g_x) = grads(FFI), grads(XLA)
    assert 5.5 < float(loss_x) < 7.5  # about log(500) for a fresh model
    np.testing.assert_allclose(float(loss), float(loss_x), rtol=1e-5)
    rel_close(g, g_x, 1e-5)


@pytest.mark.slow
def test_python_loop_equals_scan():
    """scan_layers=False (the GPU default) computes what the scan computes."""
    params = gpt2.init(CONFIG, jax.random.key(1))
    tokens = _tokens(3, (2, 17))

    def grads(scan_layers):
        f = jax.value_and_grad(train.loss_fn)
        return jax.jit(lambda p: f(p, tokens[:, :-1], tokens[:, 1:], config=CONFIG, ops=FFI,
                                   scan_layers=scan_layers))(params)

    (loss, g), (loss_s, g_s) = grads(False), grads(True)
    np.testing.assert_allclose(float(loss), float(loss_s), rtol=1e-6)
    rel_close(g, g_s, 1e-6)


@pytest.mark.slow
def test_train_steps_match_xla():
    """20 steps with our kernels (and our AdamW) give XLA's (and optax's) losses."""
    tcfg = train.TrainConfig(steps=20, warmup_steps=5, learning_rate=1e-3, dtype="f32")
    batch = _tokens(4, (1, 4, 33))  # one batch, again and again: the model memorises it
    losses = {}
    for name, ops in (("ffi", FFI), ("xla", XLA)):
        state = train.init_state(CONFIG, tcfg, jax.random.key(0), ops)
        step = train.make_train_step(CONFIG, tcfg, ops)
        losses[name] = []
        for _ in range(tcfg.steps):
            state, m = step(state, batch[..., :-1], batch[..., 1:])
            losses[name].append(float(m["loss"]))
        losses[name + "_params"] = state.params
    np.testing.assert_allclose(losses["ffi"], losses["xla"], rtol=1e-5)
    assert losses["ffi"][-1] < losses["ffi"][0] - 1.0
    # Adam divides by sqrt(v): where a gradient is tiny, rounding differences grow to a fraction
    # of a step, so the params agree less tightly than the losses.
    rel_close(*(without_key_bias(losses[n + "_params"]) for n in ("ffi", "xla")), 1e-3)


@pytest.mark.slow
def test_accumulation_equals_one_big_batch():
    tcfg1 = train.TrainConfig(steps=3, dtype="f32")
    tcfg2 = dataclasses.replace(tcfg1, accum_steps=2)
    tokens = _tokens(5, (4, 17))
    s1 = train.make_train_step(CONFIG, tcfg1)(train.init_state(CONFIG, tcfg1, jax.random.key(0)),
                                              tokens[None, :, :-1], tokens[None, :, 1:])
    micro = tokens.reshape(2, 2, 17)
    s2 = train.make_train_step(CONFIG, tcfg2)(train.init_state(CONFIG, tcfg2, jax.random.key(0)),
                                              micro[..., :-1], micro[..., 1:])
    np.testing.assert_allclose(float(s1[1]["loss"]), float(s2[1]["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(s1[1]["grad_norm"]), float(s2[1]["grad_norm"]), rtol=1e-5)
    # Within a thousandth of one Adam step (see test_train_steps_match_xla).
    rel_close(without_key_bias(s1[0].params), without_key_bias(s2[0].params), 1e-3)
    with pytest.raises(ValueError, match="accum_steps"):
        train.make_train_step(CONFIG, tcfg2)(s2[0], tokens[None, :, :-1], tokens[None, :, 1:])


@pytest.mark.slow
def test_bf16_step_tracks_f32():
    tokens = _tokens(6, (1, 4, 33))
    out = {}
    for dtype in ("f32", "bf16"):
        tcfg = train.TrainConfig(steps=2, dtype=dtype)
        state = train.init_state(CONFIG, tcfg, jax.random.key(0))
        state, m = train.make_train_step(CONFIG, tcfg)(state, tokens[..., :-1], tokens[..., 1:])
        out[dtype] = m
        assert state.params["wte"].dtype == jnp.float32  # master weights stay float32
    assert abs(float(out["bf16"]["loss"]) - float(out["f32"]["loss"])) < 0.03
    np.testing.assert_allclose(float(out["bf16"]["grad_norm"]), float(out["f32"]["grad_norm"]),
                               rtol=0.05)


def test_schedule_warmup_then_cosine():
    lr = train.schedule(train.TrainConfig(steps=110, warmup_steps=10, learning_rate=1.0,
                                          min_lr_ratio=0.1))
    np.testing.assert_allclose([float(lr(s)) for s in (0, 9, 10, 60, 110, 200)],
                               [0.1, 1.0, 1.0, 0.55, 0.1, 0.1], rtol=1e-6)


@pytest.mark.parametrize("field,value", [
    ("learning_rate", 0.0), ("learning_rate", -1e-3), ("learning_rate", float("inf")),
    ("learning_rate", float("nan")), ("min_lr_ratio", -0.1), ("min_lr_ratio", 1.5),
    ("min_lr_ratio", float("nan")), ("weight_decay", -0.1), ("weight_decay", float("inf")),
    ("grad_clip", -1.0), ("grad_clip", float("inf")), ("grad_clip", float("nan")),
    ("b1", 1.0), ("b1", -0.1), ("b2", 1.0), ("b2", float("nan")), ("eps", 0.0),
    ("eps", float("inf")), ("warmup_steps", -1), ("warmup_steps", 1.5), ("steps", 0),
    ("accum_steps", 0), ("learning_rate", True), ("grad_clip", "1.0")])
def test_train_config_rejects_bad_numbers(field, value):
    kw = {"steps": 10, field: value}
    with pytest.raises(ValueError, match=rf"TrainConfig\.{field} must be"):
        train.TrainConfig(**kw)


def test_train_config_takes_edge_values():
    train.TrainConfig(steps=10, warmup_steps=20, min_lr_ratio=0.0, weight_decay=0.0,
                      grad_clip=0.0, b1=0.0, b2=0.0)  # a warmup longer than the run: a ramp
    train.TrainConfig(steps=10, min_lr_ratio=1, grad_clip=1, learning_rate=1)  # ints are fine


def _params_np(state):
    return jax.tree.map(np.asarray, state)


@pytest.mark.slow
def test_grad_clip_zero_means_no_clipping():
    """grad_clip 0 trains (it used to scale every gradient to zero) and equals AdamW on the
    unclipped gradients; a grad_clip below the norm does clip. (The clipping is the
    optimizer's, the same for either ops namespace: our kernels' one is the one run.)"""
    ops = model_ops.get("ffi")
    batch = _tokens(11, (1, 4, 33))
    tcfg = train.TrainConfig(steps=5, learning_rate=1e-3, grad_clip=0.0, dtype="f32")
    state = train.init_state(CONFIG, tcfg, jax.random.key(0), ops)
    before = _params_np(state.params)
    # The reference: the plain unclipped update (no chain at all), on a copy of the state.
    loss, grads = jax.jit(jax.value_and_grad(partial(train.loss_fn, config=CONFIG, ops=ops)))(
        state.params, batch[0, :, :-1], batch[0, :, 1:])
    adamw = train.make_adamw(tcfg, ops, gpt2.decay_mask)
    updates, _ = jax.jit(adamw.update)(grads, jax.tree.map(jnp.copy, state.opt_state[1]),
                                        state.params)
    want = jax.tree.map(np.add, before, _params_np(updates))
    got, m = train.make_train_step(CONFIG, tcfg, ops)(state, batch[..., :-1], batch[..., 1:])
    assert float(m["grad_norm"]) > 0.1 and float(m["skipped"]) == 0.0
    np.testing.assert_allclose(float(m["loss"]), float(loss), rtol=1e-6)
    rel_close(got.params, want, 1e-6)
    assert not np.array_equal(got.params["wte"], before["wte"])  # it trains
    # Clipping below the norm gives another step.
    clip = dataclasses.replace(tcfg, grad_clip=0.01)
    state = train.init_state(CONFIG, clip, jax.random.key(0), ops)
    clipped, _ = train.make_train_step(CONFIG, clip, ops)(state, batch[..., :-1], batch[..., 1:])
    assert not np.allclose(clipped.params["wte"], got.params["wte"], rtol=1e-3, atol=0)


def _poison(state):
    """The state with one NaN weight: every later loss and gradient is NaN."""
    wte = state.params["wte"].at[3, 5].set(jnp.nan)
    return state._replace(params={**state.params, "wte": wte})


@pytest.mark.parametrize("name", ["ffi", "xla"])
def test_non_finite_step_is_skipped(name):
    """A NaN loss leaves params and AdamW state as they were, bit for bit; the step counter
    advances (the schedule and the loop count by it) and the metric says skipped."""
    ops = model_ops.get(name)
    tcfg = train.TrainConfig(steps=10, warmup_steps=2, learning_rate=1e-3, dtype="f32")
    batch = _tokens(12, (1, 4, 33))
    step = train.make_train_step(CONFIG, tcfg, ops)
    state, m = step(train.init_state(CONFIG, tcfg, jax.random.key(0), ops), batch[..., :-1],
                    batch[..., 1:])
    assert float(m["skipped"]) == 0.0 and m["skipped"].dtype == jnp.float32
    state = _poison(state)
    before = _params_np(state)
    for i in range(2):
        state, m = step(state, batch[..., :-1], batch[..., 1:])
        assert np.isnan(float(m["loss"])) and float(m["skipped"]) == 1.0
        assert int(state.step) == 2 + i
        np.testing.assert_allclose(float(m["lr"]), float(train.schedule(tcfg)(1 + i)))
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(_params_np(state.params)),
                                jax.tree.leaves(before.params)):
            np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
        for a, b in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(before.opt_state)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_skipping_leaves_a_finite_step_as_it_was(monkeypatch):
    """With finite losses the step computes what it did before skipping existed (the update
    applied unconditionally), bit for bit, over a few steps with clipping."""
    tcfg = train.TrainConfig(steps=3, learning_rate=1e-3, grad_clip=0.5, dtype="f32")
    batches = [_tokens(13 + i, (1, 4, 33)) for i in range(tcfg.steps)]

    def run():
        state = train.init_state(CONFIG, tcfg, jax.random.key(0))
        step = train.make_train_step(CONFIG, tcfg)
        metrics = []
        for b in batches:
            state, m = step(state, b[..., :-1], b[..., 1:])
            metrics.append({k: float(v) for k, v in m.items()})
        return _params_np(state), metrics

    state, metrics = run()
    monkeypatch.setattr(train, "skip_unless", lambda finite, update, *args: update(*args))
    want, want_metrics = run()
    for m, w in zip(metrics, want_metrics):
        assert m == w and m["skipped"] == 0.0
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k", [(0.0, None), (1.0, None), (0.8, 5)])
def test_kv_cache_sampling_equals_full_recompute(temperature, top_k):
    params = gpt2.init(CONFIG, jax.random.key(7))
    prompt = _tokens(8, (2, 5))
    kw = dict(config=CONFIG, key=jax.random.key(9), max_new_tokens=12, temperature=temperature,
              top_k=top_k, ops=FFI)
    cached = sample.generate(params, prompt, **kw)
    full = sample.generate(params, prompt, use_cache=False, **kw)
    assert cached.shape == (2, 17)
    np.testing.assert_array_equal(cached[:, :5], prompt)
    np.testing.assert_array_equal(cached, full)
    np.testing.assert_array_equal(cached, sample.generate(params, prompt, **kw))  # deterministic
    assert int(cached.max()) < CONFIG.vocab_size  # never a padding id
    if temperature:
        other = sample.generate(params, prompt, **{**kw, "key": jax.random.key(10)})
        assert not np.array_equal(other, cached)


def test_xla_namespace_is_one_hashable_object():
    """The namespaces are static arguments of jitted functions (sample.generate's): they must
    hash, and get() must give the same object each time so the jit caches hit."""
    assert model_ops.get("xla") is XLA and model_ops.get("ffi") is FFI
    assert hash(XLA) == hash(model_ops.get("xla"))
    with pytest.raises(AttributeError, match="read-only"):
        XLA.gelu = None


@pytest.mark.slow
@pytest.mark.parametrize("use_cache", [True, False])
def test_generate_on_both_namespaces(use_cache):
    """The tiny preset samples on either namespace (the xla one used to fail as an unhashable
    static argument), and greedy decoding in float32 picks the same tokens on both."""
    config = gpt2.PRESETS["tiny"]
    params = gpt2.init(config, jax.random.key(3))
    # Larger weights than at init: logits far apart, so the argmax is not a near tie that
    # rounding could flip between the two namespaces.
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(4), len(leaves))
    params = tree.unflatten([x + 0.1 * jax.random.normal(k, x.shape)
                             for x, k in zip(leaves, keys)])
    prompt = _tokens(5, (2, 4), config.vocab_size)
    out = {}
    for name in ("ffi", "xla"):
        kw = dict(config=config, key=jax.random.key(6), max_new_tokens=8,
                  ops=model_ops.get(name), use_cache=use_cache)
        out[name] = sample.generate(params, prompt, temperature=0.0, **kw)
        sampled = sample.generate(params, prompt, temperature=1.0, top_k=50, **kw)
        assert sampled.shape == (2, 12) and int(sampled.max()) < config.vocab_size
        np.testing.assert_array_equal(sampled[:, :4], prompt)
    np.testing.assert_array_equal(out["ffi"], out["xla"])


def test_generate_checks():
    params = gpt2.init(CONFIG, jax.random.key(0))
    kw = dict(config=CONFIG, key=jax.random.key(0), ops=FFI)
    with pytest.raises(ValueError, match="exceeds the model's block_size"):
        sample.generate(params, _tokens(0, (1, 60)), max_new_tokens=5, **kw)
    with pytest.raises(ValueError, match="top_k"):
        sample.generate(params, _tokens(0, (1, 4)), max_new_tokens=2, top_k=0, **kw)
    with pytest.raises(ValueError, match="temperature"):
        sample.generate(params, _tokens(0, (1, 4)), max_new_tokens=2, temperature=-1.0, **kw)


def _shakespeare_tokens():
    root = os.environ.get("BLUJAX_TEST_DATA")
    if not root or not (Path(root) / "tinyshakespeare.txt").is_file():
        pytest.skip("BLUJAX_TEST_DATA with tinyshakespeare.txt is not set")
    try:
        enc = blujax.data.get_encoding("gpt2")
    except Exception as e:  # no network and no TIKTOKEN_CACHE_DIR
        pytest.skip(f"GPT-2 tokenizer unavailable: {e}")
    text = (Path(root) / "tinyshakespeare.txt").read_text()
    return np.asarray(enc.encode_ordinary(text), np.int32)


@pytest.mark.slow
def test_learns_tinyshakespeare():
    """A 2-layer model, 200 steps of 8 x 32 tokens from the first 90% of tinyshakespeare:
    the validation loss on the last 10% falls from 10.84 (about log 50257: uniform) to below
    6.6 (measured on the CPU: 6.25)."""
    tokens = _shakespeare_tokens()
    split, T = int(0.9 * len(tokens)), 32
    config = gpt2.GPT2Config(n_layer=2, n_head=1, n_embd=64, block_size=64)  # head_dim 64
    tcfg = train.TrainConfig(steps=200, warmup_steps=10, learning_rate=3e-3, dtype="f32")
    state = train.init_state(config, tcfg, jax.random.key(0))
    step = train.make_train_step(config, tcfg)
    eval_step = train.make_eval_step(config, tcfg)
    rng = np.random.default_rng(0)

    def batch(data, n):
        starts = rng.integers(0, len(data) - T - 1, n)
        x = np.stack([data[s:s + T + 1] for s in starts])
        return jnp.asarray(x[:, :-1]), jnp.asarray(x[:, 1:])

    val = [batch(tokens[split:], 16) for _ in range(4)]

    def val_loss(params):
        return float(np.mean([eval_step(params, x, y) for x, y in val]))

    before = val_loss(state.params)
    for _ in range(tcfg.steps):
        x, y = batch(tokens[:split], 8)
        state, _ = step(state, x[None], y[None])
    after = val_loss(state.params)
    assert before > 10.5, before
    assert after < 6.6, (before, after)
