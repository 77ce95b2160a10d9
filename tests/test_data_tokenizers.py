"""The data layer for any vocabulary: llm.c's uint32 shard format beside its uint16 one, the
sidecar that records which tokenizer made a folder of shards, prepare() and the text cache
with a tokenizer other than GPT-2's, and the refusal of one tokenizer's shards for another.

A small byte-level BPE (tests.util.make_bpe_tokenizer) stands in for a model's tokenizer;
nothing here needs tiktoken but the test of records from before tokenizers were chosen.
"""

import dataclasses
import json
import re

import numpy as np
import pytest

from blujax import data
from blujax.data import (DataError, DataLoader, Shard, ShardError, Tokenizer, corpus,
                         eval_tokens, load_tokenizer, provenance, resolve, tokenizing)
from tests.test_data import make_documents, read_tokens, write_inputs
from tests.util import make_bpe_tokenizer

LLAMA3_VOCAB = 128_256


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A 300-token byte-level BPE, its documents beginning with <|begin_of_text|>."""
    text = "\n".join(make_documents(np.random.default_rng(0), 60))
    return load_tokenizer(make_bpe_tokenizer(tmp_path_factory.mktemp("bpe") / "tiny-bpe", text))


def big_tokenizer() -> Tokenizer:
    """A made-up vocabulary beyond uint16: every character an id from 70,000 on."""
    return Tokenizer("big", "b" * 16, 100_000, 99_999, (99_999,), None,
                     lambda text: [70_000 + ord(c) % 20_000 for c in text],
                     lambda ids: "".join(chr(i - 70_000) for i in ids))


def doc_tokens(tok, docs) -> np.ndarray:
    return np.concatenate([[tok.doc_token, *tok.encode(d)] for d in docs])


# ---- the uint32 format


def test_wide_shard_round_trip(tmp_path, rng):
    tokens = rng.integers(0, LLAMA3_VOCAB, 3001)
    path = data.write_shard(tmp_path / "w_train_000001.bin", tokens, wide=True)
    header = np.fromfile(path, dtype="<i4", count=256)
    assert list(header[:3]) == [20240801, 7, 3001] and not header[3:].any()
    assert path.stat().st_size == 1024 + 4 * 3001
    assert data.read_header(path) == 3001
    assert data.read_format(path) == (3001, data.WIDE_TOKEN_DTYPE)
    with Shard(path, LLAMA3_VOCAB) as shard:
        assert shard.dtype == np.uint32 and shard.tokens.dtype == np.uint32
        np.testing.assert_array_equal(shard.tokens, tokens)
    with DataLoader(tmp_path, "train", batch_size=4, seq_len=16, shuffle=False,
                    vocab_size=LLAMA3_VOCAB) as loader:
        for b in range(3):
            x, y = next(loader)
            assert x.dtype == y.dtype == np.int32
            np.testing.assert_array_equal(x.reshape(-1), tokens[b * 64:(b + 1) * 64])
            np.testing.assert_array_equal(y.reshape(-1), tokens[b * 64 + 1:(b + 1) * 64 + 1])
    (x, y), = data.val_batches([path], batch=2, seq=16, max_batches=1,
                               vocab_size=LLAMA3_VOCAB)
    np.testing.assert_array_equal(y.reshape(-1), tokens[1:33])


def test_both_formats_give_the_same_batches(tmp_path, rng):
    tokens = rng.integers(0, 50_257, 2000)
    for folder in "nw":
        (tmp_path / folder).mkdir()
    narrow = data.write_shard(tmp_path / "n" / "x_train_000000.bin", tokens)
    wide = data.write_shard(tmp_path / "w" / "x_train_000000.bin", tokens, wide=True)
    assert data.read_format(narrow)[1] == data.TOKEN_DTYPE  # uint16 as ever
    np.testing.assert_array_equal(read_tokens(narrow), read_tokens(wide))

    def batches(folder):
        with DataLoader(folder, "train", batch_size=2, seq_len=32, seed=5,
                        process_index=0, process_count=1) as loader:
            return [tuple(a.copy() for a in next(loader)) for _ in range(5)]

    for a, b in zip(batches(tmp_path / "n"), batches(tmp_path / "w")):
        np.testing.assert_array_equal(a, b)


def test_wide_shard_errors(tmp_path):
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, 65535\] to be stored as "
                                         r"uint16"):
        data.write_shard(tmp_path / "a.bin", [70_000])
    with pytest.raises(ValueError, match=r"\[0, 4294967295\] to be stored as uint32"):
        data.write_shard(tmp_path / "a.bin", [1 << 32], wide=True)
    path = data.write_shard(tmp_path / "a.bin", [1, 200_000, 3], wide=True)
    with pytest.raises(ShardError, match=r"a.bin: token 1 is 200000, not below the vocabulary "
                                         r"size 128256"):
        Shard(path, LLAMA3_VOCAB)
    raw = bytearray(path.read_bytes())
    raw[4:8] = np.int32(1).tobytes()
    path.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match=r"a.bin: unsupported shard version 1 \(magic 20240801 "
                                         r"is version 7: uint32"):
        data.read_header(path)
    raw[:4] = np.int32(12345).tobytes()
    path.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match=r"a.bin: bad magic number 12345 \(expected 20240520 "
                                         r"for uint16 tokens or 20240801 for uint32 tokens\)"):
        data.read_header(path)


# ---- which tokenizer made the shards


def test_recorded_tokenizer(tmp_path, bpe):
    narrow = data.write_shard(tmp_path / "n_train_000000.bin", np.arange(10))
    assert data.recorded_tokenizer([narrow]) == data.GPT2_IDENTITY  # llm.c's GPT-2 format
    assert data.GPT2_IDENTITY == {"name": "gpt2", "fingerprint": "90216161d662f94a",
                                  "vocab_size": 50257}
    (tmp_path / "w").mkdir()
    wide = data.write_shard(tmp_path / "w" / "w_train_000000.bin", np.arange(10), wide=True)
    assert data.recorded_tokenizer([wide]) is None  # unknown
    assert data.recorded_tokenizer([narrow, wide]) == data.GPT2_IDENTITY
    assert data.check_tokenizer([wide], bpe, "w/") is None  # unknown passes
    data.record_tokenizer(tmp_path / "w", bpe)
    assert json.loads((tmp_path / "w" / data.SIDECAR).read_text()) == bpe.identity()
    assert data.recorded_tokenizer([wide]) == bpe.identity()
    assert data.check_tokenizer([wide], bpe, "w/") == bpe.identity()
    with pytest.raises(DataError, match="shards made by the tokenizer 'tiny-bpe'.*beside "
                                        "shards made by GPT-2's tokenizer"):
        data.recorded_tokenizer([narrow, wide])
    (tmp_path / "w" / data.SIDECAR).write_text("[1, 2]")
    with pytest.raises(DataError, match=f"{data.SIDECAR}: not a record of a tokenizer"):
        data.recorded_tokenizer([wide])


def test_check_tokenizer_names_both(tmp_path, bpe):
    shard = data.write_shard(tmp_path / "x_val_000000.bin", np.arange(10))
    with pytest.raises(DataError) as e:
        data.check_tokenizer([shard], bpe, "data/")
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("data/: token shards made by GPT-2's tokenizer, but the model "
                              f"speaks the tokenizer 'tiny-bpe' (300 tokens, fingerprint "
                              f"{bpe.fingerprint}): tokenize the text again with python -m "
                              f"blujax.data prepare --tokenizer ")
    assert message.endswith(str(bpe.folder))
    gpt2_like = dataclasses.replace(bpe, fingerprint=data.GPT2_IDENTITY["fingerprint"])
    assert data.check_tokenizer([shard], gpt2_like, "data/") == data.GPT2_IDENTITY


# ---- prepare with another tokenizer


def test_prepare_with_a_model_tokenizer(tmp_path, rng, bpe, capsys):
    docs = make_documents(rng, 30)
    docs[5] = "forged <|begin_of_text|> and <|end_of_text|> in the text"  # plain text
    inputs = write_inputs(tmp_path, docs)
    out = tmp_path / "out"
    result = data.prepare(inputs, out, workers=1, shard_tokens=400, val_tokens=300,
                          tokenizer=str(bpe.folder), progress=False)
    assert [data.read_format(p)[1] for p in result.files] == [np.uint16] * len(result.files)
    tokens = np.concatenate([read_tokens(p) for p in result.files])
    np.testing.assert_array_equal(tokens, doc_tokens(bpe, docs))
    assert tokens[0] == bpe.doc_token == 0 and np.sum(tokens == bpe.doc_token) == len(docs)
    assert json.loads((out / data.SIDECAR).read_text()) == bpe.identity()
    assert resolve(str(out), tokenizer=bpe).tokenizer == bpe.identity()
    assert data.prepare(inputs, out, workers=1, shard_tokens=400, val_tokens=300,
                        tokenizer=bpe, progress=False).written == []  # complete: kept

    # A worker process loads it from its spec.
    tokenizing._init_worker(bpe.spec)
    ids, _ = tokenizing._encode_document((docs[5], 0))
    np.testing.assert_array_equal(ids, doc_tokens(bpe, docs[5:6]))

    assert data.main(["check", str(result.files[0])]) == 0
    line = capsys.readouterr().out
    assert "uint16 tokens, llm.c's GPT-2 format; made by the tokenizer 'tiny-bpe'" in line


def test_prepare_cuts_a_small_corpus_by_the_document_token(tmp_path, rng, bpe, monkeypatch):
    """Without val_tokens a small corpus is cut again at the end, its resume points found by
    counting the tokenizer's document token; a lost shard is made again the same."""
    docs = make_documents(rng, 40)
    inputs = write_inputs(tmp_path, docs)
    out = tmp_path / "out"
    small = data.prepare(inputs, out, workers=1, shard_tokens=500, tokenizer=bpe,
                         progress=False)
    contents = [p.read_bytes() for p in small.files]
    np.testing.assert_array_equal(np.concatenate([read_tokens(p) for p in small.files]),
                                  doc_tokens(bpe, docs))
    k = len(small.files) // 2
    small.files[k].unlink()
    again = data.prepare(inputs, out, workers=1, shard_tokens=500, tokenizer=bpe,
                         progress=False)
    assert again.skipped == small.files[:k] and again.written == small.files[k:]
    assert [p.read_bytes() for p in again.files] == contents


