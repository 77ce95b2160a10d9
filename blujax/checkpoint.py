"""Checkpoints: save and restore a training state, asynchronously, atomically, verified.

    ckpt = Checkpointer("runs/gpt2/ckpt", keep=3)
    info = ckpt.save(step, {"params": params, "opt_state": opt_state, "rng": key},
                     loader=loader.state(), config=config)   # info.stall_s: what training waited
    ...
    r = ckpt.restore(like={"params": params, "opt_state": opt_state, "rng": key})
    params, opt_state, key = r.tree["params"], r.tree["opt_state"], r.tree["rng"]
    loader.load_state(r.loader); step = r.step

The saved tree is any pytree of arrays (jax arrays of any sharding, numpy arrays, scalars,
typed PRNG keys; optax states included). `like` gives the structure, shapes, dtypes and
placement to restore into: its leaves may be arrays or jax.ShapeDtypeStruct, and their
shardings may be on another mesh or another number of devices than the saved ones.

On disk, one directory per step, `step_00000100/`:
  manifest.json   step, loader state, config, and per array: its key path, dtype, shape, and
                  its chunks (one per distinct shard) with their index ranges and sha256;
                  the manifest carries a sha256 of itself
  arrays/*.bin    the chunks, raw C-order bytes (bfloat16 and other ml_dtypes included)

Why not orbax-checkpoint: it brings in about 15 more packages (tensorstore, protobuf, uvloop,
...), and in its default configuration a flipped byte in a stored array restores silently as
wrong weights; here every chunk is checked on load.

A save first copies the arrays to host memory (the stall the caller sees, reported), then a
background thread writes them into a temporary directory, fsyncs, and renames it into place:
a crash at any point leaves the previous checkpoints as they were. Only the last `keep` are
kept. One process writes a checkpoint directory at a time; opening one for writing tidies what
an interrupted save left there. To read checkpoints while another process may be writing
them (to evaluate or sample from a run in progress), open the directory read-only:

    latest = Checkpointer("runs/gpt2/ckpt", read_only=True).restore(like=...)

A save that cannot be made (the folder unwritable, the disk full) raises CheckpointError naming
the checkpoint and the OS's reason: from save() in synchronous mode, else from the next save(),
wait(), close() or raise_if_failed() (which a training loop calls each step, so that it stops
at once rather than at the next save). check_writable() proves before training that a
checkpoint can be written at all.

A checkpoint that fails verification raises CorruptCheckpointError. restore(...,
fallback=True) falls back past those to the newest that verifies, telling the caller of each
one skipped (and of each step directory whose manifest is gone); restore(..., partial=True)
restores a subtree (the parameters, say) reading and verifying only its arrays:

    r = ckpt.restore(like={"params": params}, partial=True, fallback=True,
                     on_skip=lambda path, reason: print(f"skipped {path}: {reason}"))

A tree whose layout has changed since a checkpoint was saved (an array reshaped, say) is still
restored: `earlier` names the layouts it once had (EarlierLayout: `like` in that layout, and
the function that upgrades such a tree), and the checkpoint's stored shapes pick the one it
is in.

In a run of several JAX processes, process 0 saves (the others open the directory read-only,
or not at all), and every array must be whole on it: its shards there cover the array, as
they do for one replicated over the mesh (blujax.train.gather makes them so). Every
process may restore, each into its own `like`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

FORMAT = "blujax-checkpoint"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TIDY = (".tmp-step_", ".old-step_", ".trash-step_", ".probe-")  # left by an interrupted save
NO_MANIFEST = "no manifest.json (deleted or never finished)"  # a fallback's skip reason


class CheckpointError(Exception):
    """A checkpoint that cannot be restored as asked (corrupt, truncated, or not matching), or
    a save that cannot be made."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint that fails verification or cannot be read: a file of it damaged, truncated,
    missing or unreadable. (A tree that does not match it is a plain CheckpointError.)
    `reason` is the message without its leading "checkpoint <path>: "."""

    def __init__(self, path, reason: str):
        super().__init__(f"checkpoint {path}: {reason}")
        self.path, self.reason = Path(path), reason


def _os_reason(e: OSError) -> str:
    """An OSError in one line, without the file name (the messages name the checkpoint)."""
    if e.strerror:
        return f"[Errno {e.errno}] {e.strerror}" if e.errno is not None else e.strerror
    return str(e) or type(e).__name__


def _remove(path: Path):
    """Deletes a file or a directory tree, whichever it is, if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except OSError:
            pass


