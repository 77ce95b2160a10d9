"""A model's own tokenizer, from text to samples: blujax.data.Tokenizer against what
transformers and tokenizers made for a small Llama of a 1000-token BPE (the committed fixture
hf_llama_bpe), and the command line that fine-tunes, evaluates, samples and exports it with its
tokenizer; GPT-2's encoding is one tokenizer among them, known by the same fingerprint however
it is loaded."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from blujax import hellaswag, interop
from blujax.data import tokenizer as tokenizer_lib
from tests.test_gpt2_cli import _run, private_cache  # noqa: F401

FIXTURE = Path(__file__).parent / "fixtures" / "hf_llama_bpe"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())


@pytest.fixture
def text(tmp_path) -> Path:
    """The fixture's text, copied: its token cache goes beside it, never into the repo."""
    path = tmp_path / "text.txt"
    shutil.copyfile(FIXTURE / "text.txt", path)
    return path


def test_gpt2_fingerprint_is_tiktokens(enc):
    assert tokenizer_lib.tiktoken_fingerprint(enc) == tokenizer_lib.GPT2_FINGERPRINT
    tok = tokenizer_lib.gpt2()
    assert (tok.vocab_size, tok.doc_token, tok.stop_tokens) == (enc.n_vocab, enc.eot_token,
                                                                (enc.eot_token,))


def test_gpt2_from_its_hugging_face_files_is_gpt2(enc, tmp_path):
    """GPT-2's vocab.json and merges.txt, read by the tokenizers library: the same tokenizer
    (fingerprint, ids, text) as tiktoken's encoding."""
    files = interop.gpt2_tokenizer_files()
    if files is None:
        pytest.skip("GPT-2's tokenizer files are not in tiktoken's cache")
    for name, path in files.items():
        shutil.copyfile(path, tmp_path / name)
    tok = tokenizer_lib.load_tokenizer(tmp_path)
    assert tok.is_gpt2 and tok.name == "gpt2" and tok.doc_token == enc.eot_token
    sample = "Hello, I'm a <|endoftext|> model.\n\n  Caf\u00e9 \u65e5\u672c"
    assert tok.encode(sample) == enc.encode_ordinary(sample)
    assert tok.decode(enc.encode_ordinary(sample)) == sample


def test_the_fixture_tokenizer_is_transformers():
    tok = tokenizer_lib.load_tokenizer(FIXTURE)
    assert (tok.vocab_size, tok.doc_token, tok.stop_tokens) == (1000, 0, (1,))
    assert not tok.is_gpt2 and tok.name == FIXTURE.name
    text = (FIXTURE / "text.txt").read_text(encoding="utf-8")
    assert tok.encode(text) == EXPECTED["text_ids"]
    assert tok.encode(EXPECTED["prompt"]) == EXPECTED["prompt_ids"]
    assert tok.decode(tok.encode(text)) == text
    # Special-token text in data is plain text, as GPT-2's encode_ordinary treats it.
    assert 0 not in tok.encode("<|begin_of_text|>")
    # Past the vocabulary (the padded embedding rows): dropped.
    assert tok.decode([*EXPECTED["prompt_ids"], 1000, 1023]) == EXPECTED["prompt"]


