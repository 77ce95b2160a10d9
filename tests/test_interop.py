"""blujax.interop: Hugging Face folders, hub names and llm.c model files, in and out.

tests/fixtures/hf_gpt2_tiny is a small random transformers GPT2LMHeadModel with the logits and
loss transformers computed on fixed tokens (scripts/make_fixtures.py), so these tests check our
model against transformers without installing it. The tokenizer part of one test reads
TIKTOKEN_CACHE_DIR from the environment and skips that part without it.
"""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from blujax import interop, train
from blujax.model import gpt2
from blujax.model import ops as model_ops

FIXTURE = Path(__file__).parent / "fixtures" / "hf_gpt2_tiny"
# A vocabulary that is not a multiple of 128, so the padding is exercised.
CONFIG = gpt2.GPT2Config(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=300,
                         padded_vocab_size=384)


@pytest.fixture(autouse=True)
def exact_matmuls():
    # On a GPU, XLA's float32 dots default to TF32; the fixture was computed in full float32.
    with jax.default_matmul_precision("float32"):
        yield


def _params(config=CONFIG, seed=0):
    """Random float32 params, every leaf non-trivial, the padded vocabulary rows zero."""
    shapes = jax.eval_shape(lambda k: gpt2.init(config, k), jax.random.key(0))
    rng = np.random.default_rng(seed)
    p = jax.tree.map(lambda s: rng.normal(0.0, 0.1, s.shape).astype(np.float32), shapes)
    p["wte"][config.vocab_size:] = 0.0
    return p


