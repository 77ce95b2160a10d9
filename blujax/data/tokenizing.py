"""Tokenizing documents into shards: prepare(), its train/validation layout, the worker
processes, and the progress record that lets a re-run keep complete shards and go on."""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import multiprocessing
import os
import re
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from blujax.data import provenance
from blujax.data.errors import DataError, ShardError, TextError
from blujax.data.shards import Shard, read_header, token_dtype, write_shard
from blujax.data.text import _documents
from blujax.data.tokenizer import GPT2, GPT2_FINGERPRINT, Tokenizer, describe, load_tokenizer

DEFAULT_SHARD_TOKENS = 100_000_000
# Without --val-tokens the validation split is one shard, but at most this share of the corpus.
DEFAULT_VAL_FRACTION = 0.1

# The names prepare() gives shards: {name}_{split}_{index:06d}.bin.
_SHARD_NAME = re.compile(r"^(?P<name>.+)_(?P<split>train|val)_(?P<index>\d{6})\.bin$")


_WORKER_TOKENIZER = None  # a worker process's tokenizer, loaded once by _init_worker


def _init_worker(tokenizer):
    """tokenizer: a Tokenizer (in this process), or its spec (in a worker process)."""
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = (tokenizer if isinstance(tokenizer, Tokenizer)
                         else load_tokenizer(tokenizer))


def _encode_document(item):
    """[doc_token] + the document's tokens, as llm.c's fineweb.py writes them (GPT-2's
    end-of-text, or a Hugging Face tokenizer's bos). Special-token text inside a document is
    encoded as plain text, never as a control token."""
    text, nbytes = item
    tok = _WORKER_TOKENIZER
    ids = tok.encode(text)
    tokens = np.empty(len(ids) + 1, token_dtype(tok.vocab_size))
    tokens[0] = tok.doc_token
    tokens[1:] = ids
    return tokens, nbytes


@dataclasses.dataclass
class PrepareResult:
    files: list[Path]       # every shard of the data set, in order
    written: list[Path]     # those this run wrote
    skipped: list[Path]     # those already complete from an earlier run
    tokens: dict[str, int]  # tokens per split


def default_val_tokens(total_tokens: int, shard_tokens: int = DEFAULT_SHARD_TOKENS) -> int:
    """The validation split prepare() makes without val_tokens: one shard's worth, as llm.c's
    fineweb.py keeps, but at most a tenth of the corpus, so that a small one trains on the
    other nine tenths (tinyshakespeare: 33,802 of its 338,025 tokens; llm.c keeps 32,768)."""
    return min(shard_tokens, int(total_tokens * DEFAULT_VAL_FRACTION))


