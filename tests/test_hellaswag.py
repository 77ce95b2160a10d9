"""HellaSwag scoring (issue 37): the batched scorer equals a direct computation from the model's
losses, one ending at a time. Needs TIKTOKEN_CACHE_DIR (or network access), else it skips."""

import json
import urllib.error
from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blujax import data, hellaswag
from blujax.data import TextError
from blujax.model import gpt2, ops as model_ops

CONFIG = gpt2.PRESETS["tiny"]  # block_size 128: the long context below is cut

ITEMS = [
    {"ctx": "A man is sitting on a roof. He",
     "endings": ["is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                 "is holding a rubik's cube.", "starts pulling up roofing on a roof."],
     "label": 3},
    {"ctx": "A woman is outside with a bucket and a dog. The dog is running around trying to "
            "avoid a bath. She",
     "endings": ["rinses the bucket off with soap and blow dry the dog's head.",
                 "uses a hose to keep it from getting soapy.",
                 "gets the dog wet, then it runs away again.",
                 "gets into a bath tub with the dog."],
     "label": "2"},  # as some copies of the file write it
    {"ctx": "How to make tea. " + "Boil the water, wait, and pour it over the leaves. " * 12
            + "Then you",
     "endings": ["drink it.", "let it steep for three to five minutes before you remove the "
                 "leaves and add milk or sugar to taste.", "fly.", "sing a song about tea."],
     "label": 1},
]


@pytest.fixture(scope="module")
def params():
    return gpt2.init(CONFIG, jax.random.key(0))


def write_items(path, items):
    path.write_text("".join(json.dumps(item) + "\n" for item in items))
    return path


@pytest.fixture
def items(tmp_path, enc):
    return hellaswag.load_items(write_items(tmp_path / "val.jsonl", ITEMS))


@cache
def forward(ops):
    return jax.jit(partial(gpt2.forward, config=CONFIG, ops=ops))  # eager XLA ops are slow


def direct_losses(params, item, ops):
    """Each ending's (sum, mean) cross-entropy of its tokens: the model run on the unpadded
    context + ending alone (its last block_size + 1 tokens), log-softmax over the real
    vocabulary."""
    out = []
    for ending in item.ending_tokens:
        seq = np.array(item.ctx_tokens + ending)[-(CONFIG.block_size + 1):]
        logits = forward(ops)(params, jnp.asarray(seq[None, :-1]))
        logp = jax.nn.log_softmax(logits[0, :, :CONFIG.vocab_size].astype(jnp.float32), -1)
        ce = -np.asarray(logp)[np.arange(len(seq) - 1), seq[1:]]
        scored = ce[-min(len(ending), len(seq) - 1):]
        out.append((scored.sum(), scored.mean()))
    return np.array(out)


def test_load_items_tokenizes_as_build_nanogpt(items, enc):
    assert len(items) == 3
    first = items[0]
    assert first.ctx_tokens == tuple(enc.encode("A man is sitting on a roof. He"))
    assert first.ending_tokens[3] == tuple(enc.encode(" starts pulling up roofing on a roof."))
    assert [item.label for item in items] == [3, 2, 1]
    # The long context does not fit the tiny model with its endings: it is cut on the left.
    assert len(items[2].ctx_tokens) + len(items[2].ending_tokens[1]) > CONFIG.block_size + 1


@pytest.mark.slow
@pytest.mark.parametrize("ops_name", model_ops.NAMES)
def test_score_equals_a_direct_computation(params, items, ops_name):
    ops = model_ops.get(ops_name)
    direct = [direct_losses(params, item, ops) for item in items]
    # rows_per_batch 3: several batches per length bucket, the last of them padded.
    batched = hellaswag.ending_losses(params, CONFIG, items, ops=ops, dtype=jnp.float32,
                                      rows_per_batch=3)
    for item, d, (total, count) in zip(items, direct, batched):
        np.testing.assert_allclose(total, d[:, 0], rtol=1e-5)
        np.testing.assert_allclose(total / count, d[:, 1], rtol=1e-5)
        assert list(count) == [min(len(e), CONFIG.block_size) for e in item.ending_tokens]
    expected = {
        "hellaswag_acc": np.mean([np.argmin(d[:, 0]) == i.label for d, i in zip(direct, items)]),
        "hellaswag_acc_norm": np.mean([np.argmin(d[:, 1]) == i.label
                                       for d, i in zip(direct, items)]),
        "hellaswag_n": 3}
    got = hellaswag.score(params, CONFIG, items, ops=ops, dtype=jnp.float32, rows_per_batch=3)
    assert got == pytest.approx(expected)


def test_labels_decide_accuracy(params, items):
    losses = hellaswag.ending_losses(params, CONFIG, items, ops="xla", dtype="f32")
    best = [int(np.argmin(total)) for total, _ in losses]
    best_norm = [int(np.argmin(total / count)) for total, count in losses]

    def relabelled(labels):
        return [hellaswag.Item(i.ctx_tokens, i.ending_tokens, label)
                for i, label in zip(items, labels)]

    right = hellaswag.score(params, CONFIG, relabelled(best), ops="xla", dtype="f32")
    assert right["hellaswag_acc"] == 1.0
    assert right["hellaswag_acc_norm"] == np.mean(np.equal(best, best_norm))
    wrong = hellaswag.score(params, CONFIG, relabelled([(b + 1) % 4 for b in best]),
                            ops="xla", dtype="f32")
    assert wrong["hellaswag_acc"] == 0.0
    two = hellaswag.score(params, CONFIG, relabelled(best[:2] + [(best[2] + 1) % 4]),
                          ops="xla", dtype="f32")
    assert two["hellaswag_acc"] == pytest.approx(2 / 3) and two["hellaswag_n"] == 3


def test_load_items_limit_and_blank_lines(tmp_path, enc):
    path = tmp_path / "val.jsonl"
    path.write_text(json.dumps(ITEMS[0]) + "\n\n" + json.dumps(ITEMS[1]) + "\n")
    assert len(hellaswag.load_items(path)) == 2
    assert [i.label for i in hellaswag.load_items(path, limit=1)] == [3]


@pytest.mark.parametrize("line, message", [
    ("{not json", r"bad.jsonl:2: not valid JSON"),
    (json.dumps({"endings": ["a", "b"], "label": 0}), r"bad.jsonl:2: no string field 'ctx'"),
    (json.dumps({"ctx": "x", "endings": "ab", "label": 0}),
     r"bad.jsonl:2: 'endings' must be a non-empty list of strings"),
    (json.dumps({"ctx": "x", "endings": ["a", "b"], "label": 2}),
     r"bad.jsonl:2: 'label' must be the index of the right ending, 0 to 1, got 2"),
    (json.dumps({"ctx": "x", "endings": ["a", "b"]}),
     r"bad.jsonl:2: 'label' must be the index of the right ending, 0 to 1, got None"),
    (json.dumps({"ctx": "", "endings": ["a", "b"], "label": 0}),
     r"bad.jsonl:2: the context is empty"),
])
def test_load_items_names_the_bad_line(tmp_path, enc, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ITEMS[0]) + "\n" + line + "\n")
    with pytest.raises(TextError, match=message):
        hellaswag.load_items(path)