@dataclasses.dataclass
class SaveInfo:
    step: int
    path: Path
    stall_s: float                 # seconds save() kept the caller (host copy + any wait)
    write_s: float | None = None   # seconds the write took, once it is done


@dataclasses.dataclass
class Restored:
    step: int
    tree: Any                      # the pytree, in the structure and placement of `like`
    loader: dict | None            # the loader state saved with it
    config: dict | None            # the config saved with it (a dataclass comes back a dict)
    path: Path
    upgraded: bool = False         # saved in an EarlierLayout, and upgraded as it was read


@dataclasses.dataclass(frozen=True)
class EarlierLayout:
    """A layout a tree was saved in once: `like` in that layout (the key paths and shapes a
    checkpoint of then has), and upgrade(tree), which turns a tree restored into it into
    today's."""

    like: Any
    upgrade: Callable[[Any], Any]


def _is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _host_copy(x) -> np.ndarray:
    """A host array the caller cannot change afterwards. On the CPU, np.asarray of a jax array
    may share its buffer, which a donating train step reuses, so it is copied there."""
    if isinstance(x, jax.Array):
        if all(d.platform == "cpu" for d in x.devices()):
            return np.array(x, copy=True)
        return np.asarray(x)
    return np.array(x, copy=True)


def _own_shards(x: jax.Array, name: str) -> list:
    """The shards of x that a save writes, one per distinct index: the replica-0 ones of an
    array this process holds entirely; of one spanning several processes, the first local
    copy of each piece, which must cover the array (replica 0 may be on another process)."""
    if x.is_fully_addressable:
        return [s for s in x.addressable_shards if s.replica_id == 0]
    pieces = {}
    for s in x.addressable_shards:
        pieces.setdefault(tuple(map(tuple, _index_ranges(s.index, x.shape))), s)
    held = sum(int(np.prod([b - a for a, b in ranges])) for ranges in pieces)
    if held != x.size:
        raise CheckpointError(
            f"cannot save {name}: it spans several processes and this one (process "
            f"{jax.process_index()}) holds {held} of its {x.size} elements; save arrays "
            f"replicated over the mesh (blujax.train.gather gives them)")
    return list(pieces.values())