def _shard_sizes(shard_tokens: int, val_tokens: int):
    """(split, capacity) of shard 0, 1, ...: the first val_tokens go to val, in shards of at
    most shard_tokens, and the rest to train."""
    index, left = 0, val_tokens
    while left > 0:
        size = min(shard_tokens, left)
        yield "val", size
        left -= size
        index += 1
    while True:
        yield "train", shard_tokens


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def prepare(inputs: Sequence, out_dir, *, name: str | None = None,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, val_tokens: int | None = None,
            workers: int | None = None, doc_separator: str | None = None,
            text_field: str = "text", tokenizer: Tokenizer | str = GPT2,
            progress: bool = True) -> PrepareResult:
    """Tokenizes documents into llm.c shards `{name}_{val|train}_{index:06d}.bin` in out_dir.

    `tokenizer` (a Tokenizer, or what load_tokenizer takes: "gpt2" or a model folder) makes
    the tokens: uint16 shards for a vocabulary of up to 65,536 tokens, else uint32 ones (wide,
    llm.c's Llama 3 format); the folder's sidecar (provenance.SIDECAR) records which. A folder
    holds one tokenizer's shards: other shards there of another tokenizer raise a DataError.

    Every document is written as [tokenizer.doc_token] + its tokens (GPT-2's end-of-text as
    llm.c writes it, a Hugging Face tokenizer's bos). The first val_tokens tokens form
    the validation split, the rest the training split. Without val_tokens the validation
    split is one shard's worth (as llm.c's fineweb.py), but at most a tenth of the corpus
    (default_val_tokens), so that a small corpus still has tokens to train on. Tokenizing
    streams, so the total is known only at the end: the shards are written as for a large
    corpus, and those of a small one (fewer than ten shards) are cut again at the end.

    `workers` processes tokenize in parallel (default: all CPUs; 1 tokenizes in this
    process). A re-run with the same inputs and settings keeps every complete shard (checked
    against the sha256 it recorded) and continues after the last one, without tokenizing the
    documents before it again; partial shards are rewritten. Input that is not UTF-8, or not
    JSON lines with a `text_field` string, raises TextError naming the file and the place;
    the shards of this name are then removed, since the same inputs would fail the same way
    again and shards left behind would pass for a whole data set.
    """
    inputs = [Path(p) for p in inputs]
    if not inputs:
        raise ValueError("no input files")
    for p in inputs:
        if not p.is_file():
            raise FileNotFoundError(f"input {p} is not a file")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be positive, got {shard_tokens}")
    if val_tokens is not None:
        val_tokens = int(val_tokens)
        if val_tokens < 0:
            raise ValueError(f"val_tokens must be >= 0, got {val_tokens}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    name = name or inputs[0].name.split(".")[0]
    # Loaded here, so that it fails early when it cannot load.
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else load_tokenizer(tokenizer)
    _check_folder(out_dir, name, tok)
    workers = (os.cpu_count() or 1) if workers is None else max(1, int(workers))
    if tok.folder is None and not tok.is_gpt2:
        workers = 1  # one made in code: a worker process could not load it from its spec

    settings = {"inputs": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns]
                           for p in inputs],
                "shard_tokens": shard_tokens, "val_tokens": val_tokens,
                "doc_separator": doc_separator, "text_field": text_field,
                "tokenizer": tok.fingerprint}
    progress_path = out_dir / f"{name}.prepare.json"
    provenance.record_tokenizer(out_dir, tok)  # before the first shard it names
    for partial in out_dir.glob(f"{glob.escape(name)}_*.bin.tmp"):
        partial.unlink()  # a shard an interrupted run was writing
    done, layout = _completed_shards(progress_path, settings, out_dir)
    if val_tokens is not None:
        layout = val_tokens
    elif not done:
        layout = shard_tokens  # as if the corpus were large: see the end
    records = list(done)
    written: list[Path] = []
    if not (done and done[-1]["last"]):
        # Shards of this name that this run does not continue: an earlier run's with other
        # inputs or settings, which with these would pass for one data set.
        _remove_shards(out_dir, name, keep=records)
        _save_progress(progress_path, settings, layout, records)
        try:
            _tokenize(inputs, out_dir, name, records, written, shard_tokens, layout,
                      lambda: _save_progress(progress_path, settings, layout, records),
                      workers, doc_separator, text_field, tok, progress)
        except DataError:
            _remove_shards(out_dir, name, keep=[])
            progress_path.unlink(missing_ok=True)
            if not any(out_dir.glob("*.bin")):
                (out_dir / provenance.SIDECAR).unlink(missing_ok=True)
            raise
    if val_tokens is None:
        final = default_val_tokens(sum(r["tokens"] for r in records), shard_tokens)
        if final != layout:
            records = _recut(out_dir, name, records, shard_tokens, final, tok)
            written = [out_dir / r["file"] for r in records]
            _save_progress(progress_path, settings, final, records)

    files = [out_dir / r["file"] for r in records]
    _remove_shards(out_dir, name, keep=records)  # beyond the last: an earlier, longer run's
    tokens = _count_splits(records)
    if val_tokens and not tokens.get("train"):
        n = tokens.get('val', 0)
        print(f"warning: all {n} token{'s' * (n != 1)} went to the validation split; "
              f"lower val_tokens to leave some for training", file=sys.stderr)
    return PrepareResult(files, written, [f for f in files if f not in written], tokens)


