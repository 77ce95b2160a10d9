"""Token data: llm.c-format shards, the GPT-2 tokenizer that fills them, and the training loader.

A shard is a header of 256 little-endian int32 (magic 20240520, version 1, token count, zeros)
followed by that many uint16 GPT-2 tokens, so FineWeb/FineWeb-Edu shards published for llm.c
load unchanged.

    python -m blujax.data prepare corpus.jsonl more.txt --out data/ [--shard-tokens 100M]
    python -m blujax.data check data/*.bin

    loader = DataLoader("data/", "train", batch_size=64, seq_len=1024, seed=0)
    loader.check_all()                    # every shard's tokens, before the first step
    inputs, targets = next(loader)        # int32 [64 // process_count, 1024]
    state = loader.state()                # JSON-able; loader.load_state(state) resumes after it

Offline, tiktoken reads its GPT-2 files from the folder named by TIKTOKEN_CACHE_DIR. Data a
user can fix (a bad shard, text that is not UTF-8) raises a DataError with a one-line message.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import glob
import hashlib
import json
import math
import mmap
import multiprocessing
import os
import queue
import re
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import numpy as np

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")
GPT2_VOCAB_SIZE = 50257
GPT2_EOT = 50256
DEFAULT_SHARD_TOKENS = 100_000_000
# Without --val-tokens the validation split is one shard, but at most this share of the corpus.
DEFAULT_VAL_FRACTION = 0.1
# Threads that check shards' tokens; more than a few only queue on the disk.
_CHECK_THREADS = 4

_SHARD_NAME = re.compile(r"^(?P<name>.+)_(?P<split>train|val)_(?P<index>\d{6})\.bin$")


class DataError(ValueError):
    """A problem with data the user gave, which they can fix: the message (one line) names
    the file and what is wrong with it. The command line prints it and exits with status 2."""


class ShardError(DataError):
    """A token shard that is not a valid llm.c shard; the message names the file."""


class TextError(DataError):
    """A text or JSON-lines input that cannot be read as documents (not UTF-8, not JSON, no
    text field); the message names the file and the place in it."""


# --------------------------------------------------------------------------------------------
# Shard files


def write_shard(path, tokens) -> Path:
    """Writes tokens (any integer array, each in [0, 65535]) as an llm.c shard, atomically."""
    path = Path(path)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"{path}: tokens must be a 1-D integer array, got {tokens.dtype}"
                         f"{list(tokens.shape)}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > 0xFFFF):
        raise ValueError(f"{path}: tokens must lie in [0, 65535] to be stored as uint16")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (MAGIC, VERSION, tokens.size)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(TOKEN_DTYPE, copy=False).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read_header(path) -> int:
    """Checks a shard's header against its file size; returns its token count."""
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
    if magic != MAGIC:
        raise ShardError(f"{path}: bad magic number {magic} (expected {MAGIC}): not an llm.c "
                         f"GPT-2 token shard, or its header is corrupt")
    if version != VERSION:
        raise ShardError(f"{path}: unsupported shard version {version} (expected {VERSION}: "
                         f"uint16 GPT-2 tokens)")
    if count < 0:
        raise ShardError(f"{path}: corrupt header: negative token count {count}")
    expected = HEADER_BYTES + count * TOKEN_DTYPE.itemsize
    if size < expected:
        raise ShardError(f"{path}: truncated: the header says {count} tokens ({expected} "
                         f"bytes) but the file has {size} bytes")
    if size > expected:
        raise ShardError(f"{path}: {size - expected} bytes after the {count} tokens the "
                         f"header announces: corrupt header or trailing data")
    return count


class Shard:
    """A validated, memory-mapped shard: `tokens` is a read-only uint16 view of the file.

    Pages of the mapping count in the process's resident memory once touched (large page-cache
    folios map 2 MiB at a time), so readers call drop_pages() after using a region: the data
    stays in the page cache, only this process's mapping of it goes.
    """

    def __init__(self, path, vocab_size: int = GPT2_VOCAB_SIZE, check_tokens: bool = True):
        self.path = Path(path)
        self.num_tokens = read_header(self.path)
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
            self.tokens = np.frombuffer(self._mmap, dtype=TOKEN_DTYPE, count=self.num_tokens,
                                        offset=HEADER_BYTES)
        else:
            self._mmap = None
            self.tokens = np.zeros(0, TOKEN_DTYPE)
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


