"""llm.c's token shard formats: the header constants, writing a shard, checking its header,
reading it (memory-mapped, tokens checked against the vocabulary), and finding shards by
file, pattern or directory and split.

Both formats are a header of 256 little-endian int32 (magic, version, token count, zeros) and
then the tokens: magic 20240520, version 1, uint16 tokens (llm.c's GPT-2 shards), or magic
20240801, version 7, uint32 tokens (llm.c's Llama 3 shards; "wide" here), for vocabularies
beyond 65,536 tokens."""

from __future__ import annotations

import concurrent.futures
import glob
import mmap
import os
import re
import threading
from pathlib import Path

import numpy as np

from blujax.data.errors import ShardError
from blujax.vocab import GPT2_VOCAB_SIZE  # re-exported: blujax.data.GPT2_VOCAB_SIZE

MAGIC = 20240520
VERSION = 1
TOKEN_DTYPE = np.dtype("<u2")
WIDE_MAGIC = 20240801
WIDE_VERSION = 7
WIDE_TOKEN_DTYPE = np.dtype("<u4")
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
# magic -> (version, token dtype, the format in words)
_FORMATS = {MAGIC: (VERSION, TOKEN_DTYPE, "uint16 tokens, llm.c's GPT-2 format"),
            WIDE_MAGIC: (WIDE_VERSION, WIDE_TOKEN_DTYPE, "uint32 tokens, llm.c's Llama 3 "
                                                         "format")}


def token_dtype(vocab_size: int) -> np.dtype:
    """The shard dtype that holds a vocabulary's ids: uint16 up to 65,536 tokens, else uint32."""
    return TOKEN_DTYPE if vocab_size <= 1 << 16 else WIDE_TOKEN_DTYPE


def write_shard(path, tokens, wide: bool = False) -> Path:
    """Writes tokens (any integer array) as an llm.c shard, atomically: uint16 tokens (each in
    [0, 65535]), or with wide uint32 ones (magic 20240801)."""
    path = Path(path)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{path}: tokens must be a 1-D integer array, got {tokens.dtype}"
                         f"{list(tokens.shape)}")
    magic = WIDE_MAGIC if wide else MAGIC
    version, dtype, _ = _FORMATS[magic]
    top = np.iinfo(dtype).max
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > top):
        raise ValueError(f"{path}: tokens must lie in [0, {top}] to be stored as {dtype.name}")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (magic, version, tokens.size)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(dtype, copy=False).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_header(path) -> int:
    """Checks a shard's header against its file size; returns its token count."""
    return read_format(path)[0]


def read_format(path) -> tuple[int, np.dtype]:
    """Checks a shard's header against its file size; returns its token count and its tokens'
    dtype (TOKEN_DTYPE or WIDE_TOKEN_DTYPE)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError as e:
        raise ShardError(f"{path}: cannot read shard: {e.strerror or e}") from e
    if size < HEADER_BYTES:
        raise ShardError(f"{path}: {size} bytes, shorter than the {HEADER_BYTES}-byte llm.c "
                         f"header: truncated, or not a token shard")
    magic, version, count = (int(v) for v in np.frombuffer(raw, dtype="<i4", count=3))
    if magic not in _FORMATS:
        raise ShardError(f"{path}: bad magic number {magic} (expected {MAGIC} for uint16 "
                         f"tokens or {WIDE_MAGIC} for uint32 tokens): not an llm.c token "
                         f"shard, or its header is corrupt")
    expected_version, dtype, words = _FORMATS[magic]
    if version != expected_version:
        raise ShardError(f"{path}: unsupported shard version {version} (magic {magic} is "
                         f"version {expected_version}: {words})")
    if count < 0:
        raise ShardError(f"{path}: corrupt header: negative token count {count}")
    expected = HEADER_BYTES + count * dtype.itemsize
    if size < expected:
        raise ShardError(f"{path}: truncated: the header says {count} tokens ({expected} "
                         f"bytes) but the file has {size} bytes")
    if size > expected:
        raise ShardError(f"{path}: {size - expected} bytes after the {count} tokens the "
                         f"header announces: corrupt header or trailing data")
    return count, dtype


def format_name(dtype) -> str:
    """A shard format in words, by its tokens' dtype."""
    return next(words for _, d, words in _FORMATS.values() if d == np.dtype(dtype))