def test_prepare_writes_uint32_for_a_large_vocabulary(tmp_path, rng):
    big = big_tokenizer()
    docs = ["hello", "wide world", "東京 🚀"]
    inputs = write_inputs(tmp_path, docs)
    result = data.prepare(inputs, tmp_path / "out", val_tokens=5, tokenizer=big,
                          progress=False)  # workers: one, since it cannot load elsewhere
    assert all(data.read_format(p)[1] == np.uint32 for p in result.files)
    parts = []
    for p in result.files:
        with Shard(p, big.vocab_size) as shard:
            parts.append(np.array(shard.tokens))
    np.testing.assert_array_equal(np.concatenate(parts), doc_tokens(big, docs))
    assert provenance.read_sidecar(tmp_path / "out") == big.identity()


def test_one_folder_one_tokenizer(tmp_path, rng, bpe):
    out = tmp_path / "out"
    out.mkdir()
    data.write_shard(out / "fineweb_val_000000.bin", np.arange(100))  # llm.c's: GPT-2's
    inputs = write_inputs(tmp_path, make_documents(rng, 10))
    with pytest.raises(DataError, match=r"out: holds token shards made by GPT-2's tokenizer "
                                        r"\(fineweb_val_000000.bin ...\), and one folder holds "
                                        r"one tokenizer's shards: write those of the tokenizer "
                                        r"'tiny-bpe' .* to another folder"):
        data.prepare(inputs, out, workers=1, tokenizer=bpe, progress=False)
    assert not (out / data.SIDECAR).exists()
    # Shards of the same name, another tokenizer's: this run's to rewrite.
    other = tmp_path / "other"
    data.prepare(inputs, other, workers=1, tokenizer=big_tokenizer(), progress=False)
    result = data.prepare(inputs, other, workers=1, tokenizer=bpe, progress=False)
    assert len(result.written) == len(result.files)
    assert all(data.read_format(p)[1] == np.uint16 for p in result.files)
    assert sorted(other.glob("*.bin")) == sorted(result.files)
    assert provenance.read_sidecar(other) == bpe.identity()


