"""The token shards a run trains and validates on, from what --data names.

--data is a text file (tokenized once into a cache of shards and reused), a directory or glob
of llm.c shards, one shard file, or nothing: the default corpus, tinyshakespeare, found in the
user cache, else where BLUJAX_CORPUS says, else downloaded.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import re
import sys
import tempfile
import urllib.error
from pathlib import Path

import jax

from blujax import data
from blujax.fetch import download, user_cache_dir
from blujax.cli.settings import UsageError

# The default corpus: the file nanoGPT and llm.c train their first models on.
CORPUS_NAME = "tinyshakespeare.txt"
CORPUS_URL = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
              "tinyshakespeare/input.txt")
CORPUS_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
# llm.c's split of it: the first 32768 tokens are the validation set.
CORPUS_VAL_TOKENS = 32768


@dataclasses.dataclass
class DataSource:
    description: str        # what --data named, in words
    train: list[Path]
    val: list[Path]         # may be empty: no validation loss then


def resolve_data(spec: str | None, *, progress: bool) -> DataSource:
    """The token shards `--data` names: a text file (tokenized once into a cache), a directory
    or glob of llm.c shards (split into train and val by name), one shard file, or, with no
    --data, the default corpus."""
    if spec is None:
        # Its tokens go to the user cache even when BLUJAX_CORPUS names a file elsewhere:
        # that may be a shared, read-only data folder.
        return tokenize_text(default_corpus(progress=progress), paragraph_docs=True,
                             val_tokens=CORPUS_VAL_TOKENS, progress=progress,
                             description=f"the default corpus ({CORPUS_NAME})",
                             cache=user_cache_dir() / f"{CORPUS_NAME}.tokens")
    if any(c in spec for c in "*?[") and not os.path.exists(spec):
        paths = sorted(Path(p) for p in glob.glob(spec))
        if not paths:
            raise UsageError(f"--data {spec}: the pattern matches no files")
        not_shards = [p for p in paths if p.suffix != ".bin"]
        if not_shards:
            raise UsageError(f"--data {spec}: a pattern must name llm.c .bin token shards, but "
                             f"it matches {not_shards[0]}; pass one text file instead")
        return _split_shards(paths, spec)
    path = Path(spec)
    if path.is_dir():
        paths = sorted(path.glob("*.bin"))
        if not paths:
            raise UsageError(f"--data {spec}: the directory holds no .bin token shards")
        _check_prepared(path, paths, spec)
        return _split_shards(paths, spec)
    if not path.exists():
        raise UsageError(f"--data {spec}: no such file or directory")
    if path.suffix == ".bin":
        twin = path.with_name(path.name.replace("train", "val"))
        val = [twin] if "train" in path.name and twin.is_file() else []
        return _checked(DataSource(f"token shard {path}", [path], val))
    return tokenize_text(path, paragraph_docs=False, val_tokens=None, progress=progress,
                         description=f"text file {path}")


def _split_shards(paths: list[Path], spec: str) -> DataSource:
    """llm.c names its shards `{name}_train_*.bin` and `{name}_val_*.bin`; shards named
    neither way all train, and there is no validation split."""
    train = [p for p in paths if _has_word(p, "train")]
    val = [p for p in paths if _has_word(p, "val")]
    if not train:
        if val:
            raise UsageError(f"--data {spec}: only validation shards ({val[0].name} ...), no "
                             f"shard has 'train' in its name")
        train = paths
    return _checked(DataSource(f"token shards {spec}", train, val))


def _check_prepared(folder: Path, paths: list[Path], spec: str):
    """`python -m blujax.data prepare` records its progress in NAME.prepare.json beside the
    shards: one that stopped before the end (interrupted; it resumes when run again) left
    shards that look like a whole data set but are not."""
    for record in folder.glob("*.prepare.json"):
        name = record.name[:-len(".prepare.json")]
        shard_name = re.compile(rf"{re.escape(name)}_(train|val)_\d{{6}}\.bin")
        if not any(shard_name.fullmatch(p.name) for p in paths):
            continue
        try:
            shards = json.loads(record.read_text()).get("shards") or [{}]
            finished = bool(shards[-1].get("last"))
        except (OSError, ValueError, AttributeError):
            continue  # not ours to judge
        if not finished:
            raise UsageError(f"--data {spec}: the shards of {name} are incomplete: python -m "
                             f"blujax.data prepare stopped before the end ({record.name}); "
                             f"run it again to finish them")


def _has_word(path: Path, word: str) -> bool:
    return re.search(rf"(^|[_.\-]){word}([_.\-]|$)", path.stem) is not None


def _checked(source: DataSource) -> DataSource:
    """Reads every shard's header now, so a bad file is reported before anything compiles."""
    for p in source.train + source.val:
        data.read_header(p)  # ShardError names the file and the problem
    return source


# --------------------------------------------------------------------------------------------
# Text files, tokenized into shards once