def _assert_same(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert x.dtype == np.float32 and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def _one_line(excinfo, *words):
    msg = str(excinfo.value)
    assert "\n" not in msg and msg, msg
    for w in words:
        assert str(w) in msg, msg
    return msg


# --------------------------------------------------------------------------------------------
# Against transformers (the committed fixture)


@pytest.mark.parametrize("ops", ["ffi", "xla"])
def test_fixture_logits_and_loss_match_transformers(ops):
    pre = interop.load_pretrained(FIXTURE)
    want = np.load(FIXTURE / "expected.npz")
    assert pre.family == "gpt2" and pre.source == {"kind": "hf", "path": str(FIXTURE),
                                                    "name": FIXTURE.name}
    assert pre.config == gpt2.GPT2Config(n_layer=2, n_head=2, n_embd=128, block_size=64,
                                         vocab_size=1000, padded_vocab_size=1024)
    assert pre.params["wte"].shape == (1024, 128) and not pre.params["wte"][1000:].any()
    ns = model_ops.get(ops)
    # On the CPU kernels, in float32 (a GPU's float32 products are TF32 by default);
    # test_interop_cli.py runs the fixture on the default device.
    with jax.default_device(jax.devices("cpu")[0]):
        params = jax.tree.map(jnp.asarray, pre.params)
        tokens = jnp.asarray(want["tokens"])
        logits = np.asarray(gpt2.forward(params, tokens, config=pre.config, ops=ns))
        # transformers' loss: the mean next-token cross-entropy over the real vocabulary.
        loss = train.loss_fn(params, tokens[:, :-1], tokens[:, 1:], config=pre.config, ops=ns)
    # float32 rounding apart: we measured 4e-6 at most on logits of up to 7.4, and the loss
    # within 2.4e-7 (relative).
    np.testing.assert_allclose(logits[..., :1000], want["logits"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(loss), float(want["loss"]), rtol=1e-6)


def test_export_hf_writes_what_save_pretrained_wrote(tmp_path):
    pre = interop.load_pretrained(FIXTURE)
    out = interop.export_hf(pre.params, pre.config, tmp_path / "hf")
    assert out == tmp_path / "hf"
    ref = {k: v for k, v in load_file(FIXTURE / "model.safetensors").items()
           if not k.endswith((".attn.bias", ".attn.masked_bias", "lm_head.weight"))}
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert got[k].dtype == np.float32
        np.testing.assert_array_equal(got[k], ref[k])
    with safe_open(out / "model.safetensors", framework="np") as f:
        assert f.metadata() == {"format": "pt"}  # transformers refuses a file without it
    cfg, ref_cfg = (json.loads((d / "config.json").read_text()) for d in (out, FIXTURE))
    for key in ("model_type", "architectures", "vocab_size", "n_positions", "n_embd", "n_layer",
                "n_head", "n_inner", "activation_function", "layer_norm_epsilon",
                "tie_word_embeddings", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
                "reorder_and_upcast_attn"):
        assert cfg[key] == ref_cfg[key], key
    assert not (out / "vocab.json").exists()  # not GPT-2's vocabulary


# --------------------------------------------------------------------------------------------
# Round trips


def test_export_hf_read_hf_dir_is_exact(tmp_path):
    params = _params()
    interop.export_hf(params, CONFIG, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert tensors["transformer.wte.weight"].shape == (300, 32)  # the padding dropped
    assert tensors["transformer.h.1.attn.c_attn.weight"].shape == (32, 96)  # Conv1D: (in, out)
    np.testing.assert_array_equal(tensors["transformer.h.1.mlp.c_proj.weight"],
                                  params["blocks"]["mlp_proj"]["w"][1])
    back = interop.read_hf_dir(tmp_path)
    assert back.config == CONFIG and back.family == "gpt2"
    _assert_same(back.params, params)


def test_reads_the_hubs_layout_and_half_precision(tmp_path):
    """The hub's gpt2 file: no "transformer." prefix, the attention-mask buffers saved with the
    weights, sometimes lm_head.weight beside its tied twin; float16 and bfloat16 files widen."""
    params = _params()
    interop.export_hf(params, CONFIG, tmp_path)
    tensors = {k.removeprefix("transformer."): v
               for k, v in load_file(tmp_path / "model.safetensors").items()}
    for i in range(CONFIG.n_layer):
        tensors[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, 16, 16), np.float32))
        tensors[f"h.{i}.attn.masked_bias"] = np.asarray(-1e4, np.float32)
    tensors["lm_head.weight"] = tensors["wte.weight"]
    for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        save_file({k: v.astype(dtype) for k, v in tensors.items()},
                  tmp_path / "model.safetensors")
        got = interop.read_hf_dir(tmp_path).params
        _assert_same(got, jax.tree.map(lambda x: x.astype(dtype).astype(np.float32), params))


def test_export_llmc_read_llmc(tmp_path):
    params = _params()
    path = interop.export_llmc(params, CONFIG, tmp_path / "m.bin")
    raw = path.read_bytes()
    assert list(np.frombuffer(raw[:32], "<i4")) == [20240326, 3, 16, 300, 2, 2, 32, 384]
    n = sum(x.size for x in jax.tree.leaves(params))
    assert len(raw) == 1024 + 4 * n
    # llm.c's layout: wte, wpe, then ln1w, ln1b, qkvw as (L, 3C, C) (torch Linear's (out, in))
    flat = np.frombuffer(raw[1024:], "<f4")
    at = params["wte"].size + params["wpe"].size + 2 * 2 * 32
    qkvw = flat[at:at + 2 * 96 * 32].reshape(2, 96, 32)
    np.testing.assert_array_equal(qkvw, params["blocks"]["attn"]["w"].reshape(2, 32, 96)
                                  .transpose(0, 2, 1))
    np.testing.assert_array_equal(flat[-32:], params["ln_f"]["b"])
    back = interop.read_llmc(path)
    assert back.config == CONFIG and back.source == {"kind": "llmc", "path": str(path),
                                                     "name": "m.bin"}
    _assert_same(back.params, params)
    assert interop.load_pretrained(path).config == CONFIG

    path16 = interop.export_llmc(params, CONFIG, tmp_path / "m16.bin", dtype="bfloat16")
    assert np.frombuffer(path16.read_bytes()[:8], "<i4")[1] == 5
    assert path16.stat().st_size == 1024 + 2 * n
    rounded = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32), params)
    _assert_same(interop.read_llmc(path16).params, rounded)


