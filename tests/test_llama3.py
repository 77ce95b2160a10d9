"""Llama 3 8B on one host, the model side: the llama-8b preset is Meta's 8B (its parameter count
and Llama 3.1's rope frequencies), Meta's config.json maps onto it, a folder as Meta publishes
one (bfloat16 safetensors shards with their index, config.json of rope_theta, rope_scaling and
torch_dtype) imports, and a model whose vocabulary is larger than its tokenizer's (llama-8b
trained here on GPT-2's 50257 tokens) passes the data, sampling and export paths.

tests/fixtures/hf_llama3_tiny is such a folder of a small random transformers LlamaForCausalLM
with the logits transformers computed from its bfloat16 weights (scripts/make_fixtures.py
--family llama3, run where torch and transformers are); its test skips until it is there."""

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from blujax import interop, model, sample, train, vocab
from blujax import data as data_lib
from blujax.data import tokenizer as tokenizer_lib
from blujax.model import llama
from blujax.model import ops as model_ops

FFI, XLA = model_ops.get("ffi"), model_ops.get("xla")
FIXTURE = Path(__file__).parent / "fixtures" / "hf_llama3_tiny"
LLAMA3_8B_PARAMS = 8_030_261_248  # Meta's count, vocabulary 128256, head untied
# meta-llama/Llama-3.1-8B's config.json, as the hub has it.
META_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256}
# A small Llama of Meta's kind: untied, theta 5e5, the scaling's original length (16) below
# the positions used, so that the scaled frequencies matter.
SMALL = llama.LlamaConfig(n_layer=2, n_head=2, n_kv_head=1, n_embd=128, ffn_hidden=384,
                          block_size=64, vocab_size=1000, padded_vocab_size=1024,
                          rope_theta=500000.0, rope_scaling=(8.0, 1.0, 4.0, 16),
                          tie_embeddings=False)


@pytest.fixture(autouse=True)
def exact_matmuls():
    with jax.default_matmul_precision("float32"):
        yield


# --------------------------------------------------------------------------------------------
# The preset


def test_llama_8b_is_llama3_8b():
    config = model.get_config("llama-8b")
    shapes = jax.eval_shape(lambda k: llama.init(config, k), jax.random.key(0))  # nothing made
    assert sum(x.size for x in jax.tree.leaves(shapes)) == LLAMA3_8B_PARAMS
    assert shapes["lm_head"].shape == shapes["wte"].shape == (128256, 4096)
    assert shapes["blocks"]["wk"].shape == (32, 4096, 8 * 128)  # 8 KV heads of 128
    assert config.padded_vocab_size == vocab.padded(128256) == 128256
    assert (config.block_size, config.rope_theta, config.norm_eps) == (8192, 500000.0, 1e-5)
    # A run's config.json keeps it (rope_scaling comes back from a JSON list).
    assert model.config_from_dict(json.loads(json.dumps(model.config_to_dict(config)))) \
        == config