def _index_ranges(index, shape) -> list[list[int]]:
    ranges = []
    for s, n in zip(index, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise CheckpointError(f"strided shard index {index} is not supported")
        ranges.append([start, stop])
    return ranges


def _config_dict(config):
    if config is None:
        return None
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    try:
        json.dumps(config, allow_nan=True)
    except TypeError as e:
        raise TypeError(f"the config must be a JSON-serializable dict or dataclass: {e}") from e
    return config


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def fsync_dir(path: Path):
    """Makes a folder's entries (a rename into it) durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # directories cannot be opened on some platforms; nothing to sync there
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointer:
    """Saves and restores the checkpoints in one directory; see the module docstring.

    read_only=True opens the directory for listing and restoring only: it is neither created
    nor tidied (so a save under way in another process is left alone), and save() raises.
    """

    def __init__(self, directory, keep: int | None = 3, async_save: bool = True, *,
                 read_only: bool = False):
        if keep is not None and keep < 1:
            raise ValueError(f"keep must be at least 1 (or None for all), got {keep}")
        self.directory = Path(directory)
        self.read_only = read_only
        self.keep = keep
        self.async_save = async_save and not read_only
        self._pending: tuple[concurrent.futures.Future, SaveInfo] | None = None
        self.last_save: SaveInfo | None = None
        if not read_only:
            try:
                self._make_directory()
                self._recover()
            except OSError as e:
                raise CheckpointError(f"cannot open checkpoint folder {self.directory} for "
                                      f"writing: {self._dir_reason(e)}") from e
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="blujax-checkpoint") if self.async_save else None

    def _make_directory(self):
        self.directory.mkdir(parents=True, exist_ok=True)

    def _dir_reason(self, e: OSError) -> str:
        if self.directory.exists() and not self.directory.is_dir():
            return "it is a file, not a folder"
        return _os_reason(e)

    # ---- listing

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints here, ascending (none if the directory does not
        exist, which only a read-only Checkpointer allows). Not verified: see restore's
        fallback."""
        return sorted(s for s, p in self._step_dirs().items() if _has_manifest(p))

    def incomplete_steps(self) -> list[int]:
        """Steps of the step directories here without a manifest.json, ascending: damage (a
        manifest deleted), not a save in flight, which writes under another name."""
        return sorted(s for s, p in self._step_dirs().items() if not _has_manifest(p))

    def _step_dirs(self) -> dict[int, Path]:
        try:
            names = os.listdir(self.directory)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except OSError as e:
            raise CheckpointError(f"cannot list the checkpoints in {self.directory}: "
                                  f"{_os_reason(e)}") from e
        return {int(m.group(1)): self.directory / name for name in names
                if (m := _STEP_DIR.match(name))}

    def latest_step(self) -> int | None:
        self.wait()
        steps = self.steps()
        return steps[-1] if steps else None

    def step_path(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}"

    # ---- saving

    def save(self, step: int, tree, *, loader: dict | None = None, config=None) -> SaveInfo:
        """Saves tree (and the loader state and config) as checkpoint `step`.

        Returns once the arrays are copied to host memory (asynchronous mode) or written
        (synchronous mode); SaveInfo.stall_s says how long that was. An error of a background
        write is raised by the next save(), wait(), close() or raise_if_failed(); one the
        file system gives is a CheckpointError naming the checkpoint. With several JAX
        processes, process 0 alone saves, and only arrays whose shards on it cover them
        (replicated over the mesh, say); anything else raises CheckpointError.
        """
        start = time.perf_counter()
        if self.read_only:
            raise CheckpointError(f"cannot save step {step} into {self.directory}: this "
                                  f"Checkpointer was opened with read_only=True")
        if jax.process_index() != 0:
            raise CheckpointError(
                f"cannot save step {step} from JAX process {jax.process_index()}: in a run of "
                f"several processes, process 0 alone saves (each array whole on it), else "
                f"each would write its own copy of {self.directory}")
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self.wait()
        meta = {"step": step, "loader": loader, "config": _config_dict(config),
                "time": time.time()}
        json.dumps(loader)  # fails here, in the caller, if the loader state is not JSON
        arrays = self._to_host(tree)
        info = SaveInfo(step, self.step_path(step), 0.0)
        if self._executor is None:
            self._write(arrays, meta, info)
            info.stall_s = time.perf_counter() - start
        else:
            info.stall_s = time.perf_counter() - start
            self._pending = (self._executor.submit(self._write, arrays, meta, info), info)
        self.last_save = info
        return info

    def in_flight(self) -> bool:
        """Whether a background write is still running."""
        return self._pending is not None and not self._pending[0].done()

    def raise_if_failed(self):
        """Raises the error of the background write if it has ended with one (a
        CheckpointError for anything the file system refused); returns at once otherwise,
        the write still running or done. A training loop calls it each step, so that a save
        that failed stops the run then, not at the next save."""
        if self._pending is None:
            return
        future, _ = self._pending
        if future.done() and future.exception() is not None:
            self._pending = None
            future.result()

    def check_writable(self, nbytes: int | None = None):
        """Proves that a checkpoint can be written into the directory now, as a save writes
        one (a folder made, a file written and fsynced, the folder renamed, all removed
        again), and, given nbytes (the size of one), that the disk has that much free.
        Raises CheckpointError naming the directory and the reason. A training loop calls it
        before its first step, so that an unwritable folder does not cost the steps up to
        the first save."""
        if self.read_only:
            raise CheckpointError(f"cannot write checkpoints to {self.directory}: this "
                                  f"Checkpointer was opened with read_only=True")
        probe = self.directory / f".probe-{uuid.uuid4().hex[:8]}"
        renamed = probe.with_name(probe.name + "-renamed")
        try:
            self._make_directory()
            probe.mkdir()
            with open(probe / "probe.bin", "wb") as f:
                f.write(bytes(4096))
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(probe)
            os.rename(probe, renamed)
            fsync_dir(self.directory)
            free = shutil.disk_usage(self.directory).free
        except OSError as e:
            raise CheckpointError(f"cannot write checkpoints to {self.directory}: "
                                  f"{self._dir_reason(e)}") from e
        finally:
            _remove(probe)
            _remove(renamed)
        if nbytes is not None and free < nbytes:
            raise CheckpointError(f"cannot write checkpoints to {self.directory}: one takes "
                                  f"{nbytes / 2**20:,.1f} MiB and the disk has "
                                  f"{free / 2**20:,.1f} MiB free")

    def wait(self) -> SaveInfo | None:
        """Waits for the save in flight, if any; raises its error; returns its SaveInfo."""
        if self._pending is None:
            return None
        future, info = self._pending
        self._pending = None
        future.result()
        return info

    def close(self):
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @staticmethod
    def _to_host(tree) -> list[tuple[dict, list[tuple[list, np.ndarray]]]]:
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        if not leaves:
            raise ValueError("nothing to save: the tree has no leaves")
        # Every device-to-host copy is started before the first is waited for.
        shards = []
        for path, leaf in leaves:
            if _is_key(leaf):
                leaf = jax.random.key_data(leaf)
            if isinstance(leaf, jax.Array):
                own = _own_shards(leaf, jax.tree_util.keystr(path))
                for s in own:
                    if s.device.platform != "cpu":  # on the CPU it would be one more copy
                        s.data.copy_to_host_async()
                shards.append(own)
            else:
                shards.append(None)
        arrays = []
        for (path, leaf), own in zip(leaves, shards):
            record = {"path": jax.tree_util.keystr(path)}
            if _is_key(leaf):
                record["key_impl"] = str(jax.random.key_impl(leaf))
                leaf = jax.random.key_data(leaf)
            if own is None:
                if not isinstance(leaf, (np.ndarray, np.generic, int, float, bool, complex)):
                    raise TypeError(f"cannot save leaf {record['path']} of type "
                                    f"{type(leaf).__name__}: leaves must be arrays or scalars")
                record["kind"] = "python" if isinstance(leaf, (int, float, bool, complex)) \
                    else "numpy"
                host = _host_copy(leaf)
                chunks = [([[0, n] for n in host.shape], host)]
            else:
                record["kind"] = "jax"
                chunks = [(_index_ranges(s.index, leaf.shape), _host_copy(s.data)) for s in own]
                host = chunks[0][1]
            record["dtype"] = str(host.dtype)
            record["shape"] = list(np.shape(leaf))
            arrays.append((record, chunks))
        names = [r["path"] for r, _ in arrays]
        if len(set(names)) != len(names):
            raise ValueError("two leaves of the tree have the same key path")
        return arrays

    def _write(self, arrays, meta, info: SaveInfo):
        start = time.perf_counter()
        tmp = self.directory / f".tmp-step_{info.step:08d}-{uuid.uuid4().hex[:8]}"
        try:
            (tmp / "arrays").mkdir(parents=True)
            jobs = [(f"arrays/{i:06d}.{j}.bin", index, data)
                    for i, (_, chunks) in enumerate(arrays)
                    for j, (index, data) in enumerate(chunks)]
            # Hashing and writing release the GIL: a few threads overlap them and the disk.
            with concurrent.futures.ThreadPoolExecutor(
                    max_workers=min(self._WRITERS, len(jobs))) as pool:
                written = list(pool.map(lambda job: _write_chunk(tmp, *job), jobs))
            records, done = [], iter(written)
            for record, chunks in arrays:
                records.append(dict(record, chunks=[next(done) for _ in chunks]))
            body = {"format": FORMAT, "version": FORMAT_VERSION, **meta, "arrays": records}
            manifest = dict(body, sha256=hashlib.sha256(_canonical(body)).hexdigest())
            with open(tmp / "manifest.json", "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(tmp / "arrays")
            fsync_dir(tmp)
            self._commit(tmp, info.path)
        except OSError as e:
            _remove(tmp)
            raise CheckpointError(f"cannot write checkpoint of step {info.step} to "
                                  f"{info.path}: {_os_reason(e)}") from e
        except BaseException:
            _remove(tmp)
            raise
        self._prune(info.step)
        info.write_s = time.perf_counter() - start
        return info

    _WRITERS = 4

    def _commit(self, tmp: Path, final: Path):
        """Renames the finished temporary directory into place; an existing checkpoint of the
        same step is moved aside first and deleted only after."""
        old = None
        if final.exists() or final.is_symlink():  # a damaged copy of the step, say
            old = final.with_name(f".old-{final.name}-{uuid.uuid4().hex[:8]}")
            os.rename(final, old)
        try:
            os.rename(tmp, final)
        except OSError:
            if old is not None:  # put back what was there
                try:
                    os.rename(old, final)
                except OSError:
                    pass  # opening the directory for writing next time does it
            raise
        fsync_dir(self.directory)
        if old is not None:
            _remove(old)

    def _prune(self, just_saved: int):
        """Deletes all but the last `keep` checkpoints (by step; they are not verified), and
        the step directories without a manifest (damage) older than every one kept. Newer
        damaged ones stay: a save of that step replaces them. A directory that vanishes
        meanwhile (another process pruning the same folder) is passed over."""
        if self.keep is None:
            return
        dirs = self._step_dirs()
        complete = sorted(s for s, p in dirs.items() if s != just_saved and _has_manifest(p))
        doomed = complete[:max(0, len(complete) - (self.keep - 1))]
        oldest_kept = min([just_saved] + complete[len(doomed):])
        doomed += [s for s, p in dirs.items() if s < oldest_kept and not _has_manifest(p)]
        for step in doomed:
            path = dirs[step]
            # Renamed first: a crash while deleting must not leave a half-deleted checkpoint
            # under a name that looks complete.
            trash = path.with_name(f".trash-{path.name}-{uuid.uuid4().hex[:8]}")
            try:
                os.rename(path, trash)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise CheckpointError(
                    f"checkpoint of step {just_saved} is written to {self.step_path(just_saved)}"
                    f", but the older {path} cannot be deleted: {_os_reason(e)}") from e
            _remove(trash)

    def _recover(self):
        """Tidies what an interrupted save, prune or check_writable left behind."""
        for p in self.directory.iterdir():
            if p.name.startswith(".old-step_"):
                final = self.directory / p.name[len(".old-"):].rsplit("-", 1)[0]
                if not (final.exists() or final.is_symlink()):
                    os.rename(p, final)  # interrupted between the two renames of _commit
                    continue
            if p.name.startswith(_TIDY):
                _remove(p)

    # ---- restoring

    def metadata(self, step: int | None = None) -> dict:
        """The step, loader state and config of a checkpoint (verified), without its arrays."""
        path = self._path_for(step)
        manifest = _read_manifest(path)
        return {k: manifest[k] for k in ("step", "loader", "config", "time")}

    def restore(self, like=None, step: int | None = None, *, partial: bool = False,
                fallback: bool = False, on_skip=None, earlier=()) -> Restored:
        """Restores checkpoint `step` (default: the latest) into the structure of `like`.

        Each leaf of `like` (array or jax.ShapeDtypeStruct) sets the shape and dtype expected
        and where the result goes: its sharding (any mesh, any number of devices); numpy
        arrays come back as numpy arrays. With like=None the result is a flat dict from key
        path to numpy array. Every chunk read is checked against its sha256 first; a
        checkpoint that fails raises CorruptCheckpointError, one that does not match `like`
        CheckpointError.

        `like` must match the saved tree leaf for leaf, unless partial=True: then it may be
        a part of it (like={"params": ...} of a tree saved with its optimizer state), and
        only the chunks of its arrays are read and verified (and the manifest).

        fallback=True (step None) restores the newest checkpoint that verifies: it tries the
        step directories newest first, and one that fails verification or cannot be read
        (CorruptCheckpointError), or has no manifest.json, is skipped, and reported as
        on_skip(path, reason) before the next is tried (reason: the error without the path,
        or NO_MANIFEST). A tree that does not match is no reason to fall back: that
        CheckpointError is raised at once. Raises FileNotFoundError if there is no step
        directory, CheckpointError naming each one tried if none verifies.

        earlier: EarlierLayouts of the tree; a checkpoint whose stored shapes are not like's
        but one of theirs is restored into that one, upgraded, and placed as `like` says
        (Restored.upgraded).
        """
        if not fallback:
            return self._restore(self._path_for(step), like, partial, earlier)
        if step is not None:
            raise ValueError(f"restore: fallback=True restores the newest checkpoint that "
                             f"verifies, so step must be None, got {step}")
        self.wait()
        dirs = self._step_dirs()
        tried = []
        for step in sorted(dirs, reverse=True):
            path = dirs[step]
            reason = NO_MANIFEST
            if _has_manifest(path):
                try:
                    return self._restore(path, like, partial, earlier)
                except CorruptCheckpointError as e:
                    reason = e.reason
                except FileNotFoundError:  # its manifest.json went meanwhile
                    pass
            if not (path.exists() or path.is_symlink()):
                continue  # not damage: pruned meanwhile by a writer
            tried.append(f"{path.name}: {reason}")
            if on_skip is not None:
                on_skip(path, reason)
        if not tried:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        raise CheckpointError(f"no checkpoint in {self.directory} can be restored: "
                              + "; ".join(tried))

    def _restore(self, path: Path, like, partial: bool, earlier=()) -> Restored:
        manifest = _read_manifest(path)
        records = {r["path"]: r for r in manifest["arrays"]}
        if like is None:
            tree = {name: _ArrayReader(path, r).read_all() for name, r in records.items()}
            return Restored(manifest["step"], tree, manifest.get("loader"),
                            manifest.get("config"), path)
        layout = None
        if not _fits(records, like, partial):
            layout = next((e for e in earlier if _fits(records, e.like, partial)), None)
        tree = self._restore_into(path, records, like if layout is None else layout.like,
                                  partial)
        if layout is not None:
            tree = jax.tree.map(_place_as, layout.upgrade(tree), like)
        return Restored(manifest["step"], tree, manifest.get("loader"), manifest.get("config"),
                        path, upgraded=layout is not None)

    @staticmethod
    def _restore_into(path: Path, records: dict, like, partial: bool):
        leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
        names = [jax.tree_util.keystr(p) for p, _ in leaves]
        missing = [n for n in names if n not in records]
        extra = [] if partial else [n for n in records if n not in set(names)]
        if missing or extra:
            raise CheckpointError(
                f"checkpoint {path} does not match the tree to restore into: "
                + (f"not in the checkpoint: {', '.join(missing[:5])}"
                   + (" ..." if len(missing) > 5 else "") if missing else "")
                + ("; " if missing and extra else "")
                + (f"in the checkpoint but not in the tree: {', '.join(extra[:5])}"
                   + (" ..." if len(extra) > 5 else "") if extra else ""))
        return jax.tree_util.tree_unflatten(
            treedef, [_restore_leaf(path, records[n], leaf)
                      for n, (_, leaf) in zip(names, leaves)])

    def _path_for(self, step: int | None) -> Path:
        self.wait()
        if step is None:
            steps = self.steps()
            if not steps:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
            step = steps[-1]
        path = self.step_path(int(step))
        if not _has_manifest(path):
            raise FileNotFoundError(f"no checkpoint of step {step} in {self.directory} "
                                    f"(there are: {self.steps() or 'none'})")
        return path


def _has_manifest(step_dir: Path) -> bool:
    return (step_dir / "manifest.json").is_file()


def _fits(records: dict, like, partial: bool) -> bool:
    """Whether a checkpoint's arrays (its manifest's records) have the key paths and shapes of
    like's leaves (a key's stored shape is its data's, which no layout changes: not compared)."""
    leaves = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(like)[0]}
    if not partial and set(records) != set(leaves):
        return False
    return all(name in records and (_is_key(x) or list(np.shape(x)) == records[name]["shape"])
               for name, x in leaves.items())


def _place_as(x, like):
    """x where like's sharding says, if it has one (an upgraded leaf: made where it was read)."""
    sharding = getattr(like, "sharding", None)
    return x if sharding is None or isinstance(x, np.ndarray) else jax.device_put(x, sharding)


def _write_chunk(root: Path, name: str, index, data: np.ndarray) -> dict:
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    digest = hashlib.sha256(raw).hexdigest()
    with open(root / name, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    return {"file": name, "index": index, "nbytes": int(raw.size), "sha256": digest}


def _read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except FileNotFoundError:
        raise
    except OSError as e:
        raise CorruptCheckpointError(path, f"cannot read manifest.json: {_os_reason(e)}") \
            from None
    except ValueError as e:
        raise CorruptCheckpointError(path, f"manifest.json is corrupt ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CorruptCheckpointError(path, f"manifest.json is not a {FORMAT} manifest")
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    if hashlib.sha256(_canonical(body)).hexdigest() != manifest.get("sha256"):
        raise CorruptCheckpointError(path, "manifest.json fails its checksum: it is corrupt")
    if manifest["version"] != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path}: format version {manifest['version']} is "
                              f"not {FORMAT_VERSION}")
    return manifest


class _ArrayReader:
    """Reads regions of one saved array, loading and verifying each chunk once."""

    def __init__(self, root: Path, record: dict):
        self.root, self.record = root, record
        self.name = record["path"]
        self.dtype = jnp.dtype(record["dtype"])
        self._chunks: dict[int, np.ndarray] = {}

    def _chunk(self, j: int) -> np.ndarray:
        if j not in self._chunks:
            chunk = self.record["chunks"][j]
            file = self.root / chunk["file"]
            where = f"array {self.name} ({chunk['file']})"
            try:
                size = file.stat().st_size
                raw = file.read_bytes()
            except OSError as e:
                raise CorruptCheckpointError(self.root, f"{where}: cannot read: "
                                                        f"{e.strerror or e}") from None
            if size != chunk["nbytes"]:
                problem = "truncated" if size < chunk["nbytes"] else "too long"
                raise CorruptCheckpointError(self.root, f"{where}: {problem}: {size} bytes, "
                                                        f"expected {chunk['nbytes']}")
            if hashlib.sha256(raw).hexdigest() != chunk["sha256"]:
                raise CorruptCheckpointError(self.root, f"{where}: checksum mismatch: the "
                                                        f"data is corrupt")
            shape = [b - a for a, b in chunk["index"]]
            self._chunks[j] = np.frombuffer(raw, dtype=self.dtype).reshape(shape)
        return self._chunks[j]

    def read(self, index) -> np.ndarray:
        """The region `index` (a tuple of slices, as jax.make_array_from_callback passes)."""
        shape = self.record["shape"]
        want = _index_ranges(index, shape) if shape else []
        chunks = self.record["chunks"]
        if len(chunks) == 1 and chunks[0]["index"] == want:
            return self._chunk(0)
        out = np.empty([b - a for a, b in want], dtype=self.dtype)
        covered = 0
        for j, chunk in enumerate(chunks):
            overlap = [(max(a, c), min(b, d)) for (a, b), (c, d) in zip(want, chunk["index"])]
            if any(lo >= hi for lo, hi in overlap):
                continue
            src = tuple(slice(lo - c, hi - c)
                        for (lo, hi), (c, _) in zip(overlap, chunk["index"]))
            dst = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(overlap, want))
            out[dst] = self._chunk(j)[src]
            covered += int(np.prod([hi - lo for lo, hi in overlap]))
        if covered != out.size:
            raise CheckpointError(f"checkpoint {self.root}: array {self.name}: the saved "
                                  f"chunks cover {covered} of the {out.size} elements asked for")
        return out

    def read_all(self) -> np.ndarray:
        return self.read(tuple(slice(0, n) for n in self.record["shape"]))