class Shard:
    """A validated, memory-mapped shard: `tokens` is a read-only view of the file's tokens, of
    `dtype` (uint16 or, in a wide shard, uint32).

    Pages of the mapping count in the process's resident memory once touched (large page-cache
    folios map 2 MiB at a time), so readers call drop_pages() after using a region: the data
    stays in the page cache, only this process's mapping of it goes.
    """

    def __init__(self, path, vocab_size: int = GPT2_VOCAB_SIZE, check_tokens: bool = True):
        self.path = Path(path)
        self.num_tokens, self.dtype = read_format(self.path)
        try:
            self._file = open(self.path, "rb")
        except OSError as e:  # gone or unreadable since its header was read
            raise ShardError(f"{self.path}: cannot read shard: {e.strerror or e}") from e
        if self.num_tokens:
            try:
                self._mmap = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError) as e:
                self._file.close()
                raise ShardError(f"{self.path}: cannot map shard: {e}") from e
            self.tokens = np.frombuffer(self._mmap, dtype=self.dtype, count=self.num_tokens,
                                        offset=HEADER_BYTES)
        else:
            self._mmap = None
            self.tokens = np.zeros(0, self.dtype)
        if check_tokens:
            try:
                self.check_tokens(vocab_size)
            except ShardError:
                self.close()
                raise

    def check_tokens(self, vocab_size: int, block: int = 2 << 20,
                     stop: threading.Event | None = None):
        """Raises ShardError naming the first token id >= vocab_size: its position in the
        shard and its value. A set `stop` ends the check early with CancelledError."""
        bad = None
        for start in range(0, self.num_tokens, block):
            if stop is not None and stop.is_set():
                raise concurrent.futures.CancelledError(f"{self.path}: check stopped")
            part = self.tokens[start:start + block]
            if int(part.max()) >= vocab_size:
                bad = start + int(np.argmax(part >= vocab_size))
            del part  # a view held by a traceback would keep the mapping from closing
            self.drop_pages()
            if bad is not None:
                raise ShardError(f"{self.path}: token {bad} is {int(self.tokens[bad])}, not "
                                 f"below the vocabulary size {vocab_size}: corrupt shard, or "
                                 f"one made for another tokenizer")

    def drop_pages(self):
        if self._mmap is not None and hasattr(mmap, "MADV_DONTNEED"):
            self._mmap.madvise(mmap.MADV_DONTNEED)

    def close(self):
        self.tokens = None  # the view must go before the mapping can close
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # a caller still holds a view of the tokens: it closes when that goes
            self._mmap = None
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def in_split(path, split: str) -> bool:
    """Whether a shard's name has `split` as a word, as llm.c names its splits:
    `fineweb_train_000001.bin`, `tiny_shakespeare_val.bin`."""
    return re.search(rf"(^|[_.\-]){re.escape(split)}([_.\-]|$)", Path(path).stem) is not None


def find_shards(source, split: str | None = None) -> list[Path]:
    """Shard paths, sorted: a file, a list of files, a glob pattern, or a directory.

    In a directory (or with a pattern) split picks the files in it (in_split).
    """
    if isinstance(source, (list, tuple)):
        paths = [Path(p) for p in source]
    else:
        source = str(source)
        if os.path.isdir(source):
            if split is None:
                raise ValueError(f"{source} is a directory: name the split to read from it "
                                 f"(for example 'train' or 'val')")
            paths = sorted(Path(source).glob("*.bin"))
        elif any(c in source for c in "*?["):
            paths = sorted(Path(p) for p in glob.glob(source))
        else:
            paths = [Path(source)]
        if split is not None and (os.path.isdir(source) or len(paths) != 1):
            paths = [p for p in paths if in_split(p, split)]
    if not paths:
        raise FileNotFoundError(f"no token shards found at {source!r}"
                                + (f" for split {split!r}" if split else ""))
    return paths