def find_shards(source, split: str | None = None) -> list[Path]:
    """Shard paths, sorted: a file, a list of files, a glob pattern, or a directory.

    In a directory (or with a pattern) split picks the files whose name has `_{split}` as a
    word, as in llm.c's `fineweb_train_000001.bin` and `tiny_shakespeare_val.bin`.
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
            word = re.compile(rf"(^|[_.\-]){re.escape(split)}([_.\-]|$)")
            paths = [p for p in paths if word.search(p.stem)]
    if not paths:
        raise FileNotFoundError(f"no token shards found at {source!r}"
                                + (f" for split {split!r}" if split else ""))
    return paths


# --------------------------------------------------------------------------------------------
# Loader


class Batch(NamedTuple):
    """int32 [rows, T] arrays; targets[r, t] is the token after inputs[r, t]."""

    inputs: np.ndarray
    targets: np.ndarray


def rank_slice(batch: Batch, rank: int, num_ranks: int) -> Batch:
    """The rows of a batch that data-parallel rank `rank` of `num_ranks` trains on (views)."""
    rows = batch.inputs.shape[0]
    if not 0 <= rank < num_ranks or rows % num_ranks:
        raise ValueError(f"cannot give rank {rank} of {num_ranks} an equal slice of {rows} rows")
    per = rows // num_ranks
    return Batch(batch.inputs[rank * per:(rank + 1) * per],
                 batch.targets[rank * per:(rank + 1) * per])


def _aligned_int32(shape, alignment: int = 64) -> np.ndarray:
    count = math.prod(shape)
    raw = np.empty(count + alignment // 4, dtype=np.int32)
    skip = (-raw.__array_interface__["data"][0] % alignment) // 4
    return raw[skip:skip + count].reshape(shape)


class _BufferPool:
    """int32 buffers for batches, filled again once nothing outside the pool refers to them.

    A batch handed out is a view of a pool buffer, and every numpy view of it, and every jax
    array that aliases it or is still copying from it, holds a reference to that buffer. So a
    buffer whose only references are the pool's own is free: keeping a batch is always safe,
    and a loop that drops its batches gets the same few buffers back (no allocation and no
    page faults per batch, which cost a third of the loader's time). The pool forgets its
    oldest buffer beyond `limit` (a consumer that keeps every batch then owns them outright).
    """

    def __init__(self, shape: tuple[int, int], limit: int):
        self.shape, self.limit = shape, limit
        self.buffers: list[np.ndarray] = []   # the memory owners, whose references count
        self.arrays: list[np.ndarray] = []    # an aligned array of `shape` in each (a view)
        self.idle_refs: list[int] = []

    def _refs(self, i: int) -> int:
        # The same expression measures a buffer when new (held by the pool alone) and later,
        # so interpreter details of reference counting cancel out.
        return sys.getrefcount(self.buffers[i])

    def take(self) -> np.ndarray:
        """An aligned int32 array of `shape` that nothing outside the pool refers to. Views of
        it count as references to its buffer (numpy views keep the owner as their base)."""
        for i in range(len(self.buffers)):
            if self._refs(i) == self.idle_refs[i]:
                # Last in line, so the next search finds the buffers free longest first.
                for column in (self.buffers, self.arrays, self.idle_refs):
                    column.append(column.pop(i))
                return self.arrays[-1]
        if len(self.buffers) >= self.limit:
            del self.buffers[0], self.arrays[0], self.idle_refs[0]
        array = _aligned_int32(self.shape)
        self.buffers.append(array.base)
        self.arrays.append(array)
        self.idle_refs.append(self._refs(len(self.buffers) - 1))
        return array


class _Order:
    """Which chunk of which shard is batch k of an epoch: shards in a seeded random order, and
    each shard's chunks in a seeded random order of their own (as llm.c's loader shuffles)."""

    def __init__(self, chunks_per_shard: Sequence[int], seed: int, shuffle: bool):
        self.chunks = np.asarray(chunks_per_shard, dtype=np.int64)
        self.seed, self.shuffle = seed, shuffle
        self.per_epoch = int(self.chunks.sum())
        self._epoch = None
        self._perm_key = None

    def shard_order(self, epoch: int) -> np.ndarray:
        """The shards in the order an epoch reads them (without changing this object, so
        any thread may ask)."""
        n = len(self.chunks)
        return (np.random.default_rng([self.seed, epoch, 0]).permutation(n) if self.shuffle
                else np.arange(n))

    def _set_epoch(self, epoch: int):
        if self._epoch != epoch:
            self.shards = self.shard_order(epoch)
            self.ends = np.cumsum(self.chunks[self.shards])
            self._epoch = epoch

    def shard_after(self, epoch: int, k: int) -> int:
        """The next shard with batches after the one batch k of an epoch comes from."""
        self._set_epoch(epoch)
        pos = int(np.searchsorted(self.ends, k, side="right")) + 1
        while True:
            if pos == len(self.shards):
                epoch, pos = epoch + 1, 0
                self._set_epoch(epoch)
            if self.chunks[self.shards[pos]]:
                return int(self.shards[pos])
            pos += 1

    def locate(self, epoch: int, k: int) -> tuple[int, int]:
        self._set_epoch(epoch)
        pos = int(np.searchsorted(self.ends, k, side="right"))
        shard = int(self.shards[pos])
        within = k - (int(self.ends[pos - 1]) if pos else 0)
        if not self.shuffle:
            return shard, within
        if self._perm_key != (epoch, shard):
            rng = np.random.default_rng([self.seed, epoch, 1, shard])
            self._perm = rng.permutation(int(self.chunks[shard]))
            self._perm_key = (epoch, shard)
        return shard, int(self._perm[within])


@dataclasses.dataclass
class _Slot:
    inputs: np.ndarray
    targets: np.ndarray
    batch: Batch

    @classmethod
    def new(cls, rows: int, seq_len: int, pool: _BufferPool | None = None) -> _Slot:
        def array():
            # A view of the pool's array, so that the pool's own never reaches the caller.
            return pool.take()[...] if pool else _aligned_int32((rows, seq_len))

        inputs, targets = array(), array()
        return cls(inputs, targets, Batch(inputs, targets))


class _Checks:
    """The token check of every shard (all its tokens below the vocabulary size), each run
    once, by a few daemon threads; futures by shard index. Shards the prefetch thread is about
    to read go ahead of the rest, which are checked in the order asked for. Reading is most
    of the cost and numpy lets go of the GIL while it scans, so threads overlap the reads
    (a FineWeb shard is 200 MB). Holds no reference to the DataLoader."""

    def __init__(self, paths, vocab_size: int, max_threads: int):
        self.paths, self.vocab_size, self.max_threads = paths, vocab_size, max_threads
        self.futures: dict[int, concurrent.futures.Future] = {}
        self.urgent: collections.deque = collections.deque()
        self.later: collections.deque = collections.deque()
        self.lock = threading.Condition()
        self.closed = threading.Event()
        self.threads: list[threading.Thread] = []

    def request(self, shards, urgent: bool = False) -> list[concurrent.futures.Future]:
        """The futures of these shards' checks: result None for a good shard, its
        ShardError for a bad one. A shard asked for again keeps its first future."""
        with self.lock:
            futures = []
            for s in map(int, shards):
                future = self.futures.get(s)
                if future is None:
                    future = self.futures[s] = concurrent.futures.Future()
                    if self.closed.is_set():  # nothing runs any more
                        future.cancel()
                    else:
                        (self.urgent if urgent else self.later).append(s)
                elif urgent and s in self.later:  # asked for before, not begun: now first
                    self.later.remove(s)
                    self.urgent.append(s)
                futures.append(future)
            waiting = len(self.urgent) + len(self.later)
            while waiting and len(self.threads) < self.max_threads:
                thread = threading.Thread(target=self._work, daemon=True,
                                          name="blujax-data-check")
                thread.start()
                self.threads.append(thread)
                waiting -= 1
            self.lock.notify_all()
            return futures

    def _work(self):
        while True:
            with self.lock:
                while not (self.urgent or self.later or self.closed.is_set()):
                    self.lock.wait()
                if self.closed.is_set():
                    return
                s = (self.urgent or self.later).popleft()
                future = self.futures[s]
            if not future.set_running_or_notify_cancel():
                continue
            try:
                with Shard(self.paths[s], self.vocab_size, check_tokens=False) as shard:
                    shard.check_tokens(self.vocab_size, stop=self.closed)
            except BaseException as e:  # kept for whoever waits on the shard
                future.set_exception(e)
            else:
                future.set_result(None)

    def close(self):
        """Cancels the checks not begun; those under way stop within a block of tokens."""
        with self.lock:
            self.closed.set()
            for s in (*self.urgent, *self.later):
                self.futures[s].cancel()
            self.urgent.clear()
            self.later.clear()
            self.lock.notify_all()


class _Producer:
    """The prefetch thread's side. Holds no reference to the DataLoader, so that dropping the
    loader stops the thread.

    A shard's token ids are all checked before its first batch is handed out. Checking reads
    the whole shard, so while one shard is read the check threads (_Checks) check the next one.

    Used buffers come back through a deque, which the thread polls (backing off to 1 ms) when
    all are full: handing one back then costs the consumer no wake-up of another thread, which
    on a virtual machine can take longer than the rest of next() together."""

    _POLL_MIN_S, _POLL_MAX_S = 20e-6, 1e-3

    def __init__(self, paths, counts, vocab_size, order, tokens_per_batch, lo, hi, seq_len,
                 slots, drop_bytes, reuse_buffers, checks: _Checks):
        self.paths, self.counts, self.vocab_size = paths, counts, vocab_size
        self.order, self.tokens_per_batch = order, tokens_per_batch
        self.lo, self.hi, self.seq_len = lo, hi, seq_len
        self.slots, self.drop_bytes = slots, drop_bytes
        self.reuse_buffers = reuse_buffers
        # Room for every slot's two arrays twice over before a kept batch is forgotten.
        self.pool = _BufferPool((hi - lo, seq_len), limit=4 * len(slots))
        self.checks = checks
        self.thread = None

    def _check(self, s: int) -> concurrent.futures.Future:
        return self.checks.request([s], urgent=True)[0]

    def start(self, epoch: int, k: int):
        self.free: collections.deque = collections.deque(range(len(self.slots)))
        self.ready: queue.SimpleQueue = queue.SimpleQueue()
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(epoch, k), daemon=True,
                                       name="blujax-data-prefetch")
        self.thread.start()

    def stop(self):
        if self.thread is not None:
            self.stopping.set()
            self.thread.join()
            self.thread = None

    def close(self):
        self.checks.close()  # first: the thread may be waiting for a check
        self.stop()

    def _free_slot(self) -> int | None:
        wait = self._POLL_MIN_S
        while not self.stopping.is_set():
            try:
                return self.free.popleft()
            except IndexError:
                time.sleep(wait)
                wait = min(2 * wait, self._POLL_MAX_S)
        return None

    def _run(self, epoch, k):
        shard_index, shard, touched = None, None, 0
        first = self.lo * self.seq_len  # this process's rows start here within a chunk
        count = (self.hi - self.lo) * self.seq_len
        try:
            while True:
                slot_index = self._free_slot()
                if slot_index is None:
                    break
                s, chunk = self.order.locate(epoch, k)
                if s != shard_index:
                    if shard is not None:
                        shard.close()
                    check = self._check(s)
                    while not check.done():
                        if self.stopping.is_set():
                            return
                        concurrent.futures.wait([check], timeout=0.05)
                    check.result()  # raises the shard's ShardError
                    shard = Shard(self.paths[s], self.vocab_size, check_tokens=False)
                    shard_index, touched = s, 0
                    self._check(self.order.shard_after(epoch, k))
                if not self.reuse_buffers:  # what was handed out is the caller's now
                    self.slots[slot_index] = None  # drop the loader's own references first
                    self.slots[slot_index] = _Slot.new(self.hi - self.lo, self.seq_len,
                                                       self.pool)
                slot = self.slots[slot_index]
                start = chunk * self.tokens_per_batch + first
                np.copyto(slot.inputs.reshape(-1), shard.tokens[start:start + count])
                np.copyto(slot.targets.reshape(-1), shard.tokens[start + 1:start + 1 + count])
                # Large page-cache folios map up to 2 MiB around what was read.
                touched += 4 * count + (2 << 20)
                if touched >= self.drop_bytes:
                    shard.drop_pages()
                    touched = 0
                self.ready.put((slot_index, epoch, k))
                k += 1
                if k == self.order.per_epoch:
                    epoch, k = epoch + 1, 0
        except BaseException as e:  # handed to the consumer, raised by next()
            self.ready.put(e)
        finally:
            if shard is not None:
                shard.drop_pages()
                shard.close()


class DataLoader:
    """Batches of (inputs, targets) from llm.c token shards, prefetched by a background thread.

    Each batch is one contiguous chunk of batch_size * seq_len + 1 tokens of a shard; chunks
    are visited in an order fixed by the seed (shards shuffled, then each shard's chunks), each
    once per epoch, epochs without end. With several processes, process i of n reads only rows
    [i * B/n, (i+1) * B/n) of every batch (B = batch_size, the global batch); rank_slice()
    splits those rows further between a process's data-parallel ranks.

    Every batch is new arrays that the loader never writes again: the caller may keep them,
    and jax arrays made from them, as long as it likes. (jax.device_put does not make keeping
    a buffer that is written again safe: it is asynchronous, so on a GPU the transfer may still
    be reading the numpy array after it returns, and on the CPU it shares the memory of an
    aligned array instead of copying it, even with may_alias=False.) The arrays come from a
    pool of buffers that are filled again only once nothing else refers to them (numpy views
    and jax arrays made from a batch keep its buffer referenced), so a loop that lets its
    batches go reuses a few buffers without allocating.

    reuse_buffers=True fills prefetch+1 buffers allocated once instead (a little faster in a
    loop that does nothing else): a batch is then valid only until the next call to next(),
    and the caller must copy it first, or wait for its transfer to the device to finish
    (block_until_ready), to keep it or anything made from it.

    Every token of a shard is checked (below vocab_size) before a batch of it is handed out;
    next() raises ShardError, naming the file, for a shard that fails. With check_ahead (the
    default) background threads start checking all shards at once, in the order the first
    epoch reads them, so that check_all(), which a run calls before its first step, mostly
    waits for work already done, and a bad token in a shard that training would reach hours
    later stops the run before it starts. Reading all of FineWeb-10B's 20 GB takes seconds to
    a minute, while the step compiles.
    """

    def __init__(self, shards, split: str | None = None, *, batch_size: int, seq_len: int,
                 seed: int = 0, shuffle: bool = True, process_index: int | None = None,
                 process_count: int | None = None, prefetch: int = 4,
                 vocab_size: int = GPT2_VOCAB_SIZE, drop_bytes: int = 8 << 20,
                 reuse_buffers: bool = False, check_ahead: bool = True):
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, "
                             f"{seq_len}")
        if process_index is None or process_count is None:
            import jax  # the default slices by JAX's processes (one in a single-host run)
            process_index = jax.process_index() if process_index is None else process_index
            process_count = jax.process_count() if process_count is None else process_count
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} is not in [0, {process_count})")
        if batch_size % process_count:
            raise ValueError(f"batch_size {batch_size} does not split evenly between "
                             f"{process_count} processes")
        if prefetch < 1:
            raise ValueError(f"prefetch must be at least 1, got {prefetch}")
        self.paths = find_shards(shards, split)
        self.counts = [read_header(p) for p in self.paths]
        self.batch_size, self.seq_len = batch_size, seq_len
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.process_index, self.process_count = process_index, process_count
        tokens_per_batch = batch_size * seq_len
        # A chunk needs one token more than it trains on: the last target.
        chunks = [max(0, (c - 1) // tokens_per_batch) for c in self.counts]
        if not any(chunks):
            raise ValueError(f"no shard holds the {tokens_per_batch + 1} tokens one batch of "
                             f"{batch_size} x {seq_len} needs (largest: {max(self.counts)}, "
                             f"in {len(self.paths)} shard(s) from {shards!r})")
        self.batches_per_epoch = sum(chunks)
        rows = batch_size // process_count
        self.rows = rows
        self.reuse_buffers = bool(reuse_buffers)
        # The consumer holds one slot while `prefetch` wait ready. Without reuse_buffers the
        # prefetch thread puts new arrays into a slot each time it fills it.
        slots = [_Slot.new(rows, seq_len) if self.reuse_buffers else None
                 for _ in range(prefetch + 1)]
        self._slots = slots
        self._closed = False
        order = _Order(chunks, self.seed, self.shuffle)
        checks = _Checks(self.paths, vocab_size, min(_CHECK_THREADS, os.cpu_count() or 1))
        if check_ahead:
            checks.request(order.shard_order(0))
        self._producer = _Producer(self.paths, self.counts, vocab_size, order,
                                   tokens_per_batch, process_index * rows,
                                   (process_index + 1) * rows, seq_len, slots, drop_bytes,
                                   self.reuse_buffers, checks)
        self._fingerprint = hashlib.sha256(json.dumps(
            [[p.name, c] for p, c in zip(self.paths, self.counts)]).encode()).hexdigest()[:16]
        self._held = None
        self._error = None
        self._epoch, self._batch = 0, 0
        self._producer.start(0, 0)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self._closed:
            raise ValueError("the data loader is closed")
        if self._error is not None:
            raise self._error
        producer = self._producer
        if self._held is not None:
            producer.free.append(self._held)
            self._held = None
        item = producer.ready.get()
        if isinstance(item, BaseException):
            self._error = item
            raise item
        slot_index, epoch, k = item
        self._held = slot_index
        self._epoch, self._batch = (epoch, k + 1) if k + 1 < self.batches_per_epoch else (
            epoch + 1, 0)
        return self._slots[slot_index].batch

    def check_all(self, progress=None) -> None:
        """Checks the tokens of every shard of the loader (reading each whole, in a few
        threads; shards checked already are not read again) and waits for it. Raises the
        ShardError of the first bad shard in the order of self.paths (file, position and value
        of its first bad token, vocabulary size) as soon as the shards before it have passed.
        progress(done, total), if given, is called from this thread, once at the start and
        as shards finish."""
        if self._closed:
            raise ValueError("the data loader is closed")
        futures = self._producer.checks.request(range(len(self.paths)))
        waiting = {f for f in futures if not f.done()}
        while True:
            if progress is not None:
                progress(len(futures) - len(waiting), len(futures))
            for future in futures:
                if not future.done():
                    break
                if future.exception() is not None:
                    raise future.exception()
            else:
                return
            _, waiting = concurrent.futures.wait(
                waiting, return_when=concurrent.futures.FIRST_COMPLETED)

    def state(self) -> dict:
        """Where the loader stands: load_state() of it continues with the next batch."""
        return {"epoch": self._epoch, "batch": self._batch, "seed": self.seed,
                "shuffle": self.shuffle, "batch_size": self.batch_size,
                "seq_len": self.seq_len, "shards": self._fingerprint,
                "batches_per_epoch": self.batches_per_epoch}

    def load_state(self, state: dict):
        """Continues from a state() of a loader over the same shards, seed and batch shape
        (with any number of processes)."""
        for key in ("seed", "shuffle", "batch_size", "seq_len", "shards"):
            if state.get(key) != self.state()[key]:
                what = "the shard files (names or token counts)" if key == "shards" else key
                raise ValueError(f"loader state does not match this loader: {what} differs "
                                 f"({state.get(key)!r} saved, {self.state()[key]!r} here), so "
                                 f"it would not continue the same order of batches")
        epoch, k = int(state["epoch"]), int(state["batch"])
        if epoch < 0 or not 0 <= k < self.batches_per_epoch:
            raise ValueError(f"loader state position epoch {epoch}, batch {k} is out of range "
                             f"({self.batches_per_epoch} batches per epoch)")
        self._producer.stop()
        self._held, self._error = None, None
        self._epoch, self._batch = epoch, k
        self._producer.start(epoch, k)

    def close(self):
        self._closed = True
        self._producer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        producer = getattr(self, "_producer", None)
        if producer is not None:
            producer.close()


# --------------------------------------------------------------------------------------------
# Tokenizing text into shards


def get_encoding(name: str = "gpt2"):
    """tiktoken's encoding, with an error that says what to do on an offline machine."""
    try:
        import tiktoken
    except ImportError as e:
        raise RuntimeError("tokenizing needs tiktoken (pip install tiktoken)") from e
    try:
        return tiktoken.get_encoding(name)
    except Exception as e:
        raise RuntimeError(
            f"tiktoken could not load the {name!r} encoding ({type(e).__name__}: {e}). "
            f"Without network access, set TIKTOKEN_CACHE_DIR to a folder holding its cached "
            f"files (see the README)") from e


_WORKER_ENCODING = None


def _init_worker(name):
    global _WORKER_ENCODING
    _WORKER_ENCODING = get_encoding(name)


def _encode_document(item):
    """[end-of-text] + the document's tokens, as llm.c's fineweb.py writes them. Special-token
    text inside a document is encoded as plain text, never as a control token."""
    text, nbytes = item
    enc = _WORKER_ENCODING
    ids = enc.encode_ordinary(text)
    tokens = np.empty(len(ids) + 1, np.uint16)
    tokens[0] = enc.eot_token
    tokens[1:] = ids
    return tokens, nbytes


def _decode(raw: bytes, path: Path, offset: int = 0, line: int = 1) -> str:
    """raw (which starts at byte `offset`, on line `line` of path) as UTF-8 text, or a
    TextError naming the file and the first byte that is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line += raw.count(b"\n", 0, e.start)
        raise TextError(f"{path} is not UTF-8 text: byte 0x{raw[e.start]:02x} at offset "
                        f"{offset + e.start} (line {line}) cannot be decoded (convert it, e.g. "
                        f"iconv -f latin1 -t utf-8)") from None


def _documents(inputs: Sequence[Path], separator: str | None, text_field: str):
    """(text, bytes) of every document, in order: a text file is one document, or one per
    piece between separators (which stay with the piece before them); a JSON-lines file
    (.jsonl, .ndjson) has one per non-blank line, its `text_field` string. Input that is not
    UTF-8, or not JSON lines with that field, raises TextError naming the file and place.
    (With worker processes this runs in the pool's feeder thread, and its exception reaches
    the caller through a worker: a DataError pickles with its message.)"""
    for path in inputs:
        if path.suffix.lower() in (".jsonl", ".ndjson"):
            with open(path, "rb") as f:
                offset = 0
                for lineno, line in enumerate(f, 1):
                    start, offset = offset, offset + len(line)
                    if not line.strip():
                        continue
                    decoded = _decode(line, path, start, lineno)
                    decoded = decoded.removeprefix("\ufeff")  # a byte-order mark
                    try:
                        record = json.loads(decoded)
                    except ValueError as e:
                        raise TextError(f"{path}:{lineno}: not valid JSON ({e})") from None
                    text = record.get(text_field) if isinstance(record, dict) else None
                    if not isinstance(text, str):
                        raise TextError(f"{path}:{lineno}: no string field {text_field!r}")
                    yield text, len(line)
        else:
            raw = path.read_bytes()
            text, size = _decode(raw, path), len(raw)
            del raw
            if separator:
                pieces = text.split(separator)
                for i, piece in enumerate(pieces):
                    doc = piece + separator if i < len(pieces) - 1 else piece
                    yield doc, len(doc.encode("utf-8"))
            else:
                yield text, size


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
            text_field: str = "text", encoding: str = "gpt2",
            progress: bool = True) -> PrepareResult:
    """Tokenizes documents into llm.c shards `{name}_{val|train}_{index:06d}.bin` in out_dir.

    Every document is written as [end-of-text] + its tokens. The first val_tokens tokens form
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
    enc = get_encoding(encoding)  # fails early, here, when the tokenizer cannot load
    if enc.n_vocab > 1 << 16:
        raise ValueError(f"encoding {encoding!r} has {enc.n_vocab} tokens, more than uint16 "
                         f"shards hold")
    workers = (os.cpu_count() or 1) if workers is None else max(1, int(workers))

    settings = {"inputs": [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns]
                           for p in inputs],
                "shard_tokens": shard_tokens, "val_tokens": val_tokens,
                "doc_separator": doc_separator, "text_field": text_field,
                "encoding": encoding}
    progress_path = out_dir / f"{name}.prepare.json"
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
                      workers, doc_separator, text_field, encoding, progress)
        except DataError:
            _remove_shards(out_dir, name, keep=[])
            progress_path.unlink(missing_ok=True)
            raise
    if val_tokens is None:
        final = default_val_tokens(sum(r["tokens"] for r in records), shard_tokens)
        if final != layout:
            records = _recut(out_dir, name, records, shard_tokens, final, enc.eot_token)
            written = [out_dir / r["file"] for r in records]
            _save_progress(progress_path, settings, final, records)

    files = [out_dir / r["file"] for r in records]
    _remove_shards(out_dir, name, keep=records)  # beyond the last: an earlier, longer run's
    tokens = _count_splits(records)
    if val_tokens and not tokens.get("train"):
        print(f"warning: all {tokens.get('val', 0)} tokens went to the validation split; "
              f"lower val_tokens to leave some for training", file=sys.stderr)
    return PrepareResult(files, written, [f for f in files if f not in written], tokens)