def _meta_scaling(freqs, factor, low, high, original):
    """Meta's apply_scaling (llama-models, Llama 3.1), frequency by frequency as written."""
    low_wavelen, high_wavelen = original / low, original / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(freq)
        elif wavelen > low_wavelen:
            out.append(freq / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


def test_llama_8b_rope_is_llama31_scaling():
    config = llama.PRESETS["llama-8b"]
    got = llama.inv_freq(config)
    plain = [500000.0 ** (-i / 64) for i in range(64)]  # theta^(-2i / 128)
    np.testing.assert_allclose(got, _meta_scaling(plain, 8.0, 1.0, 4.0, 8192), rtol=1e-12)
    # By hand: wavelengths under 2048 tokens kept (pairs 0..28), over 8192 slowed 8x (35..63),
    # blended between. Pair 32: freq 5e5^-0.5, wavelength 2 pi sqrt(5e5) = 4442.88 tokens,
    # smooth (8192 / 4442.88 - 1) / 3 = 0.281283: freq x (0.125 + 0.875 x 0.281283).
    assert got[0] == 1.0 and got[28] == pytest.approx(plain[28], rel=1e-12)
    assert got[35] == pytest.approx(plain[35] / 8, rel=1e-12)
    assert got[63] == pytest.approx(3.0689259889e-07, rel=1e-9)
    assert got[32] == pytest.approx(5e5 ** -0.5 * 0.37112228, rel=1e-7)
    assert got[32] == pytest.approx(5.2484616099e-04, rel=1e-9)


# --------------------------------------------------------------------------------------------
# Meta's config.json


def test_meta_config_json_is_the_8b_preset():
    """Every key of Meta's config.json is taken (bos/eos, dropout, initializer_range and the
    like are read by nothing of ours); the shape is llama-8b's but for block_size, which an
    import takes from max_position_embeddings (131072) and the preset keeps at Llama 3's
    8192, the length it trains at."""
    fields = llama.hf.config_fields(META_8B)
    assert fields["rope_scaling"] == (8.0, 1.0, 4.0, 8192) and fields["block_size"] == 131072
    got = llama.config_from_hf(META_8B)
    assert got == dataclasses.replace(llama.PRESETS["llama-8b"], block_size=131072)
    # Llama 3 (not 3.1): no scaling, 8192 positions: the preset but for the scaling.
    llama3 = {**META_8B, "rope_scaling": None, "max_position_embeddings": 8192}
    assert llama.config_from_hf(llama3) == dataclasses.replace(llama.PRESETS["llama-8b"],
                                                               rope_scaling=None)
    # An Instruct model's eos list, and transformers 5's spelling of the same file.
    assert llama.config_from_hf({**META_8B, "eos_token_id": [128001, 128008, 128009]}) == got
    v5 = {k: v for k, v in META_8B.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**META_8B["rope_scaling"], "rope_theta": 500000.0}
    assert llama.config_from_hf(v5) == got


@pytest.mark.parametrize("change,words", [
    ({"attention_bias": True}, "attention_bias = true is not supported"),
    ({"mlp_bias": True}, "mlp_bias = true is not supported"),
    ({"pretraining_tp": 2}, "pretraining_tp 2 is not supported")])
def test_meta_configs_we_cannot_honour_are_refused(change, words):
    with pytest.raises(ValueError, match=words) as e:
        llama.config_from_hf({**META_8B, **change})
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------------------
# A folder as Meta publishes one


def _params(config, seed=0):
    """Random float32 params, every leaf non-trivial, the padded vocabulary rows zero."""
    shapes = jax.eval_shape(lambda k: llama.init(config, k), jax.random.key(0))
    rng = np.random.default_rng(seed)
    p = jax.tree.map(lambda s: rng.normal(0.0, 0.1, s.shape).astype(np.float32), shapes)
    for name in ("wte", "lm_head"):
        p[name][config.vocab_size:] = 0.0
    return p


def _bf16(x):
    return np.asarray(x).astype(ml_dtypes.bfloat16)


def _meta_folder(folder: Path, config, params, shards: int = 3) -> dict:
    """params as Meta publishes them: bfloat16 tensors over `shards` safetensors files listed
    in model.safetensors.index.json, config.json of Meta's keys (no head_dim, rope_theta and
    rope_scaling, torch_dtype, an eos list). Returns the config.json."""
    tensors = {k: _bf16(v) for k, v in llama.to_hf(params, config).items()}
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[i::shards]}
        save_file(part, str(folder / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    index = {"metadata": {"total_size": sum(x.nbytes for x in tensors.values())},
             "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    factor, low, high, original = config.rope_scaling
    hf = {**META_8B, "hidden_size": config.n_embd, "intermediate_size": config.ffn_hidden,
          "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
          "num_key_value_heads": config.n_kv_head, "vocab_size": config.vocab_size,
          "max_position_embeddings": config.block_size, "bos_token_id": 997,
          "eos_token_id": [998, 999], "rope_theta": config.rope_theta,
          "rope_scaling": {**META_8B["rope_scaling"], "factor": factor, "low_freq_factor": low,
                           "high_freq_factor": high,
                           "original_max_position_embeddings": original}}
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    return hf


def test_a_meta_style_folder_imports(tmp_path):
    """Sharded bfloat16 safetensors with their index and Meta's config.json: the config as
    written, the weights the bfloat16 values exactly (widened to float32)."""
    params = _params(SMALL)
    hf = _meta_folder(tmp_path, SMALL, params)
    assert "head_dim" not in hf and "rope_parameters" not in hf
    pre = interop.load_pretrained(tmp_path)
    assert pre.family == "llama" and pre.config == SMALL and pre.tokenizer is None
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(pre.params),
                                 jax.tree.leaves(params)):
        assert got.dtype == np.float32, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(got, _bf16(want).astype(np.float32),
                                      err_msg=jax.tree_util.keystr(path))
    # A shard the index lists, gone: named.
    (tmp_path / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(interop.InteropError, match="model-00002-of-00003.safetensors: missing"):
        interop.load_pretrained(tmp_path)


def _loss(logits, tokens):
    """transformers' loss: the mean next-token cross-entropy (float64)."""
    x = np.asarray(logits, np.float64)[:, :-1]
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return -np.take_along_axis(logp, tokens[:, 1:, None], -1).mean()


def test_fixture_logits_match_transformers():
    """transformers' own LlamaForCausalLM as Meta publishes Llama 3.1: config.json of Meta's
    keys, bfloat16 weights in shards with an index. The reference was computed in float32
    from the bfloat16 weights, which we read as float32 exactly: float32 tolerances."""
    if not (FIXTURE / "model.safetensors.index.json").is_file():
        pytest.skip(f"{FIXTURE} is not made yet: run `python scripts/make_fixtures.py --family "
                    f"llama3 --out tests/fixtures/hf_llama3_tiny` where torch and "
                    f"transformers are installed, and commit it")
    hf = json.loads((FIXTURE / "config.json").read_text())
    assert set(hf) == set(META_8B)  # Meta's keys, no more (no rope_parameters, no dtype)
    index = json.loads((FIXTURE / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    pre = interop.load_pretrained(FIXTURE)
    c = pre.config
    assert pre.family == "llama" and not c.tie_embeddings and "lm_head" in pre.params
    assert (c.n_head, c.n_kv_head, c.head_dim, c.n_embd) == (2, 1, 64, 128)
    assert (c.vocab_size, c.padded_vocab_size, c.block_size) == (1000, 1024, 64)
    assert c.rope_theta == 500000.0 and c.rope_scaling == (8.0, 1.0, 4.0, 16)
    for leaf in jax.tree.leaves(pre.params):  # bfloat16 values, widened
        np.testing.assert_array_equal(leaf, _bf16(leaf).astype(np.float32))
    want = np.load(FIXTURE / "expected.npz")
    tokens = jnp.asarray(want["tokens"])
    for ops in (FFI, XLA):
        logits = llama.forward(jax.device_put(pre.params), tokens, config=c, ops=ops)
        logits = np.asarray(logits)[..., :c.vocab_size]
        np.testing.assert_allclose(logits, want["logits"], atol=2e-5, rtol=1e-5)
        assert _loss(logits, want["tokens"]) == pytest.approx(float(want["loss"]), rel=1e-5)


# --------------------------------------------------------------------------------------------
# A vocabulary larger than the tokenizer's (llama-8b trained here on GPT-2's tokens)

# llama-8b's vocabulary on a model small enough for a CPU.
WIDE = llama.LlamaConfig(n_layer=1, n_head=1, n_kv_head=1, n_embd=64, ffn_hidden=64,
                         block_size=64, vocab_size=128256, padded_vocab_size=128256,
                         tie_embeddings=False)


def test_gpt2_tokens_train_a_larger_vocabulary(tmp_path, enc):
    """What `train --model llama-8b` does with text: GPT-2's tokenizer (for_text accepts a
    tokenizer of fewer tokens than the model), uint16 shards, every token checked against the
    model's 128256, a loss; sampling's ids past GPT-2's are dropped in decoding."""
    gpt2 = tokenizer_lib.gpt2()
    assert tokenizer_lib.for_text(gpt2, WIDE.vocab_size, "llama-8b") is gpt2
    assert tokenizer_lib.for_text(None, WIDE.vocab_size, "llama-8b") is gpt2
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.\n\n" * 400, encoding="utf-8")
    source = data_lib.resolve(str(text), tokenizer=gpt2)
    assert source.tokenizer == gpt2.identity()
    assert data_lib.read_format(source.train[0])[1] == data_lib.TOKEN_DTYPE  # uint16
    with data_lib.DataLoader(source.train, batch_size=2, seq_len=32, vocab_size=WIDE.vocab_size,
                             process_index=0, process_count=1) as loader:
        loader.check_all()
        inputs, targets = next(loader)
    assert int(inputs.max()) < vocab.GPT2_VOCAB_SIZE
    params = llama.init(WIDE, jax.random.key(0))
    loss = train.loss_fn(params, jnp.asarray(inputs), jnp.asarray(targets), config=WIDE, ops=XLA)
    assert abs(float(loss) - math.log(WIDE.vocab_size)) < 0.5  # near uniform over 128256
    out = sample.generate(params, jnp.asarray(inputs[:1, :4]), config=WIDE,
                          key=jax.random.key(1), max_new_tokens=4, ops=XLA)
    assert out.shape == (1, 8)
    assert gpt2.decode([464, vocab.GPT2_VOCAB_SIZE + 5, 2068]) == gpt2.decode([464, 2068])


def test_export_of_a_larger_vocabulary_keeps_gpt2s_tokenizer(tmp_path, enc):
    """An export of llama-8b trained here: config.json names GPT-2's end-of-text, and GPT-2's
    tokenizer files go beside it (where tiktoken's cache has them); without the tokenizer given,
    a vocabulary of 128256 is not taken for GPT-2's."""
    params = jax.tree.map(np.asarray, llama.init(WIDE, jax.random.key(0)))
    out = interop.export_hf(params, WIDE, tmp_path / "hf", tokenizer=tokenizer_lib.gpt2())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == 128256 and cfg["bos_token_id"] == cfg["eos_token_id"] == 50256
    if interop.gpt2_tokenizer_files() is not None:
        assert {"vocab.json", "merges.txt", "tokenizer_config.json"} <= {
            p.name for p in out.iterdir()}
        assert tokenizer_lib.load_tokenizer(out).is_gpt2
    plain = interop.export_hf(params, WIDE, tmp_path / "plain")  # tokenizer=True
    cfg = json.loads((plain / "config.json").read_text())
    assert cfg["eos_token_id"] is None and not (plain / "vocab.json").exists()


def test_large_models_recompute_by_default():
    """llama-8b trains with "selective" recomputation unless told (57 GB of activations a device
    at T = 8192 without it, benchmarks.memory); llama-1b and smaller with none."""
    assert model.default_remat(model.get_config("llama-8b")) == "selective"
    assert model.default_remat(model.get_config("llama-1b")) == "none"
    assert model.default_remat(model.get_config("gpt2")) == "none"