def test_a_fingerprint_sees_one_token_changed(tmp_path):
    spec = json.loads((FIXTURE / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[500:502]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    shutil.copyfile(FIXTURE / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    other = tokenizer_lib.load_tokenizer(tmp_path)
    assert other.fingerprint != tokenizer_lib.load_tokenizer(FIXTURE).fingerprint


def test_pretrained_carries_its_tokenizer():
    pre = interop.load_pretrained(FIXTURE)
    assert pre.tokenizer.fingerprint == tokenizer_lib.load_tokenizer(FIXTURE).fingerprint
    assert pre.config.vocab_size == 1000


def test_hellaswag_in_the_models_tokenizer(tmp_path):
    item = {"ctx": "ROMEO: What say you", "endings": ["of love?", "to me", "now", "sir"],
            "label": 0}
    path = tmp_path / "h.jsonl"
    path.write_text(json.dumps(item) + "\n")
    tok = tokenizer_lib.load_tokenizer(FIXTURE)
    [got] = hellaswag.load_items(path, tokenizer=tok)
    assert got.ctx_tokens == tuple(tok.encode(item["ctx"]))
    assert got.ending_tokens[0] == tuple(tok.encode(" of love?"))


def test_eval_on_text_equals_transformers(capsys, text, tmp_path):
    """The loss over the text as the model's tokenizer encodes it: transformers' number."""
    out = tmp_path / "eval.json"
    status, stdout, err = _run(capsys, "eval", "--init-from", FIXTURE, "--data", text, "--seq",
                               EXPECTED["seq"], "--batch", 8, "--dtype", "f32", "--json", out)
    assert status == 0, err
    result = json.loads(out.read_text())
    assert result["tokens"] == EXPECTED["rows"] * EXPECTED["seq"]
    np.testing.assert_allclose(result["val_loss"], EXPECTED["loss"], rtol=2e-5)


def test_greedy_sample_equals_transformers_generate(capsys):
    new = len(EXPECTED["greedy_ids"]) - len(EXPECTED["prompt_ids"])
    status, stdout, err = _run(capsys, "sample", "--init-from", FIXTURE, "--prompt",
                               EXPECTED["prompt"], "--temperature", 0, "--max-new-tokens", new,
                               "--dtype", "f32")
    assert status == 0, err
    assert stdout.split("--- sample 1 ---\n", 1)[1] == EXPECTED["greedy_text"] + "\n"


def test_sampling_stops_at_the_stop_token():
    from blujax.cli.generate import until_stop
    assert until_stop([5, 1, 7, 8, 1, 9], 2, (1,)) == [5, 1, 7, 8]
    assert until_stop([5, 7], 1, (1,)) == [5, 7]


def _one_line_error(status, err, *words):
    assert status == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, err


def test_gpt2_shards_refused_for_a_model_of_another_tokenizer(capsys, tmp_path, enc):
    from blujax import data
    folder = tmp_path / "shards"
    folder.mkdir()
    tokens = np.asarray(enc.encode_ordinary("To be, or not to be: that is the question. " * 40))
    data.write_shard(folder / "t_train_000000.bin", tokens % 1000)  # ids the model could take
    data.write_shard(folder / "t_val_000000.bin", tokens % 1000)
    for argv in (["train", "--init-from", FIXTURE, "--out", tmp_path / "run", "--steps", 1],
                 ["eval", "--init-from", FIXTURE]):
        status, _, err = _run(capsys, *argv, "--data", folder, "--batch", 1, "--seq", 16,
                              "--no-progress")
        _one_line_error(status, err, "GPT-2's tokenizer", FIXTURE.name)
    assert not (tmp_path / "run" / "ckpt").exists()


def test_text_refused_for_a_model_without_a_tokenizer(capsys, text, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(FIXTURE / name, bare / name)
    status, _, err = _run(capsys, "eval", "--init-from", bare, "--data", text, "--seq", 64)
    _one_line_error(status, err, "no tokenizer files", "1000 tokens")
    status, _, err = _run(capsys, "sample", "--init-from", bare, "--prompt", "ROMEO:")
    _one_line_error(status, err, "no tokenizer files")


@pytest.mark.slow
def test_fine_tune_on_text_then_eval_sample_export(capsys, text, tmp_path):
    """train --init-from on text: the run records the tokenizer and keeps a copy of its files,
    so that eval, sample, export and --resume speak it too, wherever the run folder goes."""
    run = tmp_path / "run"
    small = ["--batch", 2, "--seq", 64, "--no-progress", "--sample-tokens", 8, "--eval-every",
             2, "--eval-batches", 2, "--dtype", "f32"]
    status, stdout, err = _run(capsys, "train", "--init-from", FIXTURE, "--data", text,
                               "--out", run, "--steps", 2, "--stop-after", 1, *small)
    assert status == 0, err
    tok = tokenizer_lib.load_tokenizer(FIXTURE)
    assert json.loads((run / "config.json").read_text())["tokenizer"] == tok.identity()
    assert (run / "tokenizer" / "tokenizer.json").read_bytes() == \
        (FIXTURE / "tokenizer.json").read_bytes()
    # Shards of this tokenizer, in a cache of their own; the document begins with its bos
    # (the validation split comes first).
    from blujax import data
    source = data.resolve(text, tokenizer=tok)
    assert source.tokenizer == tok.identity()
    assert source.val[0].parent.name == f"text.txt.{tok.fingerprint[:8]}.tokens"
    with data.Shard(source.val[0], vocab_size=1000) as shard:
        assert shard.tokens[0] == tok.doc_token
        assert shard.tokens[1:9].tolist() == EXPECTED["text_ids"][:8]
    # The run moved elsewhere still speaks its tokenizer.
    moved = tmp_path / "moved"
    shutil.move(run, moved)
    status, stdout, err = _run(capsys, "train", "--resume", "--out", moved, "--no-progress")
    assert status == 0, err
    assert (moved / "samples.txt").is_file()
    status, stdout, err = _run(capsys, "eval", "--out", moved, "--data", text, "--seq", 64,
                               "--dtype", "f32")
    assert status == 0 and "val loss" in stdout, err
    status, stdout, err = _run(capsys, "sample", "--out", moved, "--prompt", "ROMEO:",
                               "--max-new-tokens", 4, "--temperature", 0)
    assert status == 0 and stdout.split("--- sample 1 ---\n", 1)[1].startswith("ROMEO:"), err
    hf = tmp_path / "hf"
    status, _, err = _run(capsys, "export", "--out", moved, "--format", "hf", "--to", hf)
    assert status == 0, err
    assert tokenizer_lib.load_tokenizer(hf).fingerprint == tok.fingerprint
    config = json.loads((hf / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (0, 1)
    # The export evaluates as the run does.
    same = ["--data", text, "--seq", 64, "--batch", 4, "--eval-batches", 0, "--dtype", "f32"]
    status, a, err = _run(capsys, "eval", "--out", moved, *same)
    assert status == 0, err
    status, b, err = _run(capsys, "eval", "--init-from", hf, *same)
    assert status == 0, err
    assert a.split("val loss ")[1][:6] == b.split("val loss ")[1][:6]
