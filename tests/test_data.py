"""Token shards, tokenizing into them, and the loader.

Needs, from the environment: TIKTOKEN_CACHE_DIR (or network access) for tiktoken's gpt2
files, else the tokenizing tests skip; BLUJAX_TEST_DATA, a folder with tinyshakespeare.txt and
llm.c's shards of it in tinyshakespeare_llmc/, else the tests against them skip.
"""

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from blujax import data
from blujax.data import Batch, DataError, DataLoader, Shard, ShardError, TextError
from blujax.data import tokenizing


def shared_data(relative: str) -> Path:
    root = os.environ.get("BLUJAX_TEST_DATA")
    if not root:
        pytest.skip("BLUJAX_TEST_DATA is not set (the folder with tinyshakespeare.txt and "
                    "tinyshakespeare_llmc/)")
    path = Path(root) / relative
    if not path.exists():
        pytest.skip(f"{path} not found under BLUJAX_TEST_DATA")
    return path


def read_tokens(path) -> np.ndarray:
    with Shard(path) as shard:
        return np.array(shard.tokens)


# ---- shard files


def test_shard_round_trip(tmp_path, rng):
    tokens = rng.integers(0, data.GPT2_VOCAB_SIZE, 12_345)
    path = data.write_shard(tmp_path / "a.bin", tokens)
    header = np.fromfile(path, dtype="<i4", count=256)
    assert list(header[:3]) == [20240520, 1, 12_345] and not header[3:].any()
    assert path.stat().st_size == 1024 + 2 * 12_345
    assert data.read_header(path) == 12_345
    np.testing.assert_array_equal(read_tokens(path), tokens)
    assert not list(tmp_path.glob("*.tmp"))


def test_writer_reproduces_llmc_shards(tmp_path):
    for name in ("tiny_shakespeare_val.bin", "tiny_shakespeare_train.bin"):
        original = shared_data(f"tinyshakespeare_llmc/{name}")
        tokens = read_tokens(original)
        assert len(tokens) == {"tiny_shakespeare_val.bin": 32_768,
                               "tiny_shakespeare_train.bin": 305_260}[name]
        ours = data.write_shard(tmp_path / name, tokens)
        assert ours.read_bytes() == original.read_bytes()


def _corrupt(path: Path, kind: str):
    raw = bytearray(path.read_bytes())
    if kind == "truncated":
        raw = raw[:-3]
    elif kind == "short":
        raw = raw[:100]
    elif kind == "magic":
        raw[0] ^= 0x40
    elif kind == "version":
        raw[4:8] = np.int32(7).tobytes()
    elif kind == "trailing":
        raw += b"\0\0"
    elif kind == "negative":
        raw[8:12] = np.int32(-5).tobytes()
    elif kind == "token":
        raw[1024 + 2 * 77:1024 + 2 * 78] = np.uint16(60_000).tobytes()
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("kind, words", [
    ("truncated", "truncated: the header says 500 tokens"),
    ("short", "shorter than the 1024-byte llm.c header"),
    ("magic", "bad magic number"),
    ("version", "unsupported shard version 7"),
    ("trailing", "2 bytes after the 500 tokens"),
    ("negative", "negative token count"),
    ("token", "token 77 is 60000, not below the vocabulary size 50257"),
])
def test_corrupt_shard_errors(tmp_path, rng, kind, words):
    path = data.write_shard(tmp_path / "bad.bin", rng.integers(0, 50_000, 500))
    _corrupt(path, kind)
    with pytest.raises(ShardError) as e:
        Shard(path)
    assert str(path) in str(e.value) and words in str(e.value)
    assert data.main(["check", str(path)]) == 1


# ---- tokenizing into shards


WORDS = ["the", "Königin", "said", "naïve", "café", "東京", "🚀", "x=3.14;", "  indent",
         "<|endoftext|>", "\n", "\n\n", "don't", "1999", "...", "GPT-2", "\t", "łódź"]


def make_documents(rng, count: int) -> list[str]:
    docs = [" ".join(rng.choice(WORDS, size=int(rng.integers(1, 120)))) for _ in range(count)]
    docs[3] = ""  # an empty document is still one: its end-of-text token
    return docs


