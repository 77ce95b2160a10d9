"""The Llama family, and what Qwen2 (Llama's block with q/k/v biases) shares with it: our
kernels against the same model on plain XLA ops, against an independent jnp transcription of
Hugging Face's LlamaForCausalLM (with Qwen2's biases where the params have them), against
transformers itself (the committed fixtures), the train step on one device and on meshes,
sampling with a KV cache of the KV heads, and the Hugging Face conversions. Qwen2's own are
in test_qwen2.py."""

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blujax import interop, sample, train
from blujax.model import family_of, llama, qwen2
from blujax.model import ops as model_ops
from tests.util import rel_close

# Heads of 64 (the GPU attention kernels' size), two query heads per KV head, tensor-splittable
# into 2; a small vocabulary (padded to 512).
CONFIG = llama.LlamaConfig(n_layer=2, n_head=4, n_kv_head=2, n_embd=256, ffn_hidden=320,
                           block_size=64, vocab_size=500, padded_vocab_size=512)
# Qwen2's: untied (the Llama one ties), the biases on q, k and v.
QWEN2 = qwen2.Qwen2Config(**{**CONFIG.__dict__, "tie_embeddings": False})
BOTH = pytest.mark.parametrize("config", [CONFIG, QWEN2], ids=["llama", "qwen2"])
FFI, XLA = model_ops.get("ffi"), model_ops.get("xla")
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(autouse=True)
def exact_matmuls():
    with jax.default_matmul_precision("float32"):
        yield


def _tokens(seed, shape, vocab=CONFIG.vocab_size):
    return jax.random.randint(jax.random.key(seed), shape, 0, vocab, jnp.int32)


