"""What a data spec names (blujax.data.sources, corpus): the shards a run trains on, the tokens an
evaluation reads, the validation batches, the text cache and the default corpus.

Needs TIKTOKEN_CACHE_DIR (or network access) for the text tests, and BLUJAX_TEST_DATA
(tinyshakespeare.txt and llm.c's shards of it in tinyshakespeare_llmc/) for the tests against
llm.c's shards; each skips without them. The user cache is the test's own.
"""

import hashlib
import json
import shutil

import numpy as np
import pytest

from blujax import data
from blujax.data import DataError, ShardError, TextError, corpus, eval_tokens, resolve
from tests.test_data import LATIN1, make_documents, read_tokens, shared_data, write_inputs


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """The user cache is the test's own; no BLUJAX_CORPUS from the caller leaks in."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.delenv(corpus.CORPUS_ENV, raising=False)


# ---- the spec


def test_errors_name_the_spec(tmp_path):
    for resolver in (resolve, eval_tokens):
        with pytest.raises(DataError, match="nope: no such file or directory"):
            resolver(str(tmp_path / "nope"))
        with pytest.raises(DataError, match="the directory holds no .bin token shards"):
            resolver(str(tmp_path))
        with pytest.raises(DataError, match="the pattern matches no files"):
            resolver(str(tmp_path / "*.bin"))
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(DataError, match="a pattern must name llm.c .bin token shards, but it "
                                        "matches .*notes.txt"):
        resolve(str(tmp_path / "*"))
    data.write_shard(tmp_path / "x_val_000000.bin", np.arange(10))
    with pytest.raises(DataError, match=r"only validation shards \(x_val_000000.bin ...\), no "
                                        r"shard has 'train' in its name"):
        resolve(str(tmp_path))


def test_shard_folders_and_globs_split_by_name(tmp_path):
    llmc = shared_data("tinyshakespeare_llmc")
    for spec in (str(llmc), str(llmc / "*.bin")):
        source = resolve(spec)
        assert [p.name for p in source.train] == ["tiny_shakespeare_train.bin"]
        assert [p.name for p in source.val] == ["tiny_shakespeare_val.bin"]
    one = resolve(str(llmc / "tiny_shakespeare_train.bin"))
    assert [p.name for p in one.val] == ["tiny_shakespeare_val.bin"]  # its twin
    bad = tmp_path / "bad_train.bin"
    bad.write_bytes(b"\0" * 100)
    with pytest.raises(ShardError, match="shorter than"):
        resolve(str(bad))
    # Shards named neither way all train, without a validation split.
    data.write_shard(tmp_path / "a.bin", np.arange(10))
    data.write_shard(tmp_path / "b.bin", np.arange(10))
    source = resolve(str(tmp_path / "?.bin"))
    assert [p.name for p in source.train] == ["a.bin", "b.bin"] and source.val == []


def test_resolve_refuses_an_unfinished_prepare(tmp_path, rng, enc):
    out = tmp_path / "d"
    data.prepare(write_inputs(tmp_path, make_documents(rng, 30)), out, workers=1,
                 shard_tokens=300, val_tokens=300, progress=False)
    assert resolve(str(out)).train
    record = out / "corpus.prepare.json"
    saved = json.loads(record.read_text())
    saved["shards"] = saved["shards"][:3]
    saved["shards"][-1]["last"] = False  # as a run stopped after its third shard leaves it
    record.write_text(json.dumps(saved))
    for resolver in (resolve, eval_tokens):
        with pytest.raises(DataError, match="the shards of corpus are incomplete"):
            resolver(str(out))


# ---- text, tokenized once


def test_a_text_file_is_tokenized_once_beside_it(tmp_path, enc):
    text = tmp_path / "notes.txt"
    text.write_text("To be, or not to be, that is the question. " * 200)
    source = resolve(str(text))
    assert source.description == f"text file {text}"
    assert {p.parent for p in source.train + source.val} == {tmp_path / "notes.txt.tokens"}
    tokens = np.concatenate([read_tokens(p) for p in source.val + source.train])
    whole = [enc.eot_token, *enc.encode_ordinary(text.read_text())]
    np.testing.assert_array_equal(tokens, whole)
    stamp = source.train[0].stat().st_mtime_ns
    assert resolve(str(text)) == source
    assert source.train[0].stat().st_mtime_ns == stamp  # reused, not written again


def test_text_errors(tmp_path, enc):
    bad = tmp_path / "notes.txt"
    bad.write_bytes(b"plain ascii first\n" * 10 + LATIN1)
    with pytest.raises(TextError, match=rf"{bad} is not UTF-8 text: byte 0xe9 at offset 183 "):
        resolve(str(bad))
    assert not (tmp_path / "notes.txt.tokens").exists()  # no cache a later run would reuse
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    for resolver in (resolve, eval_tokens):
        with pytest.raises(TextError, match=f"{empty}: the file is empty"):
            resolver(str(empty))


def test_tokens_go_to_the_user_cache_when_the_folder_is_read_only(tmp_path, monkeypatch):
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    monkeypatch.setattr(corpus, "_writable", lambda folder: folder.parent != tmp_path)
    cache = corpus.token_cache(text)
    assert cache.parent == corpus.user_cache_dir() / "tokens"
    assert cache.name.startswith("notes.txt-")


# ---- the default corpus


@pytest.mark.slow
def test_default_corpus_is_llmc_tinyshakespeare(tmp_path, monkeypatch, enc):
    """The default corpus, found through BLUJAX_CORPUS, tokenizes into exactly llm.c's
    tinyshakespeare shards (its paragraphs as documents, 32768 validation tokens), in the user
    cache (not beside the file: that may be a shared folder), and is reused; the user cache's
    own copy of the text comes first once present."""
    text, llmc = shared_data("tinyshakespeare.txt"), shared_data("tinyshakespeare_llmc")
    copy = tmp_path / "shared" / "input.txt"
    copy.parent.mkdir()
    shutil.copyfile(text, copy)
    monkeypatch.setenv(corpus.CORPUS_ENV, str(copy))
    source = resolve(None)
    tokens = corpus.user_cache_dir() / "tinyshakespeare.txt.tokens"
    assert {p.parent for p in source.train + source.val} == {tokens}
    assert sorted(p.name for p in copy.parent.iterdir()) == ["input.txt"]
    for ours, theirs in ((source.train[0], "tiny_shakespeare_train.bin"),
                         (source.val[0], "tiny_shakespeare_val.bin")):
        assert ours.read_bytes() == (llmc / theirs).read_bytes()
    stamp = source.train[0].stat().st_mtime_ns
    assert resolve(None) == source
    assert source.train[0].stat().st_mtime_ns == stamp  # reused, not written again

    cached = corpus.user_cache_dir() / corpus.CORPUS_NAME
    shutil.copyfile(copy, cached)
    monkeypatch.setenv(corpus.CORPUS_ENV, str(tmp_path / "elsewhere.txt"))  # not looked at
    again = resolve(None)
    assert again.train[0].read_bytes() == source.train[0].read_bytes()


def test_offline_without_the_corpus_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus, "CORPUS_URL", "http://127.0.0.1:9/input.txt")
    with pytest.raises(DataError, match="could not download the default corpus") as e:
        resolve(None)
    assert "set BLUJAX_CORPUS" in str(e.value) and "TIKTOKEN_CACHE_DIR" in str(e.value)
    monkeypatch.setenv(corpus.CORPUS_ENV, str(tmp_path / "missing.txt"))
    with pytest.raises(DataError, match=f"BLUJAX_CORPUS={tmp_path / 'missing.txt'}: no such"):
        resolve(None)


def test_download_checks_the_sha256(tmp_path):
    source = tmp_path / "source.txt"
    source.write_text("First Citizen: Before we proceed any further, hear me speak.\n")
    dest = tmp_path / "cache" / "corpus.txt"
    with pytest.raises(ValueError, match="sha256"):
        corpus.download(source.as_uri(), dest, sha256="0" * 64, progress=False)
    assert not dest.exists() and not list(dest.parent.iterdir())  # no partial file left
    digest = hashlib.sha256(source.read_bytes()).hexdigest()
    corpus.download(source.as_uri(), dest, sha256=digest, progress=False)
    assert dest.read_bytes() == source.read_bytes()


# ---- the evaluation tokens


def test_eval_tokens_of_a_text_file(tmp_path, enc):
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll: Speak, " \
           "speak. <|endoftext|> café ☕\n"
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    tokens, what = eval_tokens(str(path))
    assert tokens.dtype == np.uint16 and what == f"text file {path}"
    np.testing.assert_array_equal(tokens, enc.encode_ordinary(text))  # no end-of-text added
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9 au lait")
    with pytest.raises(TextError, match=r"latin1.txt is not UTF-8 text: byte 0xe9 at offset 3"):
        eval_tokens(str(bad))


def test_eval_tokens_of_a_shard_directory_is_its_val_split(tmp_path):
    val0, val1, train = np.arange(0, 50), np.arange(100, 130), np.arange(500, 600)
    data.write_shard(tmp_path / "x_val_000000.bin", val0)
    data.write_shard(tmp_path / "x_val_000001.bin", val1)
    data.write_shard(tmp_path / "x_train_000002.bin", train)
    tokens, what = eval_tokens(str(tmp_path))
    np.testing.assert_array_equal(tokens, np.concatenate([val0, val1]))
    assert what == f"the validation split of {tmp_path} (2 shards x_val_000000.bin ..., " \
                   f"80 tokens)"
    tokens, _ = eval_tokens(str(tmp_path / "x_*.bin"))  # a glob: the same
    np.testing.assert_array_equal(tokens, np.concatenate([val0, val1]))
    tokens, what = eval_tokens(str(tmp_path / "x_train_000002.bin"))  # one shard: all of it
    np.testing.assert_array_equal(tokens, train)
    assert what == f"token shard {tmp_path / 'x_train_000002.bin'} (all 100 tokens)"


def test_eval_tokens_of_llmc_shards():
    folder = shared_data("tinyshakespeare_llmc")
    tokens, _ = eval_tokens(str(folder))
    with data.Shard(folder / "tiny_shakespeare_val.bin") as shard:
        np.testing.assert_array_equal(tokens, shard.tokens)


def test_eval_tokens_errors(tmp_path):
    data.write_shard(tmp_path / "x_train_000000.bin", np.arange(10))
    with pytest.raises(DataError, match=r"no validation shards \(none of the 1 .bin files has "
                                        r"'val' in its name"):
        eval_tokens(str(tmp_path))
    bad = tmp_path / "y_val_000000.bin"
    bad.write_bytes(b"\0" * 2048)
    with pytest.raises(ShardError, match="y_val_000000.bin: bad magic number 0"):
        eval_tokens(str(bad))
    empty = tmp_path / "z.bin"
    data.write_shard(empty, np.zeros(0, np.uint16))
    with pytest.raises(ShardError, match="z.bin: the shards hold no tokens"):
        eval_tokens(str(empty))


# ---- the validation batches


def test_validation_batches_split_over_data_parallel_ranks(tmp_path, rng):
    """The first batches of the validation split, in order; a split too small for a full
    batch gives a batch of as many rows as fit, rounded down to a multiple of the data-parallel
    size, so that the sharded eval step can split it."""
    tokens = rng.integers(0, 50257, 7 * 16 + 1)
    val = data.write_shard(tmp_path / "v_val_000000.bin", tokens)
    (x, y), = data.val_batches([val], batch=32, seq=16)
    assert x.shape == y.shape == (7, 16) and x.dtype == np.int32
    np.testing.assert_array_equal(x.reshape(-1), tokens[:-1])
    np.testing.assert_array_equal(y.reshape(-1), tokens[1:])
    (x, _), = data.val_batches([val], batch=32, seq=16, rows_multiple=2)
    assert x.shape == (6, 16)
    assert data.val_batches([val], batch=32, seq=16, rows_multiple=8) == []
    batches = data.val_batches([val], batch=2, seq=16, max_batches=2)
    assert [x.shape for x, _ in batches] == [(2, 16), (2, 16)]
    np.testing.assert_array_equal(batches[1][0][0], tokens[32:48])
    assert data.val_batches([], batch=2, seq=16) == []