def expected_tokens(enc, docs) -> np.ndarray:
    # Special-token text inside a document is plain text: encode_ordinary.
    return np.concatenate([[enc.eot_token] + enc.encode_ordinary(d) for d in docs])


def write_inputs(tmp_path, docs):
    """The documents as a JSON-lines file (all but the last two) and two text files."""
    jsonl = tmp_path / "corpus.jsonl"
    with open(jsonl, "w", encoding="utf-8") as f:
        for d in docs[:-2]:
            f.write(json.dumps({"id": 1, "text": d}) + "\n")
        f.write("\n")  # blank lines are skipped
    texts = []
    for i, d in enumerate(docs[-2:]):
        texts.append(tmp_path / f"extra{i}.txt")
        texts[-1].write_text(d, encoding="utf-8")
    return [jsonl, *texts]


def test_prepare_reproduces_llmc_tinyshakespeare(tmp_path, enc):
    text_file = shared_data("tinyshakespeare.txt")
    val = shared_data("tinyshakespeare_llmc/tiny_shakespeare_val.bin")
    train = shared_data("tinyshakespeare_llmc/tiny_shakespeare_train.bin")
    result = data.prepare([text_file], tmp_path, name="tiny_shakespeare", workers=1,
                          doc_separator="\n\n", val_tokens=32_768, shard_tokens=10**6,
                          progress=False)
    assert [p.name for p in result.files] == ["tiny_shakespeare_val_000000.bin",
                                              "tiny_shakespeare_train_000001.bin"]
    assert result.tokens == {"val": 32_768, "train": 305_260}
    assert result.files[0].read_bytes() == val.read_bytes()
    assert result.files[1].read_bytes() == train.read_bytes()
    # And against tiktoken's own encoding of llm.c's text (special tokens inserted).
    text = text_file.read_text(encoding="utf-8")
    llmc_text = "<|endoftext|>" + text.replace("\n\n", "\n\n<|endoftext|>")
    whole = enc.encode(llmc_text, allowed_special={"<|endoftext|>"})
    np.testing.assert_array_equal(np.concatenate([read_tokens(p) for p in result.files]),
                                  whole)


def test_prepare_round_trip_in_processes(tmp_path, rng, enc):
    docs = make_documents(rng, 60)
    result = data.prepare(write_inputs(tmp_path, docs), tmp_path / "out", workers=2,
                          shard_tokens=997, val_tokens=1500, progress=False)
    expected = expected_tokens(enc, docs)
    sizes = [data.read_header(p) for p in result.files]
    assert [p.name.rsplit("_", 2)[1] for p in result.files[:3]] == ["val", "val", "train"]
    assert sizes[:2] == [997, 503] and all(s == 997 for s in sizes[2:-1])
    assert 0 < sizes[-1] <= 997 and sum(sizes) == len(expected)
    assert result.tokens == {"val": 1500, "train": len(expected) - 1500}
    np.testing.assert_array_equal(np.concatenate([read_tokens(p) for p in result.files]),
                                  expected)
    assert all(p.name.endswith(f"_{i:06d}.bin") for i, p in enumerate(result.files))