def test_llmc_other_padding_is_repadded(tmp_path):
    # A file padded to more rows than ours: the extra rows are dropped, ours come back zero.
    wide = dataclasses.replace(CONFIG, padded_vocab_size=512)
    params = _params(wide)
    params["wte"][300:] = 1.0  # junk in the file's padding
    back = interop.read_llmc(interop.export_llmc(params, wide, tmp_path / "m.bin"))
    assert back.config == CONFIG
    np.testing.assert_array_equal(back.params["wte"][:300], params["wte"][:300])
    assert not back.params["wte"][300:].any()


def test_tokenizer_files(tmp_path, monkeypatch):
    config = dataclasses.replace(CONFIG, vocab_size=50257, padded_vocab_size=50304)
    params = _params(config)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    out = interop.export_hf(params, config, tmp_path / "none")  # not found: no error
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["vocab_size"] == 50257 and cfg["bos_token_id"] == cfg["eos_token_id"] == 50256
    monkeypatch.undo()
    if interop.gpt2_tokenizer_files() is None:
        pytest.skip("GPT-2's tokenizer files are not in tiktoken's cache (TIKTOKEN_CACHE_DIR)")
    out = interop.export_hf(params, config, tmp_path / "tok")
    assert {p.name for p in out.iterdir()} == {
        "config.json", "model.safetensors", "vocab.json", "merges.txt",
        "tokenizer_config.json", "special_tokens_map.json"}
    vocab = json.loads((out / "vocab.json").read_text(encoding="utf-8"))
    assert len(vocab) == 50257 and vocab["<|endoftext|>"] == 50256
    assert (out / "merges.txt").read_text(encoding="utf-8").startswith("#version: 0.2\n")
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 16
    assert not {"vocab.json", "merges.txt"} & {
        p.name for p in interop.export_hf(params, config, tmp_path / "no",
                                          tokenizer=False).iterdir()}


# --------------------------------------------------------------------------------------------
# Hub names


