"""The training loader: batches of (inputs, targets) from shards, in a seeded order, filled by
a prefetch thread into pooled buffers, every shard's tokens checked by a few threads first."""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import math
import os
import queue
import sys
import threading
import time
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from blujax.data.errors import ShardError
from blujax.data.shards import GPT2_VOCAB_SIZE, Shard, find_shards, read_header

# Threads that check shards' tokens; more than a few only queue on the disk.
_CHECK_THREADS = 4


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
                touched += 2 * shard.dtype.itemsize * count + (2 << 20)
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


def content_fingerprint(paths, counts, samples: int = 16, size: int = 1 << 16) -> str:
    """16 hex digits that name shards by their tokens, not their file names: each shard's token
    count and `samples` evenly spaced stretches of `size` bytes of it (the first and the last
    among them), so that reading it costs a few megabytes however large the data."""
    h = hashlib.sha256()
    for path, count in zip(paths, counts):
        h.update(str(count).encode())
        try:
            with open(path, "rb") as f:
                length = os.fstat(f.fileno()).st_size
                starts = {(length - size) * i // (samples - 1)
                          for i in range(samples)} if length > size else {0}
                for start in sorted(starts):
                    f.seek(start)
                    h.update(f.read(size))
        except OSError as e:
            raise ShardError(f"{path}: cannot read shard: {e.strerror or e}") from None
    return h.hexdigest()[:16]


class DataLoader:
    """Batches of (inputs, targets) from llm.c token shards (uint16 or uint32, mixed as they
    come), prefetched by a background thread.

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
        self._fingerprint = content_fingerprint(self.paths, self.counts)
        # What loaders before content fingerprints recorded: names and counts.
        self._name_fingerprint = hashlib.sha256(json.dumps(
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

    def same_shards(self, fingerprint) -> bool:
        """Whether a state()'s "shards" names these shards: the same tokens in the same order
        (under any file names), or, as loaders recorded before, the same names and counts."""
        return fingerprint in (self._fingerprint, self._name_fingerprint)

    def load_state(self, state: dict):
        """Continues from a state() of a loader over the same shards, seed and batch shape
        (with any number of processes)."""
        for key in ("seed", "shuffle", "batch_size", "seq_len", "shards"):
            if key == "shards" and self.same_shards(state.get(key)):
                continue
            if state.get(key) != self.state()[key]:
                what = "the shards' tokens differ" if key == "shards" else f"{key} differs"
                raise ValueError(f"loader state does not match this loader: {what} "
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