def test_cli_prepare_takes_the_tokenizer(tmp_path, rng, bpe, capsys):
    inputs = write_inputs(tmp_path, make_documents(rng, 10))
    out = tmp_path / "cli"
    assert data.main(["prepare", *map(str, inputs), "--out", str(out), "--tokenizer",
                      str(bpe.folder), "--val-tokens", "50", "--workers", "1",
                      "--no-progress"]) == 0
    assert provenance.read_sidecar(out) == bpe.identity()
    wide = data.write_shard(tmp_path / "wide.bin", [5, 200_000], wide=True)
    assert data.main(["check", str(wide)]) == 0
    assert "2 tokens (ids unchecked: pass --vocab-size); uint32 tokens, llm.c's Llama 3 " \
           "format; made by an unrecorded tokenizer" in capsys.readouterr().out
    assert data.main(["check", str(wide), "--vocab-size", "128256"]) == 1
    assert data.main(["prepare", str(inputs[0]), "--out", str(out), "--tokenizer",
                      str(tmp_path / "nope")]) == 2
    assert "not 'gpt2' and not a folder with tokenizer.json" in capsys.readouterr().err


def test_an_earlier_record_of_gpt2_stays_valid(tmp_path, rng, enc):
    """Progress records from before tokenizers were named by fingerprint said
    "encoding": "gpt2": their shards are kept."""
    inputs = write_inputs(tmp_path, make_documents(rng, 20))
    out = tmp_path / "out"
    kwargs = dict(workers=1, shard_tokens=300, val_tokens=300, progress=False)
    first = data.prepare(inputs, out, **kwargs)
    record = out / "corpus.prepare.json"
    saved = json.loads(record.read_text())
    assert saved["settings"].pop("tokenizer") == data.GPT2_IDENTITY["fingerprint"]
    saved["settings"]["encoding"] = "gpt2"
    record.write_text(json.dumps(saved))
    again = data.prepare(inputs, out, **kwargs)
    assert again.written == [] and again.skipped == first.files