def test_load_items_file_errors(tmp_path, enc):
    with pytest.raises(TextError, match="missing.jsonl: cannot read"):
        hellaswag.load_items(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TextError, match="empty.jsonl: no HellaSwag items"):
        hellaswag.load_items(tmp_path / "empty.jsonl")


def test_default_path_offline_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))

    def offline(url, dest, *, progress):
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(hellaswag, "_fetch", offline)
    with pytest.raises(hellaswag.DownloadError) as e:
        hellaswag.default_path()
    assert str(e.value) == (
        f"could not download the HellaSwag validation set from {hellaswag.VAL_URL} (Temporary "
        f"failure in name resolution); download it by hand and pass --hellaswag FILE")
    assert isinstance(e.value, data.DataError)
    cached = tmp_path / "blujax" / "hellaswag_val.jsonl"  # once there, it is used as it is
    cached.parent.mkdir()
    cached.write_text(json.dumps(ITEMS[0]) + "\n")
    assert hellaswag.default_path() == cached


def test_bucket_lengths():
    assert hellaswag.bucket_lengths(128) == [32, 48, 64, 96, 128]
    assert hellaswag.bucket_lengths(1024) == [32, 48, 64, 96, 128, 192, 256, 384, 512, 768,
                                              1024]
    assert hellaswag.bucket_lengths(100) == [32, 48, 64, 96, 100]
    assert hellaswag.bucket_lengths(16) == [16]