@functools.cache
def _params(config=CONFIG):
    """Fresh params plus noise, so the RMSNorm scales are not all one (and biases, where the
    family has them, not all zero)."""
    params = family_of(config).init(config, jax.random.key(1))
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    return tree.unflatten([x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def _reference_logits(params, tokens, config):
    """LlamaForCausalLM's forward written out in jnp from its definition, sharing no code with
    blujax: RMSNorm (float32 statistics), rotate_half RoPE with theta^(-2i/D) frequencies,
    repeat_kv, causal softmax attention, SwiGLU, the tied or untied head; with the q, k and v
    projections' biases where params has them (Qwen2ForCausalLM's one difference)."""
    D, H, KV = config.head_dim, config.n_head, config.n_kv_head
    B, T = tokens.shape
    eps = config.norm_eps

    def rms(x, w):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w

    freq = 1.0 / config.rope_theta ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D)
    ang = jnp.arange(T, dtype=jnp.float32)[:, None] * freq[None]
    cos = jnp.concatenate([jnp.cos(ang)] * 2, -1)[None, :, None]
    sin = jnp.concatenate([jnp.sin(ang)] * 2, -1)[None, :, None]

    def rotate(x):
        half = jnp.concatenate([-x[..., D // 2:], x[..., :D // 2]], -1)
        return x * cos + half * sin

    x = params["wte"][tokens]
    b = params["blocks"]

    def project(h, name, i):
        bias = b.get("b" + name[1:])
        return h @ b[name][i] + (0.0 if bias is None else bias[i])

    for i in range(config.n_layer):
        h = rms(x, b["attn_norm"][i])
        q = rotate(project(h, "wq", i).reshape(B, T, H, D))
        k = rotate(project(h, "wk", i).reshape(B, T, KV, D))
        v = project(h, "wv", i).reshape(B, T, KV, D)
        k, v = (jnp.repeat(t, H // KV, axis=2) for t in (k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(D)
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(B, T, H * D)
        x = x + a @ b["wo"][i]
        h = rms(x, b["mlp_norm"][i])
        gate, up = h @ b["w_gate_up"][i][:, 0], h @ b["w_gate_up"][i][:, 1]
        x = x + (jax.nn.silu(gate) * up) @ b["w_down"][i]
    head = params.get("lm_head", params["wte"])
    return rms(x, params["norm_f"]) @ head.T


@BOTH
@pytest.mark.parametrize("ops", [FFI, XLA], ids=["ffi", "xla"])
def test_forward_matches_an_independent_transcription(ops, config):
    tokens = _tokens(0, (2, 48))
    got = family_of(config).forward(_params(config), tokens, config=config, ops=ops)
    rel_close(got, _reference_logits(_params(config), tokens, config), 1e-5)


@BOTH
def test_loss_and_grads_match_xla(config):
    tokens = _tokens(3, (2, 33))

    def f(ops):
        return jax.jit(jax.value_and_grad(functools.partial(train.loss_fn, config=config,
                                                            ops=ops)))(
            _params(config), tokens[:, :-1], tokens[:, 1:])

    (loss, grads), (loss_x, grads_x) = f(FFI), f(XLA)
    np.testing.assert_allclose(float(loss), float(loss_x), rtol=1e-6)
    rel_close(grads, grads_x, 1e-5)


@pytest.mark.slow
def test_twenty_steps_on_our_kernels_equal_xla():
    """The issue's fidelity check: llama-tiny's losses on --ops ffi equal --ops xla's to 1e-5
    (float32, CPU) for 20 steps."""
    config = llama.PRESETS["llama-tiny"]
    tcfg = train.TrainConfig(steps=20, warmup_steps=2, learning_rate=3e-3, dtype="f32")
    losses = {}
    for name, ops in (("ffi", FFI), ("xla", XLA)):
        state = train.init_state(config, tcfg, jax.random.key(0), ops)
        step = train.make_train_step(config, tcfg, ops)
        out = []
        batch = _tokens(100, (1, 4, 33), vocab=config.vocab_size)  # one batch, to learn
        for _ in range(tcfg.steps):
            state, m = step(state, batch[..., :-1], batch[..., 1:])
            out.append(float(m["loss"]))
        losses[name] = out
    assert losses["ffi"][-1] < losses["ffi"][0] - 0.5  # it learns
    np.testing.assert_allclose(losses["ffi"], losses["xla"], rtol=1e-5)


@BOTH
@pytest.mark.parametrize("ops", [FFI, XLA], ids=["ffi", "xla"])
def test_kv_cache_sampling_equals_full_recompute(ops, config):
    prompt = _tokens(5, (2, 7))
    kwargs = dict(config=config, key=jax.random.key(3), max_new_tokens=9, temperature=0.8,
                  top_k=20, ops=ops)
    cached = sample.generate(_params(config), prompt, **kwargs)
    full = sample.generate(_params(config), prompt, use_cache=False, **kwargs)
    assert cached.shape == (2, 16)
    np.testing.assert_array_equal(cached, full)


def test_untied_head_and_rope_scaling():
    config = llama.LlamaConfig(n_layer=1, n_head=2, n_kv_head=1, n_embd=128, ffn_hidden=96,
                               block_size=64, vocab_size=300, padded_vocab_size=384,
                               tie_embeddings=False, rope_scaling=(4.0, 1.0, 8.0, 64))
    params = llama.init(config, jax.random.key(0))
    assert "lm_head" in params and params["lm_head"].shape == (384, 128)
    freq = llama.inv_freq(config)
    plain = llama.inv_freq(llama.LlamaConfig(**{**config.__dict__, "rope_scaling": None}))
    # Llama 3's scaling: the long wavelengths slowed by the factor, the short ones kept.
    assert freq[0] == plain[0] and freq[-1] == pytest.approx(plain[-1] / 4.0)
    tokens = _tokens(1, (1, 20), vocab=300)
    a = llama.forward(params, tokens, config=config, ops=FFI)
    b = llama.forward(params, tokens, config=config, ops=XLA)
    rel_close(a, b, 1e-5)


def test_hf_conversion_round_trips():
    params = jax.tree.map(np.asarray, _params())
    hf = llama.to_hf(params, CONFIG)
    assert hf["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 64, 256)  # (out, in)
    assert hf["model.layers.0.mlp.gate_proj.weight"].shape == (320, 256)
    assert "lm_head.weight" not in hf  # tied
    back = llama.from_hf(hf, CONFIG)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(back), jax.tree.leaves(params)):
        if jax.tree_util.keystr(path) == "['wte']":
            b = np.where(np.arange(512)[:, None] < 500, b, 0.0)  # padded rows come back zero
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))
    assert llama.config_from_hf(llama.hf_config(CONFIG)) == CONFIG
    # transformers before 5 writes rope_theta and rope_scaling instead of rope_parameters.
    scaled = llama.LlamaConfig(**{**CONFIG.__dict__, "rope_scaling": (8.0, 1.0, 4.0, 32),
                                  "rope_theta": 5e5})
    old = {k: v for k, v in llama.hf_config(scaled).items() if k != "rope_parameters"}
    assert llama.config_from_hf(old) == scaled == llama.config_from_hf(llama.hf_config(scaled))


@pytest.mark.parametrize("change,words", [
    ({"hidden_act": "gelu"}, "hidden_act"), ({"attention_bias": True}, "attention_bias"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}}, "yarn"),
    ({"pretraining_tp": 2}, "pretraining_tp"),
    ({"head_dim": 32}, "head_dim")])
def test_hf_configs_we_cannot_honour_are_refused(change, words):
    with pytest.raises(ValueError, match=words):
        llama.config_from_hf({**llama.hf_config(CONFIG), **change})


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_fixture_logits_match_transformers(name):
    """transformers' own LlamaForCausalLM (GQA, RMSNorm scales away from 1, Llama 3 rope
    scaling, an untied head) and Qwen2ForCausalLM (q/k/v biases, a RoPE theta neither
    default, a tied head): their logits from our import, on both namespaces."""
    fixture = FIXTURES / f"hf_{name}_tiny"
    if not (fixture / "model.safetensors").is_file():
        pytest.fail(f"{fixture} is missing: make it with scripts/make_fixtures.py --family "
                    f"{name}")
    pre = interop.load_pretrained(fixture)
    assert pre.family == name and pre.config.n_kv_head == 1
    assert ("lm_head" in pre.params) == (name == "llama")
    want = np.load(fixture / "expected.npz")
    tokens = jnp.asarray(want["tokens"])
    for ops in (FFI, XLA):
        logits = family_of(pre.config).forward(jax.device_put(pre.params), tokens,
                                               config=pre.config, ops=ops)
        np.testing.assert_allclose(np.asarray(logits)[..., :pre.config.vocab_size],
                                   want["logits"], atol=2e-5, rtol=1e-5)


@BOTH
def test_export_hf_then_import_is_exact(tmp_path, config):
    family = family_of(config)
    params = jax.tree.map(np.asarray, _params(config))
    interop.export_hf(params, config, tmp_path / "hf", tokenizer=False)
    hf = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf["model_type"] == family.NAME and hf["num_key_value_heads"] == 2
    assert hf["architectures"] == [family.HF_ARCHITECTURE]
    back = interop.load_pretrained(tmp_path / "hf")
    assert back.config == config
    a = family.forward(back.params, _tokens(0, (1, 16)), config=config, ops=XLA)
    b = family.forward(params, _tokens(0, (1, 16)), config=config, ops=XLA)
    # The padded vocabulary rows do not travel (they come back zero).
    np.testing.assert_array_equal(a[..., :config.vocab_size], b[..., :config.vocab_size])


def _devices():
    devices = jax.devices()
    return devices if len(devices) >= 8 else jax.devices("cpu")


@pytest.mark.slow
@pytest.mark.parametrize("config,mesh_shape", [
    (CONFIG, (2, 2, 2)), (CONFIG, (1, 2, 4)), (CONFIG, (8, 1, 1)), (QWEN2, (2, 2, 2)),
    (QWEN2, (1, 4, 1))], ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple)
    else family_of(x).NAME)
def test_mesh_loss_and_grads_match_one_device(config, mesh_shape):
    """Qwen2 on tensor 4: its 2 KV heads (and their biases) replicated over it."""
    from blujax import sharding
    devices = _devices()[:int(np.prod(mesh_shape))]
    mesh = sharding.make_mesh(*mesh_shape, devices=devices)
    tokens = _tokens(3, (8, 33))
    with jax.default_device(devices[0]):
        f = train.make_value_and_grad(config, FFI, mesh)
        loss, grads = f(jax.device_put(_params(config)), tokens[:, :-1], tokens[:, 1:])
        loss_1, grads_1 = jax.jit(jax.value_and_grad(functools.partial(
            train.loss_fn, config=config, ops=FFI)))(_params(config), tokens[:, :-1],
                                                     tokens[:, 1:])
    np.testing.assert_allclose(float(loss), float(loss_1), rtol=1e-5)
    rel_close(train.gather(grads), grads_1, 1e-5)
