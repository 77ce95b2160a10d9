"""Evaluation with one fixed definition, so that a loss compares across tools and runs.

    tokens, what = blujax.data.eval_tokens("data/fineweb10B/")  # its validation split
    result = evaluate_loss(params, config, tokens, batch=8, seq=1024, max_batches=20,
                           ops=blujax.kernels, dtype=jnp.bfloat16)
    result["val_loss"]                                      # EVAL_DEFINITION says what it is

The rows are read as llm.c's loader and blujax.data.DataLoader (unshuffled) read a shard from
its start, one chunk of B*T + 1 tokens per batch, batch k's at token k*B*T: over one
validation shard, the validation loss a training run logs for the same B, T and K (whole
batches) is the same number.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from blujax import data
from blujax.model import family_of
from blujax.model import ops as ops_module
from blujax.train import DTYPES
from blujax.vocab import GPT2_PADDED_VOCAB_SIZE, GPT2_VOCAB_SIZE

EVAL_DEFINITION = f"""\
val_loss is the mean next-token cross-entropy (nats; float32; softmax over the real
vocabulary, {GPT2_VOCAB_SIZE} tokens for GPT-2, not the padded \
{GPT2_PADDED_VOCAB_SIZE}) over every predicted token of the
first K batches (--eval-batches K; 0 or none: all) of B rows (--batch) of T + 1 consecutive
tokens (--seq T), read in order from the start of the evaluation tokens: row r of batch k
covers tokens [(k*B + r)*T, (k*B + r)*T + T], its first T the inputs and its last T the
targets. Only whole rows count; the last batch may have fewer than B rows, so with all
batches every whole row counts once and the loss does not depend on B. The evaluation
tokens: of a text file, the whole UTF-8 text encoded by the model's tokenizer without
special tokens (GPT-2's encode_ordinary for GPT-2: no <|endoftext|> or bos added anywhere); of
a shard directory or glob, its validation shards (val as a word of the name, as in
NAME_val_000000.bin) concatenated in name order (a row may span two shards); of one .bin
shard, all its tokens."""


def loss_batches(tokens, *, batch: int, seq: int,
                 max_batches: int | None) -> list[tuple[np.ndarray, np.ndarray]]:
    """The (inputs, targets) int32 [rows, seq] batches of EVAL_DEFINITION: batch k row r is
    tokens[(k*batch + r)*seq : (k*batch + r)*seq + seq + 1], its first seq tokens the inputs
    and its last seq the targets. Whole rows only; the last batch may have fewer than `batch`
    rows. max_batches None or 0: all of them. A DataError when not even one row fits."""
    for name, value in (("batch", batch), ("seq", seq)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if max_batches is not None and (not isinstance(max_batches, (int, np.integer))
                                    or isinstance(max_batches, bool) or max_batches < 0):
        raise ValueError(f"max_batches must be None or an integer >= 0, got {max_batches!r}")
    tokens = np.asarray(tokens)
    rows = (tokens.size - 1) // seq
    if rows < 1:
        raise data.DataError(f"the evaluation tokens ({tokens.size:,}) are fewer than one row "
                             f"of seq + 1 = {seq + 1} tokens: use a shorter seq or more data")
    n = math.ceil(rows / batch)
    if max_batches:
        n = min(n, max_batches)
    out = []
    for k in range(n):
        r = min(batch, rows - k * batch)
        # One contiguous chunk per batch, as llm.c reads it; inputs and targets are views of it.
        chunk = tokens[k * batch * seq:k * batch * seq + r * seq + 1].astype(np.int32)
        out.append((chunk[:-1].reshape(r, seq), chunk[1:].reshape(r, seq)))
    return out


@partial(jax.jit, static_argnames=("config", "ops", "dtype"))
def row_losses(params, inputs, targets, *, config, ops, dtype):
    """float32 [rows]: each row's sum of next-token cross-entropies, over the real vocabulary
    (config.vocab_size columns), of its targets that are not -1. inputs, targets: int32
    [rows, T]. The forward runs in `dtype`; the loss is float32. Compiled once per shape."""
    logits = family_of(config).forward(params, inputs, config=config, ops=ops, dtype=dtype)
    losses = ops.softmax_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                       ignore_index=-1, num_classes=config.vocab_size)
    return losses.reshape(targets.shape).sum(axis=-1)


def resolve(ops, dtype):
    """ops as a namespace ("ffi" / "xla" names one) and dtype as a numpy dtype ("f32" / "bf16"
    name one), so that the jitted functions see one static value per choice."""
    if isinstance(ops, str):
        ops = ops_module.get(ops)
    if isinstance(dtype, str) and dtype in DTYPES:
        dtype = DTYPES[dtype]
    return ops, jnp.dtype(dtype)


def evaluate_loss(params, config, tokens, *, batch: int, seq: int,
                  max_batches: int | None, ops, dtype) -> dict:
    """EVAL_DEFINITION's val_loss of the model over `tokens`, with what it covered:
    {"val_loss", "batches", "tokens" (predicted tokens), "batch", "seq"}."""
    ops, dtype = resolve(ops, dtype)
    if seq > config.block_size:
        raise ValueError(f"seq {seq} is longer than the model's block_size "
                         f"{config.block_size}")
    batches = loss_batches(tokens, batch=batch, seq=seq, max_batches=max_batches)
    top = max(max(int(x.max()), int(y.max())) for x, y in batches)
    if top >= config.vocab_size:
        raise data.DataError(f"the evaluation tokens include {top}, not below the model's "
                             f"vocabulary size {config.vocab_size}")
    rows = batches[0][0].shape[0]
    sums = []
    for x, y in batches:
        if x.shape[0] < rows:
            # The short last batch padded to the others' shape (no second compile); its padding
            # rows' targets are -1, which the loss leaves out.
            pad = ((0, rows - x.shape[0]), (0, 0))
            x, y = np.pad(x, pad), np.pad(y, pad, constant_values=-1)
        sums.append(row_losses(params, x, y, config=config, ops=ops, dtype=dtype))
    # float64 on the host across batches: millions of tokens would lose digits in float32.
    total = sum(float(np.asarray(s, np.float64).sum()) for s in sums)
    count = sum(x.size for x, _ in batches)
    return {"val_loss": total / count, "batches": len(batches), "tokens": count,
            "batch": batch, "seq": seq}