def _tokenize(inputs, out_dir: Path, name: str, records: list, written: list,
              shard_tokens: int, val_tokens: int, save_progress, workers: int,
              doc_separator, text_field: str, encoding: str, progress: bool):
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
    buf = np.empty(capacity if capacity else 1, np.uint16)
    fill = 0

    def flush(cursor, last):
        nonlocal split, capacity, buf, fill
        index = len(records)
        path = out_dir / f"{name}_{split}_{index:06d}.bin"
        write_shard(path, buf[:fill])
        records.append({"file": path.name, "split": split, "tokens": int(fill),
                        "sha256": _file_sha256(path), "next_doc": cursor[0],
                        "next_offset": cursor[1], "last": last})
        save_progress()
        written.append(path)
        bar.set_postfix_str(f"{path.name} written")
        split, capacity = next(sizes)
        if buf.size < capacity:
            buf = np.empty(capacity, np.uint16)
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
            pool = context.Pool(workers, initializer=_init_worker, initargs=(encoding,))
            encoded = pool.imap(_encode_document, pending(), chunksize=8)
        else:
            _init_worker(encoding)
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
           eot: int) -> list[dict]:
    """The complete data set of `records` written again as shards of the layout of
    val_tokens; returns their records. The old files are read through mappings, which keep
    them readable while new ones of the same names replace them. Every document begins with
    end-of-text (which encode_ordinary never makes), so where each shard ends in the
    documents, for a re-run to resume from, is found by counting those tokens."""
    old = [Shard(out_dir / r["file"], check_tokens=False) for r in records]
    try:
        bounds = np.cumsum([0] + [s.num_tokens for s in old]).tolist()
        total = bounds[-1]

        def tokens(a: int, b: int) -> np.ndarray:  # [a, b) of the whole data set
            out = np.empty(b - a, TOKEN_DTYPE)
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
            starts = np.flatnonzero(part == eot)
            docs += len(starts)
            if len(starts):
                doc_start = pos + int(starts[-1])
            pos += len(part)
            if pos == total or tokens(pos, pos + 1)[0] == eot:
                cursor = (docs, 0)
            else:
                cursor = (docs - 1, pos - doc_start)
            path = write_shard(out_dir / f"{name}_{split}_{len(new):06d}.bin", part)
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
    if saved.get("settings") != settings or (settings["val_tokens"] is None
                                             and not isinstance(layout, int)):
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