def _tokenize(inputs, out_dir: Path, name: str, records: list, written: list,
              shard_tokens: int, val_tokens: int, save_progress, workers: int,
              doc_separator, text_field: str, tokenizer: Tokenizer, progress: bool):
    """prepare()'s streaming part: tokenizes the documents after the shards in `records` (an
    earlier run's) into shards of the layout of val_tokens, appending to records and written
    and saving the progress after each shard."""
    next_doc, skip = (records[-1]["next_doc"], records[-1]["next_offset"]) if records else (0, 0)
    sizes = _shard_sizes(shard_tokens, val_tokens)
    for _ in records:
        next(sizes)
    total_bytes = sum(p.stat().st_size for p in inputs)

    from tqdm import tqdm
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, disable=not progress or None,
               desc=f"tokenizing into {out_dir}", file=sys.stderr)
    split, capacity = next(sizes)
    dtype = token_dtype(tokenizer.vocab_size)
    buf = np.empty(capacity if capacity else 1, dtype)
    fill = 0

    def flush(cursor, last):
        nonlocal split, capacity, buf, fill
        index = len(records)
        path = out_dir / f"{name}_{split}_{index:06d}.bin"
        write_shard(path, buf[:fill], wide=dtype.itemsize == 4)
        records.append({"file": path.name, "split": split, "tokens": int(fill),
                        "sha256": _file_sha256(path), "next_doc": cursor[0],
                        "next_offset": cursor[1], "last": last})
        save_progress()
        written.append(path)
        bar.set_postfix_str(f"{path.name} written")
        split, capacity = next(sizes)
        if buf.size < capacity:
            buf = np.empty(capacity, dtype)
        fill = 0

    docs = _documents(inputs, doc_separator, text_field)
    pool = None
    try:
        def pending():
            for index, item in enumerate(docs):
                if index < next_doc:
                    bar.update(item[1])  # read again, not tokenized again
                    continue
                yield item

        if workers > 1:
            context = multiprocessing.get_context(
                "forkserver" if "forkserver" in multiprocessing.get_all_start_methods()
                else "spawn")  # never fork: the caller may run JAX's threads
            pool = context.Pool(workers, initializer=_init_worker, initargs=(tokenizer.spec,))
            encoded = pool.imap(_encode_document, pending(), chunksize=8)
        else:
            _init_worker(tokenizer)
            encoded = map(_encode_document, pending())
        doc_index = next_doc
        for tokens, nbytes in encoded:
            offset = skip if doc_index == next_doc else 0
            while offset < len(tokens):
                take = min(capacity - fill, len(tokens) - offset)
                buf[fill:fill + take] = tokens[offset:offset + take]
                fill += take
                offset += take
                if fill == capacity:
                    cursor = ((doc_index, offset) if offset < len(tokens)
                              else (doc_index + 1, 0))
                    flush(cursor, last=False)
            doc_index += 1
            bar.update(nbytes)
        if doc_index == 0:
            raise TextError(f"no documents in {', '.join(map(str, inputs))}")
        if fill or not records:
            flush((doc_index, 0), last=True)
        else:
            records[-1]["last"] = True
            save_progress()
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        # An exception's traceback keeps this frame: without these references the pool's
        # locks go now, not in a garbage collection that may run inside multiprocessing's
        # resource tracker (which then warns of a leak).
        pool = encoded = None
        bar.close()


def _recut(out_dir: Path, name: str, records: list, shard_tokens: int, val_tokens: int,
           tokenizer: Tokenizer) -> list[dict]:
    """The complete data set of `records` written again as shards of the layout of
    val_tokens; returns their records. The old files are read through mappings, which keep
    them readable while new ones of the same names replace them. Every document begins with
    the tokenizer's doc_token (which its encode() never makes of text), so where each shard
    ends in the documents, for a re-run to resume from, is found by counting those tokens."""
    doc_token = tokenizer.doc_token
    dtype = token_dtype(tokenizer.vocab_size)
    old = [Shard(out_dir / r["file"], check_tokens=False) for r in records]
    try:
        bounds = np.cumsum([0] + [s.num_tokens for s in old]).tolist()
        total = bounds[-1]

        def tokens(a: int, b: int) -> np.ndarray:  # [a, b) of the whole data set
            out = np.empty(b - a, dtype)
            for shard, lo, hi in zip(old, bounds, bounds[1:]):
                if lo < b and a < hi:
                    out[max(a, lo) - a:min(b, hi) - a] = \
                        shard.tokens[max(a, lo) - lo:min(b, hi) - lo]
            return out

        new, sizes = [], _shard_sizes(shard_tokens, val_tokens)
        pos = docs = doc_start = 0  # docs: documents begun before pos; the last at doc_start
        while pos < total:
            split, capacity = next(sizes)
            part = tokens(pos, min(total, pos + capacity))
            starts = np.flatnonzero(part == doc_token)
            docs += len(starts)
            if len(starts):
                doc_start = pos + int(starts[-1])
            pos += len(part)
            if pos == total or tokens(pos, pos + 1)[0] == doc_token:
                cursor = (docs, 0)
            else:
                cursor = (docs - 1, pos - doc_start)
            path = write_shard(out_dir / f"{name}_{split}_{len(new):06d}.bin", part,
                               wide=dtype.itemsize == 4)
            new.append({"file": path.name, "split": split, "tokens": len(part),
                        "sha256": _file_sha256(path), "next_doc": cursor[0],
                        "next_offset": cursor[1], "last": pos == total})
        return new
    finally:
        for shard in old:
            shard.close()