# ---- the text cache and the data specs


def test_each_tokenizer_caches_text_in_its_own_folder(tmp_path, bpe):
    text = tmp_path / "notes.txt"
    text.write_text("To be, or not to be, that is the question. " * 100)
    assert corpus.token_cache(text) == tmp_path / "notes.txt.tokens"  # GPT-2's, as before
    own = tmp_path / f"notes.txt.{bpe.fingerprint[:8]}.tokens"
    assert corpus.token_cache(text, bpe) == own
    source = resolve(str(text), tokenizer=bpe)
    assert {p.parent for p in source.train + source.val} == {own}
    assert source.tokenizer == bpe.identity()
    tokens = np.concatenate([read_tokens(p) for p in source.val + source.train])
    np.testing.assert_array_equal(tokens, [bpe.doc_token, *bpe.encode(text.read_text())])
    assert resolve(str(text), tokenizer=bpe) == source  # reused
    big = big_tokenizer()
    assert corpus.token_cache(text, big).name == "notes.txt.bbbbbbbb.tokens"
    wide, _ = corpus.tokenize_text(text, tokenizer=big)
    assert data.read_format(wide[0])[1] == np.uint32 and wide[0].parent.name.endswith(
        ".bbbbbbbb.tokens")
    assert own.is_dir() and read_tokens(source.train[0]).size  # untouched by the other


def test_specs_refuse_another_tokenizers_shards(tmp_path, bpe):
    folder = tmp_path / "llmc"
    folder.mkdir()
    val = np.arange(0, 300)
    data.write_shard(folder / "x_val_000000.bin", val)
    data.write_shard(folder / "x_train_000001.bin", np.arange(300, 700))
    assert resolve(str(folder)).tokenizer == data.GPT2_IDENTITY
    for resolver in (resolve, eval_tokens):
        for spec in (folder, folder / "x_*.bin", folder / "x_train_000001.bin"):
            with pytest.raises(DataError, match=rf"^{re.escape(str(spec))}: token shards made "
                                                r"by GPT-2's tokenizer, but the model speaks "
                                                r"the tokenizer 'tiny-bpe'") as e:
                resolver(str(spec), tokenizer=bpe)
            assert "\n" not in str(e.value)
    tokens, _ = eval_tokens(str(folder))  # no tokenizer named: no check
    np.testing.assert_array_equal(tokens, val)


def test_eval_tokens_in_any_vocabulary(tmp_path, bpe):
    text = tmp_path / "t.txt"
    text.write_text("Before we proceed any further, hear me speak. <|begin_of_text|>")
    tokens, _ = eval_tokens(str(text), tokenizer=bpe)
    assert tokens.dtype == np.uint16 and list(tokens) == bpe.encode(text.read_text())
    assert bpe.doc_token not in tokens  # special-token text is plain text
    big = big_tokenizer()
    tokens, _ = eval_tokens(str(text), tokenizer=big)
    assert tokens.dtype == np.uint32 and list(tokens) == big.encode(text.read_text())
    # Wide shards of an unknown tokenizer pass its check, but not its vocabulary's; without
    # a tokenizer they are read unchecked (the evaluation checks the model's vocabulary).
    (tmp_path / "w").mkdir()
    wide = np.array([5, 100_000, 128_000])
    data.write_shard(tmp_path / "w" / "w_val_000000.bin", wide, wide=True)
    with pytest.raises(ShardError, match="token 1 is 100000, not below the vocabulary size 300"):
        eval_tokens(str(tmp_path / "w"), tokenizer=bpe)
    tokens, _ = eval_tokens(str(tmp_path / "w"))
    assert tokens.dtype == np.uint32
    np.testing.assert_array_equal(tokens, wide)
