"""The fixed evaluation of issue 37: its rows and its loss (its tokens, blujax.data.eval_tokens:
tests/test_data_sources.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blujax import evaluate
from blujax.data import DataError
from blujax.evaluate import evaluate_loss, loss_batches
from blujax.model import gpt2, ops as model_ops

CONFIG = gpt2.PRESETS["tiny"]


@pytest.fixture(scope="module")
def params():
    return gpt2.init(CONFIG, jax.random.key(0))


# ---- the rows of the definition


def test_loss_batches_are_the_rows_of_the_definition():
    tokens = np.arange(90, dtype=np.uint16)
    B, T = 3, 8
    batches = loss_batches(tokens, batch=B, seq=T, max_batches=None)
    # (90 - 1) // 8 = 11 whole rows: batches of 3, 3, 3 and a last one of 2.
    assert [x.shape for x, _ in batches] == [(3, 8), (3, 8), (3, 8), (2, 8)]
    for k, (x, y) in enumerate(batches):
        assert x.dtype == y.dtype == np.int32
        for r in range(x.shape[0]):
            start = (k * B + r) * T
            row = np.arange(start, start + T + 1)  # tokens [start, start + T], inclusive
            np.testing.assert_array_equal(x[r], row[:-1])
            np.testing.assert_array_equal(y[r], row[1:])
    assert batches[-1][1][-1, -1] == 88  # the last predicted token; 89 is in no whole row


def test_loss_batches_counts():
    tokens = np.arange(90)
    assert len(loss_batches(tokens, batch=3, seq=8, max_batches=2)) == 2
    assert len(loss_batches(tokens, batch=3, seq=8, max_batches=0)) == 4  # 0: all
    assert len(loss_batches(tokens, batch=3, seq=8, max_batches=100)) == 4
    (x, y), = loss_batches(np.arange(9), batch=4, seq=8, max_batches=None)  # one row exactly
    np.testing.assert_array_equal(x, [np.arange(8)])
    np.testing.assert_array_equal(y, [np.arange(1, 9)])


def test_loss_batches_errors():
    with pytest.raises(DataError, match=r"the evaluation tokens \(8\) are fewer than one row "
                                        r"of seq \+ 1 = 9 tokens"):
        loss_batches(np.arange(8), batch=4, seq=8, max_batches=None)
    with pytest.raises(ValueError, match="seq must be a positive integer, got 0"):
        loss_batches(np.arange(8), batch=4, seq=0, max_batches=None)
    with pytest.raises(ValueError, match="max_batches must be None or an integer >= 0"):
        loss_batches(np.arange(80), batch=4, seq=8, max_batches=-1)


# ---- the loss


def direct_loss(params, tokens, rows, seq, ops):
    """The mean cross-entropy of the first `rows` rows, computed as the definition reads."""
    chunk = np.asarray(tokens[:rows * seq + 1], np.int32)
    x, y = chunk[:-1].reshape(rows, seq), chunk[1:].reshape(rows, seq)
    logits = gpt2.forward(params, jnp.asarray(x), config=CONFIG, ops=ops)
    logp = jax.nn.log_softmax(logits[..., :CONFIG.vocab_size].astype(jnp.float32), axis=-1)
    return float(-jnp.take_along_axis(logp, jnp.asarray(y)[..., None], axis=-1).mean())


@pytest.mark.slow
@pytest.mark.parametrize("ops_name", model_ops.NAMES)
def test_evaluate_loss_equals_a_direct_computation(params, ops_name):
    ops = model_ops.get(ops_name)
    tokens = np.random.default_rng(0).integers(0, CONFIG.vocab_size, 16 * 7 + 5)
    # 7 whole rows of 16 in batches of 3: the last batch has one row (padded on the device).
    out = evaluate_loss(params, CONFIG, tokens, batch=3, seq=16, max_batches=None, ops=ops,
                        dtype=jnp.float32)
    assert out == {"val_loss": pytest.approx(direct_loss(params, tokens, 7, 16, ops),
                                             rel=1e-5),
                   "batches": 3, "tokens": 7 * 16, "batch": 3, "seq": 16}
    first = evaluate_loss(params, CONFIG, tokens, batch=3, seq=16, max_batches=2, ops=ops_name,
                          dtype="f32")
    assert first["val_loss"] == pytest.approx(direct_loss(params, tokens, 6, 16, ops), rel=1e-5)
    assert (first["batches"], first["tokens"]) == (2, 6 * 16)


def test_evaluate_loss_does_not_depend_on_the_batch_with_all_rows(params):
    tokens = np.random.default_rng(1).integers(0, CONFIG.vocab_size, 16 * 7 + 5)
    losses = [evaluate_loss(params, CONFIG, tokens, batch=b, seq=16, max_batches=None,
                            ops="xla", dtype="f32")["val_loss"] for b in (1, 3, 7, 8)]
    assert losses == pytest.approx([losses[0]] * 4, rel=1e-6)


def test_evaluate_loss_bf16_is_close_to_f32(params):
    tokens = np.random.default_rng(2).integers(0, CONFIG.vocab_size, 16 * 4 + 1)
    f32, bf16 = (evaluate_loss(params, CONFIG, tokens, batch=4, seq=16, max_batches=None,
                               ops="ffi", dtype=d)["val_loss"] for d in ("f32", "bf16"))
    assert bf16 != f32 and bf16 == pytest.approx(f32, rel=1e-2)


def test_evaluate_loss_errors(params):
    with pytest.raises(ValueError, match="seq 129 is longer than the model's block_size 128"):
        evaluate_loss(params, CONFIG, np.arange(1000), batch=1, seq=129, max_batches=None,
                      ops="xla", dtype="f32")
    tokens = np.full(33, CONFIG.vocab_size, np.int64)
    with pytest.raises(DataError, match="include 50257, not below the model's vocabulary "
                                        "size 50257"):
        evaluate_loss(params, CONFIG, tokens, batch=1, seq=32, max_batches=None, ops="xla",
                      dtype="f32")


def test_definition_states_the_rows():
    d = evaluate.EVAL_DEFINITION
    assert "[(k*B + r)*T, (k*B + r)*T + T]" in d and "encode_ordinary" in d
    assert "no <|endoftext|>" in d and "NAME_val_000000.bin" in d
