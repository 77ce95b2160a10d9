"""HellaSwag: sentence completion, scored as build-nanogpt and llm.c score it.

    items = load_items(default_path(), tokenizer=tok)  # the official validation set, 10,042
                                                       # items, in the model's tokenizer
    score(params, config, items, ops=blujax.kernels, dtype=jnp.bfloat16)
    # {"hellaswag_acc": ..., "hellaswag_acc_norm": ..., "hellaswag_n": 10042}

Each item is a context and (four) endings, one of them right. The context is tokenized with
the model's tokenizer (GPT-2's by default) and each ending as " " + ending; an ending's score is the cross-entropy of its
tokens given the context and the ending's tokens before them: their sum for acc, their mean
for acc_norm (normalised by tokens, not by bytes as lm-evaluation-harness does). The
prediction is the ending of the lowest score (the first of equal ones). A context too long
for the model loses its first tokens: each row is the last block_size + 1 tokens of
context + ending.

The 4 endings of an item are 4 rows. Rows are padded to a few lengths (32, 48, 64, 96, 128,
192, ... up to block_size: at most half again a row's length) and packed rows_per_batch to a
batch, so that a handful of shapes compile (one a length). One jitted function per shape runs
the model's blocks over the batch, its LM head and loss only at the ending tokens (most of the
work of a small model, and an ending is a fifth or so of a row), and returns each row's summed
loss: only those come back from the device.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import urllib.error
from functools import partial
from pathlib import Path

import jax
import numpy as np

from blujax import data
from blujax.data.tokenizer import gpt2 as gpt2_tokenizer
from blujax.evaluate import resolve
from blujax.fetch import download, user_cache_dir
from blujax.model import family_of

VAL_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
VAL_NAME = "hellaswag_val.jsonl"
VAL_ITEMS = 10042


class DownloadError(data.DataError):
    """The official validation set could not be downloaded; the message says what to do."""


@dataclasses.dataclass(frozen=True)
class Item:
    ctx_tokens: tuple[int, ...]
    ending_tokens: tuple[tuple[int, ...], ...]
    label: int


def load_items(path, *, limit: int | None = None, tokenizer=None) -> list[Item]:
    """The items of an official-format HellaSwag .jsonl file (one JSON object a line with
    `ctx`, `endings` and `label`), tokenized with `tokenizer` (a blujax.data.Tokenizer, the
    model's; None: GPT-2's); the first `limit` of them if given. A line that is not such an
    item raises blujax.data.TextError naming file:line."""
    path = Path(path)
    tokenizer = tokenizer or gpt2_tokenizer()
    items = []
    try:
        f = open(path, "rb")
    except OSError as e:
        raise data.TextError(f"{path}: cannot read: {e.strerror or e}") from None
    with f:
        offset = 0
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(items) >= limit:
                break
            start, offset = offset, offset + len(line)
            if not line.strip():
                continue
            text = data.decode_text(line, path, start, lineno).removeprefix("\ufeff")
            ctx, endings, label = _fields(text, f"{path}:{lineno}")
            ctx_tokens = tuple(tokenizer.encode(ctx))
            if not ctx_tokens:
                raise data.TextError(f"{path}:{lineno}: the context is empty: there is "
                                     f"nothing to condition the endings on")
            items.append(Item(ctx_tokens,
                              tuple(tuple(tokenizer.encode(" " + e)) for e in endings),
                              label))
    if not items:
        raise data.TextError(f"{path}: no HellaSwag items in the file")
    return items


def _fields(text: str, where: str) -> tuple[str, list[str], int]:
    try:
        record = json.loads(text)
    except ValueError as e:
        raise data.TextError(f"{where}: not valid JSON ({e})") from None
    if not isinstance(record, dict):
        raise data.TextError(f"{where}: not a JSON object with ctx, endings and label")
    ctx, endings, label = record.get("ctx"), record.get("endings"), record.get("label")
    if not isinstance(ctx, str):
        raise data.TextError(f"{where}: no string field 'ctx'")
    if (not isinstance(endings, list) or not endings
            or not all(isinstance(e, str) for e in endings)):
        raise data.TextError(f"{where}: 'endings' must be a non-empty list of strings")
    # The official file has integer labels; other copies of it write them as strings.
    if isinstance(label, str) and label.strip().isdigit():
        label = int(label)
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < len(endings):
        raise data.TextError(f"{where}: 'label' must be the index of the right ending, 0 to "
                             f"{len(endings) - 1}, got {label!r}")
    return ctx, endings, label


def default_path(*, progress: bool = False) -> Path:
    """The official validation set: in the user cache, else downloaded there once."""
    path = user_cache_dir() / VAL_NAME
    if path.is_file():
        return path
    try:
        _fetch(VAL_URL, path, progress=progress)
    except (OSError, urllib.error.URLError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise DownloadError(f"could not download the HellaSwag validation set from {VAL_URL} "
                            f"({reason}); download it by hand and pass --hellaswag FILE") \
            from None
    return path


def _fetch(url: str, dest: Path, *, progress: bool):
    """url to dest, atomically. No sha256 is pinned (none could be checked when this was
    written); a download cut short, or of another file, fails the Content-Length or item
    count check instead."""
    def check(path: Path):
        with open(path, "rb") as f:
            lines = sum(1 for line in f if line.strip())
        if lines != VAL_ITEMS:
            raise ValueError(f"the file has {lines} lines, not the {VAL_ITEMS} items of the "
                             f"validation set")

    download(url, dest, progress=progress, check=check)


def bucket_lengths(block_size: int) -> list[int]:
    """The lengths rows are padded to: 32, 48, 64, 96, ... (two a doubling, so that padding
    adds at most half a row) below block_size, then block_size itself."""
    sizes, n = [], 32
    while n < block_size:
        sizes += [m for m in (n, n * 3 // 2) if m < block_size]
        n *= 2
    return sizes + [block_size]


def _rows(items: list[Item], block_size: int):
    """Every (item, ending) row: its tokens (the last block_size + 1 of context + ending; the
    model sees all but the last) and how many of them, at the end, are scored."""
    for item in items:
        for ending in item.ending_tokens:
            seq = (item.ctx_tokens + ending)[-(block_size + 1):]
            yield seq, min(len(ending), len(seq) - 1)


def score(params, config, items: list[Item], *, ops, dtype, rows_per_batch: int = 64,
          progress=None) -> dict:
    """{"hellaswag_acc", "hellaswag_acc_norm", "hellaswag_n"} of the model over the items:
    the fractions of items whose lowest summed (acc) and lowest mean (acc_norm) ending loss
    is the labelled ending. Arguments as `ending_losses`."""
    right = right_norm = 0
    for item, (total, count) in zip(items, ending_losses(
            params, config, items, ops=ops, dtype=dtype, rows_per_batch=rows_per_batch,
            progress=progress)):
        right += int(np.argmin(total)) == item.label
        right_norm += int(np.argmin(total / count)) == item.label
    n = len(items)
    return {"hellaswag_acc": right / n, "hellaswag_acc_norm": right_norm / n, "hellaswag_n": n}


def ending_losses(params, config, items: list[Item], *, ops, dtype, rows_per_batch: int = 64,
                  progress=None) -> list[tuple[np.ndarray, np.ndarray]]:
    """For each item, (the summed cross-entropy of each ending's tokens given what precedes
    them, float64 [endings]; the number of tokens summed, int [endings]).

    ops: a namespace (or "ffi" / "xla"); dtype: the forward's ("f32" / "bf16" or a dtype).
    progress: True for a progress bar on stderr, or a callable(rows_done, rows_total)."""
    ops, dtype = resolve(ops, dtype)
    if not items:
        raise ValueError("hellaswag: no items to score")
    if not isinstance(rows_per_batch, int) or rows_per_batch < 1:
        raise ValueError(f"rows_per_batch must be a positive integer, got {rows_per_batch!r}")
    for i, item in enumerate(items):
        if not item.ctx_tokens or not item.ending_tokens or not all(item.ending_tokens):
            raise ValueError(f"hellaswag: item {i} has an empty context, no endings or an "
                             f"empty ending")
    rows = list(_rows(items, config.block_size))
    scored = np.array([n for _, n in rows])
    lengths = np.array([len(seq) - 1 for seq, _ in rows])
    sizes = np.array(bucket_lengths(config.block_size))
    bucket = np.searchsorted(sizes, lengths)  # the smallest size >= each length

    # Every batch is dispatched before any result is read, so the device never waits on the
    # host. Each bucket has one shape: its rows (fewer than rows_per_batch if it has fewer),
    # and room for the scored tokens of its fullest batch.
    pending = []
    for b in np.unique(bucket):
        members = np.flatnonzero(bucket == b)
        batches = [members[i:i + rows_per_batch] for i in range(0, members.size, rows_per_batch)]
        R, L = min(rows_per_batch, members.size), int(sizes[b])
        N = -(-max(int(scored[batch].sum()) for batch in batches) // 64) * 64
        for batch in batches:
            inputs = np.zeros((R, L), np.int32)
            # The scored tokens of all rows in one list: where each is in inputs (flat
            # index), its token, its row; the unused places target -1, which scores 0.
            where, targets, row = np.zeros(N, np.int32), np.full(N, -1, np.int32), \
                np.zeros(N, np.int32)
            k = 0
            for j, r in enumerate(batch):
                seq, n = rows[r]
                inputs[j, :len(seq) - 1] = seq[:-1]
                where[k:k + n] = j * L + np.arange(len(seq) - 1 - n, len(seq) - 1)
                targets[k:k + n] = seq[-n:]
                row[k:k + n] = j
                k += n
            pending.append((batch, _row_losses(params, inputs, where, targets, row,
                                               config=config, ops=ops, dtype=dtype)))

    bar = None
    if progress is True:
        from tqdm import tqdm
        bar = tqdm(total=len(rows), unit="row", desc="hellaswag", file=sys.stderr)
    sums = np.empty(len(rows), np.float64)
    done = 0
    for batch, result in pending:
        sums[batch] = np.asarray(result)[:batch.size]
        done += batch.size
        if bar is not None:
            bar.update(batch.size)
        elif callable(progress):
            progress(done, len(rows))
    if bar is not None:
        bar.close()

    out, r = [], 0
    for item in items:
        k = len(item.ending_tokens)
        out.append((sums[r:r + k], scored[r:r + k]))
        r += k
    return out


@partial(jax.jit, static_argnames=("config", "ops", "dtype"))
def _row_losses(params, inputs, where, targets, row, *, config, ops, dtype):
    """float32 [R]: per row of inputs [R, L], the summed cross-entropy of the tokens `targets`
    [N] predicted at the flat positions `where` [N] of rows `row` [N] (-1 targets add 0).

    The model's forward, but the LM head and the loss only at the scored positions: they
    are most of the work (the whole of it for the small presets on a CPU), and an ending is a
    fifth or so of a row."""
    family = family_of(config)
    h = family.hidden(params, inputs, config=config, ops=ops, dtype=dtype)
    logits = family.head(params, h.reshape(-1, h.shape[-1])[where], dtype=dtype)
    losses = ops.softmax_cross_entropy(logits, targets, ignore_index=-1,
                                       num_classes=config.vocab_size)
    return jax.ops.segment_sum(losses, row, num_segments=inputs.shape[0])