# --------------------------------------------------------------------------------------------
# Command line


def _count(text: str) -> int:
    """100M, 1.5G, 32768, 1e6 -> an int."""
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}.get(text[-1:].lower())
    try:
        value = float(text[:-1]) * scale if scale else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count: {text!r}") from None
    if value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole count: {text!r}")
    return int(value)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m blujax.data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser(
        "prepare", help="tokenize text / JSON-lines files into shards",
        description="Tokenizes text files (UTF-8; each one document) and JSON-lines files (one "
                    "document per line) with GPT-2's tokenizer into llm.c shards "
                    "NAME_val_000000.bin, NAME_train_000001.bin, ... The validation split is "
                    "the first tokens: --val-tokens of them, by default one shard's worth but "
                    "at most a tenth of the corpus (a small corpus keeps nine tenths for "
                    "training). A re-run keeps the complete shards and goes on after them.")
    p.add_argument("inputs", nargs="+", type=Path,
                   help="text files (one document each) and .jsonl files (one per line)")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--name", help="shard name prefix (default: the first input's name)")
    p.add_argument("--shard-tokens", type=_count, default=DEFAULT_SHARD_TOKENS,
                   help="tokens per shard (default 100M)")
    p.add_argument("--val-tokens", type=_count, default=None,
                   help="tokens of the validation split, taken first (default: one shard, "
                        "but at most a tenth of the corpus)")
    p.add_argument("--workers", type=int, default=None,
                   help="tokenizing processes (default: all CPUs)")
    p.add_argument("--paragraph-docs", action="store_true",
                   help="each blank-line-separated paragraph of a text file is a document "
                        "(llm.c's tinyshakespeare convention)")
    p.add_argument("--text-field", default="text", help="JSON field with the text")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    c = commands.add_parser("check", help="validate shards: header, size, token range")
    c.add_argument("shards", nargs="+", type=Path)
    c.add_argument("--vocab-size", type=int, default=GPT2_VOCAB_SIZE)
    args = parser.parse_args(argv)
    try:
        return _run_command(args)
    except (DataError, ValueError, OSError, RuntimeError) as e:  # bad input, said plainly
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run_command(args) -> int:
    if args.command == "prepare":
        result = prepare(args.inputs, args.out, name=args.name, shard_tokens=args.shard_tokens,
                         val_tokens=args.val_tokens, workers=args.workers,
                         doc_separator="\n\n" if args.paragraph_docs else None,
                         text_field=args.text_field, progress=not args.no_progress)
        print(f"{len(result.files)} shards in {args.out} ({len(result.written)} written, "
              f"{len(result.skipped)} already complete); tokens: "
              + ", ".join(f"{k} {v:,}" for k, v in sorted(result.tokens.items())))
        return 0
    failed = 0
    for path in args.shards:
        try:
            with Shard(path, args.vocab_size) as shard:
                print(f"{path}: ok, {shard.num_tokens:,} tokens")
        except ShardError as e:
            print(f"error: {e}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    from blujax.data import main as _main  # the package's copy, so workers can unpickle
    sys.exit(_main())