def _count_splits(records) -> dict[str, int]:
    tokens: dict[str, int] = {}
    for r in records:
        tokens[r["split"]] = tokens.get(r["split"], 0) + r["tokens"]
    return tokens


def _completed_shards(progress_path: Path, settings: dict,
                      out_dir: Path) -> tuple[list[dict], int | None]:
    """The records of an earlier run's shards that are complete and intact, in order, up to
    the first that is not, and the validation size their layout has; none when that run had
    other inputs or settings."""
    try:
        saved = json.loads(progress_path.read_text())
    except (OSError, ValueError):
        return [], None
    layout = saved.get("val_tokens")
    if saved.get("settings") != settings and _upgraded(saved.get("settings")) != settings:
        return [], None
    if settings["val_tokens"] is None and not isinstance(layout, int):
        return [], None
    good = []
    for record in saved.get("shards", []):
        path = out_dir / record["file"]
        try:
            if read_header(path) != record["tokens"] or _file_sha256(path) != record["sha256"]:
                break
        except ShardError:
            break
        good.append(record)
    return good, layout


def _upgraded(settings) -> dict | None:
    """A record's settings from before tokenizers were named by fingerprint: GPT-2's encoding
    by name (so that shards made then are kept)."""
    if not isinstance(settings, dict) or settings.get("encoding") != GPT2:
        return None
    return {**{k: v for k, v in settings.items() if k != "encoding"},
            "tokenizer": GPT2_FINGERPRINT}


def _check_folder(out_dir: Path, name: str, tokenizer: Tokenizer):
    """One folder, one tokenizer: shards of other names in out_dir that another tokenizer
    made (by its sidecar, or llm.c's uint16 GPT-2 shards) raise a DataError. Those of this
    name are this run's to rewrite; unknown ones (llm.c's uint32 shards) are taken to be of
    this tokenizer, as the sidecar will say."""
    others = [p for p in sorted(out_dir.glob("*.bin"))
              if not ((m := _SHARD_NAME.match(p.name)) and m["name"] == name)]
    recorded = provenance.read_sidecar(out_dir)
    if others and recorded is None:
        try:
            recorded = provenance.recorded_tokenizer(others)
        except ShardError:
            return  # not shards after all: not ours to judge
    if others and recorded is not None and recorded["fingerprint"] != tokenizer.fingerprint:
        raise DataError(f"{out_dir}: holds token shards made by {describe(recorded)} "
                        f"({others[0].name} ...), and one folder holds one tokenizer's "
                        f"shards: write those of {describe(tokenizer.identity())} to another "
                        f"folder (--out)")


def _save_progress(path: Path, settings: dict, val_tokens: int, records: list):
    # val_tokens: the layout of the shards, which the settings leave open by default.
    _write_json(path, {"settings": settings, "val_tokens": val_tokens, "shards": records})


def _remove_shards(out_dir: Path, name: str, keep):
    """Deletes the shards `{name}_{split}_{index}.bin` in out_dir but those of the records."""
    keep = {r["file"] for r in keep}
    for path in out_dir.glob(f"{glob.escape(name)}_*.bin"):
        m = _SHARD_NAME.match(path.name)
        if m and m["name"] == name and path.name not in keep:
            path.unlink()


def _write_json(path: Path, obj):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)
