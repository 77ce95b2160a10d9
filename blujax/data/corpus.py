"""Text tokenized once into shards and reused, and the default corpus.

A text file a run trains on is tokenized with the model's tokenizer into shards in a folder
beside it (`FILE.tokens/` for GPT-2's, `FILE.<fingerprint[:8]>.tokens/` for another's, so that
two models' caches of one text never clobber each other), or in the user cache where that
folder is not writable; a later run finds them there. The default corpus is tinyshakespeare,
from the user cache, else the file BLUJAX_CORPUS names, else downloaded, cut into shards
exactly as llm.c cuts it.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.error
from pathlib import Path

from blujax.data.errors import DataError, TextError
from blujax.data.shards import in_split
from blujax.data.tokenizer import GPT2, Tokenizer
from blujax.data.tokenizing import prepare
from blujax.fetch import download, user_cache_dir

# The file nanoGPT and llm.c train their first models on.
CORPUS_NAME = "tinyshakespeare.txt"
CORPUS_URL = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
              "tinyshakespeare/input.txt")
CORPUS_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
CORPUS_ENV = "BLUJAX_CORPUS"
# llm.c's split of it: the first 32768 tokens are the validation set.
CORPUS_VAL_TOKENS = 32768


def default_corpus(*, progress: bool) -> Path:
    """tinyshakespeare: from the user cache, else the file BLUJAX_CORPUS names, else downloaded
    into the user cache (checked against its known sha256)."""
    cached = user_cache_dir() / CORPUS_NAME
    if cached.is_file():
        return cached
    named = os.environ.get(CORPUS_ENV)
    if named:
        if not Path(named).is_file():
            raise DataError(f"{CORPUS_ENV}={named}: no such file (it should name a copy of "
                            f"{CORPUS_NAME})")
        return Path(named)
    try:
        download(CORPUS_URL, cached, sha256=CORPUS_SHA256, progress=progress)
    except (OSError, urllib.error.URLError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise DataError(
            f"could not download the default corpus from {CORPUS_URL} ({reason}). Offline, "
            f"set {CORPUS_ENV} to a copy of {CORPUS_NAME} (or name other data: --data FILE "
            f"on the command line), and TIKTOKEN_CACHE_DIR to a folder holding tiktoken's "
            f"gpt2 files") from None
    return cached


def default_corpus_shards(*, progress: bool,
                          tokenizer: Tokenizer | None = None) -> tuple[list[Path], list[Path]]:
    """The default corpus's (train, val) shards of `tokenizer` (None: GPT-2's), its paragraphs
    the documents as llm.c's are. They go to the user cache even when BLUJAX_CORPUS names a
    file elsewhere: that may be a shared, read-only data folder."""
    cache = user_cache_dir() / f"{CORPUS_NAME}{_suffix(tokenizer)}.tokens"
    return tokenize_text(default_corpus(progress=progress), paragraph_docs=True,
                         val_tokens=CORPUS_VAL_TOKENS, progress=progress, cache=cache,
                         tokenizer=tokenizer)


def tokenize_text(path: Path, *, paragraph_docs: bool = False, val_tokens: int | None = None,
                  progress: bool = False, cache: Path | None = None,
                  tokenizer: Tokenizer | None = None) -> tuple[list[Path], list[Path]]:
    """A text file's (train, val) shards in `cache` (by default token_cache(path,
    tokenizer)): made with `tokenizer` (None: GPT-2's encoding) the first time, reused after.

    Without val_tokens the first tenth or so of the tokens (estimated from the file size, at
    most 32768 as llm.c keeps of tinyshakespeare) is the validation split. Text that is not
    UTF-8 raises TextError naming the file and the first bad byte's offset; no shards are left
    behind then."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: not a file")
    if _is_blank(path):
        raise TextError(f"{path}: the file is empty: there is no text in it")
    if val_tokens is None:
        val_tokens = max(1, min(CORPUS_VAL_TOKENS, path.stat().st_size // 32))
    cache = token_cache(path, tokenizer) if cache is None else cache
    small = path.stat().st_size < (64 << 20)  # worker processes only pay off on big files
    try:
        result = prepare([path], cache, name=path.name.split(".")[0] or "text",
                         val_tokens=val_tokens, workers=1 if small else None,
                         doc_separator="\n\n" if paragraph_docs else None,
                         tokenizer=GPT2 if tokenizer is None else tokenizer,
                         progress=progress)
    except DataError:
        _remove_if_empty(cache)  # prepare removed its shards: leave no empty folder either
        raise
    train = [f for f in result.files if in_split(f, "train")]
    val = [f for f in result.files if in_split(f, "val")]
    if not train:
        n = result.tokens.get("val", 0)
        raise TextError(f"{path}: only {n} token{'s' * (n != 1)}, all of them "
                        f"needed for the validation split; give more text")
    return train, val


def token_cache(path: Path, tokenizer: Tokenizer | None = None) -> Path:
    """Where a text file's shards of `tokenizer` (None: GPT-2's) go: beside it, else (not
    writable) in the user cache."""
    suffix = _suffix(tokenizer)
    beside = path.parent / f"{path.name}{suffix}.tokens"
    if _writable(beside):
        return beside
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    fallback = user_cache_dir() / "tokens" / f"{path.name}-{digest}{suffix}"
    if not _writable(fallback):
        raise DataError(f"cannot write the tokenized copy of {path} beside it ({beside}) or "
                        f"in the user cache ({fallback}); set XDG_CACHE_HOME to a writable "
                        f"folder")
    return fallback


def _suffix(tokenizer: Tokenizer | None) -> str:
    """A cache folder's mark of its tokenizer: none for GPT-2's (the caches made before
    tokenizers were chosen stay valid), else its fingerprint's start."""
    return "" if tokenizer is None or tokenizer.is_gpt2 else f".{tokenizer.fingerprint[:8]}"


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


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
        return True
    except OSError:
        return False