def test_prepare_resumes_after_last_complete_shard(tmp_path, rng, enc, monkeypatch):
    docs = make_documents(rng, 40)
    inputs = write_inputs(tmp_path, docs)
    out = tmp_path / "out"
    kwargs = dict(workers=1, shard_tokens=301, val_tokens=301, progress=False)
    first = data.prepare(inputs, out, **kwargs)
    contents = [p.read_bytes() for p in first.files]
    assert len(first.files) >= 6
    k = len(first.files) // 2
    before = [p.stat().st_mtime_ns for p in first.files[:k]]
    _corrupt(first.files[k], "truncated")          # a partial shard
    first.files[k + 1].unlink()                    # and a missing one after it
    first.files[k + 2].with_name(first.files[k + 2].name + ".tmp").write_bytes(b"partial")

    encoded = []
    encode = tokenizing._encode_document
    monkeypatch.setattr(tokenizing, "_encode_document",
                        lambda item: encoded.append(1) or encode(item))
    second = data.prepare(inputs, out, **kwargs)
    assert second.files == first.files
    assert second.skipped == first.files[:k] and second.written == first.files[k:]
    assert [p.read_bytes() for p in second.files] == contents
    assert [p.stat().st_mtime_ns for p in first.files[:k]] == before
    assert 0 < len(encoded) < len(docs)  # the documents before shard k were not tokenized
    assert not list(out.glob("*.tmp"))

    third = data.prepare(inputs, out, **kwargs)   # complete: nothing to do
    assert third.written == [] and third.skipped == first.files

    # Other settings: everything is rewritten, and shards of the old run beyond the new
    # last one are removed.
    fourth = data.prepare(inputs, out, **dict(kwargs, shard_tokens=5000, val_tokens=100))
    total = len(expected_tokens(enc, docs))
    assert len(fourth.written) == len(fourth.files) == 1 + -(-(total - 100) // 5000) < k
    assert sorted(out.glob("*.bin")) == sorted(fourth.files)
    np.testing.assert_array_equal(
        np.concatenate([read_tokens(p) for p in fourth.files]), expected_tokens(enc, docs))


def test_prepare_input_errors(tmp_path, enc):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "no text field"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no string field 'text'"):
        data.prepare([bad], tmp_path / "out", workers=1, progress=False)
    bad.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        data.prepare([bad], tmp_path / "out", workers=1, progress=False)
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        data.prepare([tmp_path / "missing.txt"], tmp_path / "out", progress=False)
    assert data.main(["prepare", str(bad), "--out", str(tmp_path / "out"), "--workers", "1",
                      "--no-progress"]) == 2  # the command line says so without a traceback


def test_cli_prepare_and_check(tmp_path, rng, enc, capsys):
    inputs = write_inputs(tmp_path, make_documents(rng, 10))
    out = tmp_path / "cli"
    assert data.main(["prepare", *map(str, inputs), "--out", str(out), "--shard-tokens", "0.5k",
                      "--val-tokens", "100", "--workers", "1", "--no-progress"]) == 0
    assert "written" in capsys.readouterr().out
    shards = sorted(out.glob("*.bin"), key=lambda p: p.name[-10:])  # by index
    assert shards[0].name == "corpus_val_000000.bin" and data.read_header(shards[1]) == 500
    assert data.main(["check", *map(str, shards)]) == 0
    assert capsys.readouterr().out.count(": ok,") == len(shards)


# ---- the loader


@pytest.fixture
def shards(tmp_path, rng):
    """Three training shards of awkward lengths and a validation shard, random tokens."""
    tokens = {}
    for i, n in enumerate([5003, 7777, 1234], start=1):
        tokens[i] = rng.integers(0, data.GPT2_VOCAB_SIZE, n).astype(np.uint16)
        data.write_shard(tmp_path / f"syn_train_{i:06d}.bin", tokens[i])
    data.write_shard(tmp_path / "syn_val_000000.bin", rng.integers(0, 50257, 999))
    return tmp_path, tokens


def loader(path, **kw):
    # Without process_index/process_count: JAX's (process 0 of 1).
    return DataLoader(path, **dict(dict(split="train", batch_size=4, seq_len=16), **kw))


def chunk_ids(tokens, tokens_per_batch):
    """Maps a batch's inputs (as bytes) to (shard, chunk)."""
    ids = {}
    for s, t in tokens.items():
        for c in range((len(t) - 1) // tokens_per_batch):
            ids[t[c * tokens_per_batch:(c + 1) * tokens_per_batch].astype(np.int32).tobytes()] \
                = (s, c)
    return ids


def test_loader_batches_in_order(shards):
    path, tokens = shards
    with loader(path, shuffle=False) as it:
        assert it.batches_per_epoch == sum((len(t) - 1) // 64 for t in tokens.values())
        flat = np.concatenate([t[:(len(t) - 1) // 64 * 64 + 1] for t in tokens.values()])
        for b in range(3):
            x, y = next(it)
            assert x.dtype == y.dtype == np.int32 and x.shape == y.shape == (4, 16)
            assert x.flags.c_contiguous and x.ctypes.data % 64 == 0 == y.ctypes.data % 64
            np.testing.assert_array_equal(x.reshape(-1), tokens[1][b * 64:(b + 1) * 64])
            np.testing.assert_array_equal(y.reshape(-1), tokens[1][b * 64 + 1:(b + 1) * 64 + 1])
        assert len(flat) > 0


def test_loader_epochs_visit_every_chunk_once(shards):
    path, tokens = shards
    ids = chunk_ids(tokens, 64)
    with loader(path, seed=3) as it:
        n = it.batches_per_epoch
        assert n == len(ids)
        epochs = [[ids[next(it).inputs.tobytes()] for _ in range(n)] for _ in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == sorted(ids.values())
    assert epochs[0] != epochs[1]  # a new order each epoch
    # Each shard's chunks come together (one shard mapped at a time).
    shard_runs = [s for i, (s, _) in enumerate(epochs[0]) if i == 0 or epochs[0][i - 1][0] != s]
    assert sorted(shard_runs) == [1, 2, 3]


def test_loader_order_depends_on_seed_only(shards):
    path, _ = shards

    def first(seed, n=30, **kw):
        with loader(path, seed=seed, **kw) as it:
            return [next(it).inputs.copy() for _ in range(n)]

    a, b, c = first(7), first(7, prefetch=1), first(8)
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    assert not all(np.array_equal(u, v) for u, v in zip(a, c))


@pytest.mark.parametrize("processes", [2, 4])
def test_process_and_rank_slices(shards, processes):
    path, _ = shards
    with loader(path, batch_size=8, seed=1) as whole:
        parts = [loader(path, batch_size=8, seed=1, process_index=p, process_count=processes)
                 for p in range(processes)]
        for _ in range(12):
            full = next(whole)
            got = [next(p) for p in parts]
            assert all(g.inputs.shape == (8 // processes, 16) for g in got)
            np.testing.assert_array_equal(np.concatenate([g.inputs for g in got]), full.inputs)
            np.testing.assert_array_equal(np.concatenate([g.targets for g in got]),
                                          full.targets)
            ranks = [data.rank_slice(full, r, 4) for r in range(4)]
            np.testing.assert_array_equal(np.concatenate([r.inputs for r in ranks]), full.inputs)
            assert all(r.inputs.base is not None for r in ranks)  # views, not copies
        for p in parts:
            p.close()
    with pytest.raises(ValueError, match="equal slice"):
        data.rank_slice(full, 0, 3)
    with pytest.raises(ValueError, match="does not split evenly"):
        loader(path, batch_size=6, process_index=0, process_count=4)


def test_loader_state_resumes_with_next_batch(shards):
    path, _ = shards
    with loader(path, seed=5, prefetch=3) as it:
        n = it.batches_per_epoch
        for _ in range(n - 2):  # the saved position is what was consumed, not prefetched
            next(it)
        state = json.loads(json.dumps(it.state()))
        after = [next(it).inputs.copy() for _ in range(5)]  # crosses into the next epoch
        assert it.state()["epoch"] == 1
    with loader(path, seed=5) as again:
        next(again)
        again.load_state(state)
        assert all(np.array_equal(next(again).inputs, a) for a in after)
        with pytest.raises(ValueError, match="seed differs"):
            again.load_state(dict(state, seed=6))
        with pytest.raises(ValueError, match="the shards. tokens differ"):
            again.load_state(dict(state, shards="0" * 16))


def test_loader_reuses_its_buffers(shards):
    path, _ = shards
    with loader(path, prefetch=2, reuse_buffers=True) as it:
        seen = {next(it).inputs.ctypes.data for _ in range(40)}
    assert len(seen) <= 3


def test_batches_are_safe_to_keep(shards):
    """A batch kept while later ones are produced does not change: neither its numpy arrays
    nor the device arrays made from them (on the CPU, jax.device_put of an aligned numpy
    array shares its memory instead of copying it)."""
    import jax
    path, _ = shards
    # With prefetch=1 the loader fills two slots: the third batch goes into the first's.
    with loader(path, prefetch=1) as it:
        first = next(it)
        kept = first.inputs.copy(), first.targets.copy()
        on_device = jax.device_put(first.inputs), jax.device_put(first.targets)
        later = [next(it) for _ in range(2)]
        assert not np.array_equal(later[1].inputs, kept[0])
        for array in (first.inputs, on_device[0]):
            np.testing.assert_array_equal(np.asarray(array), kept[0])
        for array in (first.targets, on_device[1]):
            np.testing.assert_array_equal(np.asarray(array), kept[1])
    # Only a device array made from a batch is kept: its buffer is still not filled again.
    with loader(path, prefetch=1) as it:
        batch = next(it)
        kept, on_device = batch.inputs.copy(), jax.device_put(batch.inputs)
        del batch
        for _ in range(6):
            next(it)
        np.testing.assert_array_equal(np.asarray(on_device), kept)
    # Batches that are let go: their buffers come back, no new ones are made.
    with loader(path, prefetch=1) as it:
        for _ in range(20):
            next(it)
        assert len(it._producer.pool.buffers) <= 2 * (1 + 1) + 2
    # Reused buffers: the numpy arrays are valid only until the next call.
    with loader(path, prefetch=1, reuse_buffers=True) as it:
        first = next(it)
        kept = first.inputs.copy()
        third = [next(it) for _ in range(2)][1]
        assert third.inputs is first.inputs and not np.array_equal(first.inputs, kept)


def test_loader_reports_bad_shards(shards):
    path, tokens = shards
    bad = path / "syn_train_000002.bin"
    _corrupt(bad, "token")
    with loader(path, shuffle=False) as it:
        with pytest.raises(ShardError, match=r"syn_train_000002\.bin: token 77 is 60000"):
            for _ in range(200):
                next(it)
        with pytest.raises(ShardError):  # and it keeps saying so
            next(it)
    _corrupt(bad, "truncated")
    with pytest.raises(ShardError, match=r"syn_train_000002\.bin: truncated"):
        loader(path)
    with pytest.raises(ValueError, match="no shard holds the 65537 tokens"):
        loader(path / "syn_val_000000.bin", batch_size=64, seq_len=1024)
    with pytest.raises(FileNotFoundError, match="split 'test'"):
        loader(path, split="test")
    with pytest.raises(ValueError, match="name the split"):
        loader(path, split=None)


def test_loader_reads_llmc_shard():
    val = shared_data("tinyshakespeare_llmc/tiny_shakespeare_val.bin")
    tokens = read_tokens(val)
    with DataLoader(val.parent, "val", batch_size=4, seq_len=64, shuffle=False,
                    process_index=0, process_count=1) as it:
        assert it.batches_per_epoch == (32_768 - 1) // 256
        for b in range(2):
            x, y = next(it)
            np.testing.assert_array_equal(x.reshape(-1), tokens[b * 256:(b + 1) * 256])
            np.testing.assert_array_equal(y.reshape(-1), tokens[b * 256 + 1:(b + 1) * 256 + 1])
    assert isinstance(x, np.ndarray) and Batch._fields == ("inputs", "targets")


def test_loader_check_all(shards):
    """check_all() reads every shard once (with what the prefetch thread checks), names the
    first bad one in path order, and passes a good set; next() meets the same ShardError."""
    path, tokens = shards
    for kw in (dict(), dict(check_ahead=False)):
        calls = []
        with loader(path, **kw) as it:
            it.check_all(progress=lambda done, total: calls.append((done, total)))
            next(it)
        assert calls[-1] == (3, 3) and all(t == 3 for _, t in calls)
        assert [d for d, _ in calls] == sorted(d for d, _ in calls)

    third = path / "syn_train_000003.bin"
    bad = tokens[3].copy()
    bad[1000] = data.GPT2_VOCAB_SIZE
    data.write_shard(third, bad)
    message = (rf"{third}: token 1000 is 50257, not below the vocabulary size 50257")
    for kw in (dict(), dict(check_ahead=False)):
        with loader(path, **kw) as it:
            with pytest.raises(ShardError, match=message):
                it.check_all()
            with pytest.raises(ShardError, match=message):  # and again: the check is kept
                it.check_all()
    # Two bad shards: the first in path order is named, whichever check ends first.
    first = path / "syn_train_000001.bin"
    data.write_shard(first, np.r_[tokens[1][:10], 60_000, tokens[1][11:]])
    with loader(path) as it:
        with pytest.raises(ShardError, match=rf"{first}: token 10 is 60000"):
            it.check_all()
    assert issubclass(ShardError, DataError) and issubclass(DataError, ValueError)


def test_loader_checks_each_shard_once(shards, monkeypatch):
    path, _ = shards
    checked = []
    check = Shard.check_tokens
    monkeypatch.setattr(Shard, "check_tokens",
                        lambda self, *a, **k: checked.append(self.path.name) or
                        check(self, *a, **k))
    with loader(path, shuffle=False) as it:
        for _ in range(it.batches_per_epoch * 2):  # every shard read, twice
            next(it)
        it.check_all()
    assert sorted(checked) == [f"syn_train_{i:06d}.bin" for i in (1, 2, 3)]


@pytest.mark.parametrize("check_ahead", [True, False])
def test_next_raises_shard_error_at_a_bad_later_shard(shards, check_ahead):
    path, tokens = shards
    third = path / "syn_train_000003.bin"
    bad = tokens[3].copy()
    bad[1000] = data.GPT2_VOCAB_SIZE
    data.write_shard(third, bad)
    it = loader(path, shuffle=False, check_ahead=check_ahead)
    good = sum((len(tokens[s]) - 1) // 64 for s in (1, 2))
    for _ in range(good):  # the batches of the good shards come first
        next(it)
    with pytest.raises(ShardError, match=rf"{third}: token 1000 is 50257"):
        next(it)
    it.close()  # closes after the error, and the threads end
    assert not it._producer.thread
    with pytest.raises(ValueError, match="closed"):
        next(it)
    for thread in it._producer.checks.threads:
        thread.join(timeout=10)
        assert not thread.is_alive()


# ---- text that is not UTF-8, and what is left after it


LATIN1 = "Caf\u00e9 au lait, cr\u00e8me br\u00fbl\u00e9e.\n".encode("latin-1")


def test_text_error_pickles():
    e = pickle.loads(pickle.dumps(TextError("notes.txt is not UTF-8 text: byte 0xe9")))
    assert type(e) is TextError and str(e) == "notes.txt is not UTF-8 text: byte 0xe9"


@pytest.mark.parametrize("workers", [1, 2])
def test_prepare_names_the_first_byte_that_is_not_utf8(tmp_path, rng, enc, workers):
    good = "Stra\u00dfe \u6771\u4eac\n" * 40  # multi-byte UTF-8 before the bad byte
    offset = len(good.encode())
    cases = {
        "latin1.txt": (LATIN1 * 30, 3, 0xE9, 1),
        "mixed.txt": (good.encode() + LATIN1, offset + 3, 0xE9, 41),
        "random.txt": (good.encode() + b"\xff" + rng.bytes(5000), offset, 0xFF, 41),
    }
    lines = [json.dumps({"text": f"line {i}"}).encode() + b"\n" for i in range(5)]
    cases["corpus.jsonl"] = (b"".join(lines[:2]) + b'{"text": "' + LATIN1.strip() + b'"}\n'
                             + b"".join(lines[2:]), len(lines[0]) + len(lines[1]) + 13, 0xE9, 3)
    for name, (raw, at, byte, line) in cases.items():
        bad = tmp_path / name
        bad.write_bytes(raw)
        with pytest.raises(TextError) as e:
            data.prepare([bad], tmp_path / "out", workers=workers, progress=False)
        assert str(e.value) == (f"{bad} is not UTF-8 text: byte 0x{byte:02x} at offset {at} "
                                f"(line {line}) cannot be decoded (convert it, e.g. iconv -f "
                                f"latin1 -t utf-8)")
        assert "\n" not in str(e.value)


def test_a_failed_prepare_leaves_no_shards(tmp_path, rng, enc):
    """Shards written before the bad file are removed with their progress record: the same
    inputs would fail the same way, and the shards would pass for a whole data set. Once the
    file is mended, prepare makes all of it."""
    docs = make_documents(rng, 40)
    inputs = write_inputs(tmp_path, docs)
    bad = tmp_path / "notes.txt"
    bad.write_bytes(LATIN1)
    out = tmp_path / "out"
    kwargs = dict(workers=2, shard_tokens=200, val_tokens=200, progress=False)
    with pytest.raises(TextError, match="notes.txt is not UTF-8 text"):
        data.prepare([*inputs, bad], out, **kwargs)
    assert list(out.iterdir()) == []
    bad.write_text(LATIN1.decode("latin-1"), encoding="utf-8")
    result = data.prepare([*inputs, bad], out, **kwargs)
    expected = expected_tokens(enc, [*docs, LATIN1.decode("latin-1")])
    np.testing.assert_array_equal(np.concatenate([read_tokens(p) for p in result.files]),
                                  expected)


def test_cli_prepare_of_text_that_is_not_utf8(tmp_path, enc, capsys):
    bad = tmp_path / "notes.txt"
    bad.write_bytes(LATIN1 * 3)
    assert data.main(["prepare", str(bad), "--out", str(tmp_path / "d")]) == 2
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert lines == [f"error: {bad} is not UTF-8 text: byte 0xe9 at offset 3 (line 1) cannot be "
                     f"decoded (convert it, e.g. iconv -f latin1 -t utf-8)"], captured.err
    assert not list((tmp_path / "d").iterdir())


# ---- the validation split of a small corpus


def test_small_corpus_with_default_flags_trains(tmp_path, enc, capsys):
    """With the defaults (shards of 100M, validation one shard) a small corpus gets a tenth
    of its tokens as the validation split and the rest as training."""
    text = shared_data("tinyshakespeare.txt")
    out = tmp_path / "d"
    assert data.main(["prepare", str(text), "--out", str(out), "--workers", "1"]) == 0
    assert "warning" not in capsys.readouterr().err
    whole = np.concatenate([[enc.eot_token], enc.encode_ordinary(text.read_text())])
    val, train = out / "tinyshakespeare_val_000000.bin", out / "tinyshakespeare_train_000001.bin"
    assert sorted(out.glob("*.bin")) == [train, val]
    assert data.read_header(val) == len(whole) // 10 == data.default_val_tokens(len(whole))
    np.testing.assert_array_equal(np.concatenate([read_tokens(val), read_tokens(train)]), whole)
    again = data.prepare([text], out, workers=1, progress=False)  # complete: kept
    assert again.written == [] and again.skipped == [val, train]


def test_default_validation_split(tmp_path, rng, enc, monkeypatch):
    docs = make_documents(rng, 80)
    inputs = write_inputs(tmp_path, docs)
    expected = expected_tokens(enc, docs)
    total = len(expected)
    assert 10_000 < total < 20_000
    # Large for its shards (over ten of them): the validation split is one shard.
    large = data.prepare(inputs, tmp_path / "large", workers=2, shard_tokens=900,
                         progress=False)
    assert large.tokens == {"val": 900, "train": total - 900}
    # Fewer than ten shards: a tenth of the tokens, the rest in shards of shard_tokens.
    out = tmp_path / "small"
    small = data.prepare(inputs, out, workers=2, shard_tokens=2000, progress=False)
    assert small.tokens == {"val": total // 10, "train": total - total // 10}
    sizes = [data.read_header(p) for p in small.files]
    assert sizes[0] == total // 10 and all(s == 2000 for s in sizes[1:-1])
    assert [p.name for p in small.files[:2]] == ["corpus_val_000000.bin",
                                                 "corpus_train_000001.bin"]
    contents = [p.read_bytes() for p in small.files]
    np.testing.assert_array_equal(np.concatenate([read_tokens(p) for p in small.files]),
                                  expected)
    # The shards cut again at the end resume like any: a lost one is made again from the
    # documents after the one before it.
    k = len(small.files) // 2
    small.files[k].unlink()
    encoded = []
    encode = tokenizing._encode_document
    monkeypatch.setattr(tokenizing, "_encode_document",
                        lambda item: encoded.append(1) or encode(item))
    again = data.prepare(inputs, out, workers=1, shard_tokens=2000, progress=False)
    assert again.skipped == small.files[:k] and again.written == small.files[k:]
    assert [p.read_bytes() for p in again.files] == contents
    assert 0 < len(encoded) < len(docs)
    # A tiny corpus: too short for a tenth to be a token, it all trains.
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("Hi.")
    result = data.prepare([tiny], tmp_path / "tiny", workers=1, progress=False)
    assert result.tokens == {"train": 3} and result.files[0].name == "tiny_train_000000.bin"