def tokenize_text(path: Path, *, paragraph_docs: bool, val_tokens: int | None, progress: bool,
                  description: str, cache: Path | None = None) -> DataSource:
    """Tokenizes a text file with GPT-2's encoding into shards in `cache`, by default a folder
    next to it (or in the user cache, where that is not writable); a later run finds them
    there and reuses them.

    Without val_tokens the first tenth or so of the tokens (estimated from the file size, at
    most 32768 as llm.c keeps of tinyshakespeare) is the validation split. Text that is not
    UTF-8 raises data.TextError naming the file and the first bad byte's offset; no shards
    are left behind then."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--data {path}: not a file")
    if _is_blank(path):
        raise UsageError(f"--data {path}: the file is empty: there is no text to train on")
    if val_tokens is None:
        val_tokens = max(1, min(CORPUS_VAL_TOKENS, path.stat().st_size // 32))
    cache = _token_cache(path) if cache is None else cache
    small = path.stat().st_size < (64 << 20)  # worker processes only pay off on big files
    try:
        result = data.prepare([path], cache, name=path.name.split(".")[0] or "text",
                              val_tokens=val_tokens, workers=1 if small else None,
                              doc_separator="\n\n" if paragraph_docs else None,
                              progress=progress)
    except RuntimeError as e:  # the tokenizer could not load; the message says what to do
        raise UsageError(str(e)) from None
    except data.DataError:
        _remove_if_empty(cache)  # prepare removed its shards: leave no empty folder either
        raise
    train = [f for f in result.files if _has_word(f, "train")]
    val = [f for f in result.files if _has_word(f, "val")]
    if not train:
        raise UsageError(f"--data {path}: only {result.tokens.get('val', 0)} tokens, all of "
                         f"them needed for the validation split; give more text")
    return DataSource(description, train, val)


def _remove_if_empty(folder: Path):
    try:
        folder.rmdir()
    except OSError:
        pass


def _is_blank(path: Path) -> bool:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            if chunk.strip():
                return False
    return True


def _token_cache(path: Path) -> Path:
    beside = path.parent / f"{path.name}.tokens"
    if _writable(beside):
        return beside
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    fallback = user_cache_dir() / "tokens" / f"{path.name}-{digest}"
    if not _writable(fallback):
        raise UsageError(f"cannot write the tokenized copy of {path} beside it ({beside}) or "
                         f"in the user cache ({fallback}); set XDG_CACHE_HOME to a writable "
                         f"folder")
    return fallback


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
        return True
    except OSError:
        return False


# --------------------------------------------------------------------------------------------
# The default corpus


def default_corpus(*, progress: bool) -> Path:
    """tinyshakespeare: from the user cache, else the file BLUJAX_CORPUS names, else downloaded
    into the user cache (checked against its known sha256)."""
    cached = user_cache_dir() / CORPUS_NAME
    if cached.is_file():
        return cached
    named = os.environ.get("BLUJAX_CORPUS")
    if named:
        if not Path(named).is_file():
            raise UsageError(f"BLUJAX_CORPUS={named}: no such file (it should name a copy of "
                             f"{CORPUS_NAME})")
        return Path(named)
    try:
        download(CORPUS_URL, cached, sha256=CORPUS_SHA256, progress=progress)
    except (OSError, urllib.error.URLError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise UsageError(
            f"could not download the default corpus from {CORPUS_URL} ({reason}). Offline, "
            f"set BLUJAX_CORPUS to a copy of {CORPUS_NAME} (or pass --data FILE), and "
            f"TIKTOKEN_CACHE_DIR to a folder holding tiktoken's gpt2 files") from None
    return cached


# --------------------------------------------------------------------------------------------
# The validation batches


def val_batches(source: DataSource, batch: int, seq: int, max_batches: int | None,
                rows_multiple: int = 1, vocab_size: int = data.GPT2_VOCAB_SIZE) -> list:
    """The first max_batches (all if None) batches of the validation split, in order, on the
    device; fewer rows when the split is too small for a full batch (a multiple of
    rows_multiple, the data-parallel size, so that they split over it); none without a split.
    Whole batches, with several processes too (each process reads all of them)."""
    if not source.val:
        return []
    counts = [data.read_header(p) for p in source.val]
    rows = min(batch, (max(counts) - 1) // seq)
    rows -= rows % rows_multiple
    if rows < 1:
        print(f"warning: the validation split ({max(counts)} tokens) is shorter than "
              f"{max(rows_multiple, 1)} sequence(s) of --seq {seq}: no validation loss",
              file=sys.stderr)
        return []
    batches = []
    with data.DataLoader(source.val, None, batch_size=rows, seq_len=seq, shuffle=False,
                         process_index=0, process_count=1, vocab_size=vocab_size) as loader:
        n = loader.batches_per_epoch
        for _ in range(n if max_batches is None else min(n, max_batches)):
            b = next(loader)  # safe to keep on the device (see DataLoader)
            batches.append((jax.device_put(b.inputs), jax.device_put(b.targets)))
    return batches