def _restore_leaf(root: Path, record: dict, like):
    name = record["path"]
    reader = _ArrayReader(root, record)
    key_impl = record.get("key_impl")
    if _is_key(like) != bool(key_impl):
        raise CheckpointError(f"checkpoint {root}: array {name} is "
                              f"{'a PRNG key' if key_impl else 'not a PRNG key'} there but "
                              f"{'is' if _is_key(like) else 'is not'} one in the tree")
    if key_impl:
        impl = str(jax.random.key_impl(like)) if isinstance(like, jax.Array) else key_impl
        if impl != key_impl:
            raise CheckpointError(f"checkpoint {root}: key {name} uses {key_impl}, the tree "
                                  f"{impl}")
        key = jax.random.wrap_key_data(reader.read_all(), impl=key_impl)
        if tuple(key.shape) != tuple(like.shape):
            raise CheckpointError(f"checkpoint {root}: key {name} has shape "
                                  f"{list(key.shape)}, the tree {list(like.shape)}")
        sharding = getattr(like, "sharding", None)
        return jax.device_put(key, sharding) if sharding is not None else key
    shape, dtype = tuple(record["shape"]), jnp.dtype(record["dtype"])
    like_shape = tuple(np.shape(like))
    like_dtype = jnp.dtype(like.dtype) if hasattr(like, "dtype") else np.asarray(like).dtype
    if like_shape != shape:
        raise CheckpointError(f"checkpoint {root}: array {name} has shape {list(shape)}, the "
                              f"tree {list(like_shape)}")
    if isinstance(like, (int, float, bool, complex)):
        return type(like)(reader.read_all().item())
    if like_dtype != dtype:
        raise CheckpointError(f"checkpoint {root}: array {name} is {dtype}, the tree "
                              f"{like_dtype}")
    if isinstance(like, np.generic):
        return reader.read_all()[()]
    if isinstance(like, np.ndarray):
        return reader.read_all().copy()
    sharding = getattr(like, "sharding", None)
    if sharding is None:  # the default device, this process's own first one
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.make_array_from_callback(shape, sharding, reader.read)