def _fake_hub_cache(root: Path, name: str) -> Path:
    """huggingface_hub's cache layout holding the fixture as the hub model `name`."""
    repo = root / f"models--{name.replace('/', '--')}"
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(FIXTURE / f, snap / f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    return snap


def test_hub_name_from_the_cache_offline(tmp_path, monkeypatch):
    from huggingface_hub import constants

    snap = _fake_hub_cache(tmp_path, "gpt2")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    pre = interop.load_pretrained("gpt2")
    assert pre.source == {"kind": "hub", "path": str(snap), "name": "gpt2"}
    _assert_same(pre.params, interop.read_hf_dir(FIXTURE).params)


def test_hub_name_offline_is_one_clear_line(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # empty
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(interop.InteropError) as e:
        interop.load_pretrained("gpt2-medium")
    _one_line(e, "cannot download gpt2-medium", "no network?", "--init-from DIR")


def test_hub_name_connection_error(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub import constants, errors

    def download(repo, filename, local_files_only=False, **kw):
        if local_files_only:
            raise errors.LocalEntryNotFoundError("not cached")
        raise ConnectionError("connection refused")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setattr(interop, "_resolves", lambda url: True)
    with pytest.raises(interop.InteropError) as e:
        interop.load_pretrained("openai-community/gpt2")
    _one_line(e, "cannot download openai-community/gpt2", "no network?")


# --------------------------------------------------------------------------------------------
# Errors a user can act on


def _hf_dir(tmp_path, **config_changes):
    folder = tmp_path / "m"
    shutil.copytree(FIXTURE, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(config_changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("change, words", [
    ({"activation_function": "relu"}, ["activation_function 'relu'", "gelu_new"]),
    ({"layer_norm_epsilon": 1e-6}, ["layer_norm_epsilon 1e-06", "1e-05"]),
    ({"scale_attn_by_inverse_layer_idx": True}, ["scale_attn_by_inverse_layer_idx"]),
    ({"reorder_and_upcast_attn": True}, ["reorder_and_upcast_attn"]),
    ({"n_inner": 100}, ["n_inner 100", "512"]),
    ({"tie_word_embeddings": False}, ["tie_word_embeddings"]),
    ({"model_type": "bert"}, ["model_type 'bert'", "gpt2"]),
    ({"n_layer": 3}, ["h.2.ln_1.weight is missing"]),
    ({"n_embd": 32}, ["has shape", "(1000, 32)"]),
])
def test_config_we_cannot_honour(tmp_path, change, words):
    folder = _hf_dir(tmp_path, **change)
    with pytest.raises(interop.InteropError) as e:
        interop.load_pretrained(folder)
    _one_line(e, folder, *words)


def test_missing_files_and_bad_tensors(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    with pytest.raises(interop.InteropError) as e:
        interop.load_pretrained(folder)
    _one_line(e, folder, "no config.json")
    shutil.copy(FIXTURE / "config.json", folder)
    with pytest.raises(interop.InteropError) as e:
        interop.read_hf_dir(folder)
    _one_line(e, folder, "no model.safetensors")
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(interop.InteropError) as e:
        interop.read_hf_dir(folder)
    _one_line(e, folder / "model.safetensors", "not a readable safetensors file")
    tensors = load_file(FIXTURE / "model.safetensors")
    tensors["lm_head.weight"] = tensors["transformer.wte.weight"] + 1
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(interop.InteropError) as e:
        interop.read_hf_dir(folder)
    _one_line(e, "lm_head.weight differs", "ties")
    with pytest.raises(interop.InteropError) as e:
        interop.load_pretrained(folder / "model.safetensors")
    _one_line(e, "pass the folder")
    with pytest.raises(interop.InteropError) as e:
        interop.load_pretrained(tmp_path / "nothing")
    _one_line(e, tmp_path / "nothing", "not a hub name", "gpt2-xl")


def test_bad_llmc_files(tmp_path):
    path = interop.export_llmc(_params(), CONFIG, tmp_path / "m.bin")
    raw = path.read_bytes()
    bad = tmp_path / "bad.bin"
    bad.write_bytes(raw[:-4])
    with pytest.raises(interop.InteropError) as e:
        interop.read_llmc(bad)
    _one_line(e, bad, "truncated", len(raw) - 4, len(raw))
    bad.write_bytes(raw[:100])
    with pytest.raises(interop.InteropError) as e:
        interop.load_pretrained(bad)
    _one_line(e, bad, "100 bytes", "1024-byte")
    header = np.frombuffer(raw[:1024], "<i4").copy()
    for field, value, words in ((0, 20240520, ["bad magic number 20240520", "token shard"]),
                                (1, 2, ["version 2", "3: float32 or 5: bfloat16"]),
                                (6, 0, ["corrupt header", "n_embd"])):
        h = header.copy()
        h[field] = value
        bad.write_bytes(h.tobytes() + raw[1024:])
        with pytest.raises(interop.InteropError) as e:
            interop.read_llmc(bad)
        _one_line(e, bad, *words)


def test_bad_exports(tmp_path):
    params = _params()
    with pytest.raises(interop.InteropError) as e:
        interop.export_llmc(params, CONFIG, tmp_path / "m.bin", dtype="float16")
    _one_line(e, "float32 or bfloat16", "'float16'")
    with pytest.raises(interop.InteropError) as e:
        interop.export_llmc(params, dataclasses.replace(CONFIG, block_size=32), tmp_path / "m.bin")
    _one_line(e, tmp_path / "m.bin", "params['wpe'] has shape (16, 32)", "(32, 32)")
    (tmp_path / "file").write_text("")
    with pytest.raises(interop.InteropError) as e:
        interop.export_hf(params, CONFIG, tmp_path / "file")
    _one_line(e, tmp_path / "file", "not a folder")
