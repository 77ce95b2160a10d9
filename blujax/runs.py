"""A run on disk: its folder, config.json, its checkpoints in ckpt/, its tokenizer, its lock.

    saved = runs.load_run("runs/a")               # config.json (rebuilt from a checkpoint if lost)
    runs.checkpoint_dir("runs/a")                 # runs/a/ckpt, which blujax.startup reads
    tokenizer = runs.run_tokenizer(out, saved, model_config)
    with runs.RunFolder(out):                     # one run per folder, and nothing left if none

config.json records the run's settings, model, tokenizer, training config, data and device, and
every checkpoint keeps a copy of it (loop.run's checkpoint_config), so that a lost config.json
comes back. A model that speaks its own tokenizer (one imported with tokenizer.json) has its
files copied into tokenizer/, so that the run travels. A checkpoint holds the parameters,
optimizer state, step and sampling key (blujax.loop.checkpoint_tree), with the data loader's
position beside them.

One training run per folder: a lock on the folder that a second run meets and refuses. The lock
is an advisory `flock` on `.lock`, held by the open file for as long as the run lasts. The kernel
drops it when the process ends however it ends (an exception, SIGKILL, a crash), so a dead run
never leaves the folder locked; the file itself may stay, harmless. A RunFolder deletes the file
as it lets go (remove=True), so that a refused or finished run leaves none; a holder therefore
checks, once it has the lock, that the file it locked is still the one at the path (its holder
may have deleted it meanwhile), else it locks the new one. The file holds the holder's pid and
host, to name it in the refusal.

Problems a user can fix raise RunError, in one line.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Callable

from blujax.checkpoint import CheckpointError, Checkpointer
from blujax.data import DataError
from blujax.data import tokenizer as tokenizer_lib
from blujax.vocab import GPT2_VOCAB_SIZE

RUN_FILES = ("config.json", "metrics.jsonl", "loss.png", "samples.txt")
TOKENIZER_DIR = "tokenizer"


class RunError(ValueError):
    """A run folder that cannot be used as asked; the message (one line) says what to do."""


def write_error(folder, e: OSError) -> RunError:
    """An OSError writing in `folder` (making it, its lock, config.json, ...): `cannot write in
    FOLDER: No space left on device`."""
    return RunError(f"cannot write in {folder}: {e.strerror or e}")


def config_path(out) -> Path:
    return Path(out) / "config.json"


def checkpoint_dir(out) -> Path:
    return Path(out) / "ckpt"


def load_run(out: Path, warn: Callable[[str], None] | None = None) -> dict:
    """The config.json of the run in `out`; one that was lost is written again from the newest
    checkpoint, which keeps a copy of it (and warn() says so)."""
    path = config_path(out)
    if not path.is_file():
        return _rebuild_config(out, warn)
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise RunError(f"{path} is not valid JSON ({e})") from None


def _rebuild_config(out: Path, warn) -> dict:
    reader = Checkpointer(checkpoint_dir(out), read_only=True)
    steps = reader.steps()
    if not steps:
        raise RunError(f"{out} holds no training run (no config.json): train one first with "
                       f"`train --out {out}`")
    try:
        saved = reader.metadata(steps[-1])["config"]
    except (CheckpointError, OSError) as e:
        raise RunError(f"{out}: config.json is missing and the checkpoint of step "
                       f"{steps[-1]} cannot be read to rebuild it ({e})") from None
    if not (isinstance(saved, dict) and "settings" in saved and "model" in saved):
        raise RunError(f"{out}: config.json is missing, and its checkpoints (written by an "
                       f"earlier blujax) do not keep a copy of it: put back the run's "
                       f"config.json, or start again with --overwrite")
    try:
        write_json(config_path(out), saved)
    except OSError as e:
        raise write_error(out, e) from None
    if warn is not None:
        warn(f"note: {out}/config.json was missing: written again from the checkpoint of "
             f"step {steps[-1]}")
    return saved


def save_tokenizer(out: Path, tokenizer):
    """A Hugging Face tokenizer's files into the run's tokenizer/ (GPT-2's needs none)."""
    folder = out / TOKENIZER_DIR
    if tokenizer is not None and tokenizer.folder is not None \
            and tokenizer.folder.resolve() != folder.resolve():
        shutil.rmtree(folder, ignore_errors=True)
        tokenizer.save(folder)


def run_tokenizer(out: Path, saved: dict, model_config):
    """The tokenizer the run in `out` speaks (None: none, token shards only): its tokenizer/
    folder; else GPT-2's, for runs that record GPT-2's or (written before runs recorded one)
    have a vocabulary that holds GPT-2's ids."""
    folder = out / TOKENIZER_DIR
    recorded = saved.get("tokenizer", "unrecorded")
    try:
        if folder.is_dir():
            return tokenizer_lib.load_tokenizer(folder)
    except DataError as e:
        raise RunError(str(e)) from None
    if recorded == "unrecorded":
        return tokenizer_lib.gpt2() if model_config.vocab_size >= GPT2_VOCAB_SIZE else None
    if recorded is None:
        return None
    if recorded.get("fingerprint") == tokenizer_lib.GPT2_FINGERPRINT:
        return tokenizer_lib.gpt2()
    raise RunError(f"{out}: the run speaks {tokenizer_lib.describe(recorded)}, and its files "
                   f"are missing from {folder}: copy them there from the model it was "
                   f"imported from")


def write_json(path: Path, obj):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def clear_run(out: Path):
    """Deletes what an earlier run in `out` wrote, so that a fresh run does not mix with it
    (the files a write cut short left too)."""
    try:
        for name in RUN_FILES:
            for path in (out / name, out / f"{name}.tmp", out / f"{name}.tmp.png"):
                path.unlink(missing_ok=True)
    except OSError as e:
        raise write_error(out, e) from None
    shutil.rmtree(checkpoint_dir(out), ignore_errors=True)
    shutil.rmtree(out / TOKENIZER_DIR, ignore_errors=True)


def trained(out: Path) -> bool:
    """Whether the run in `out` has trained anything that is kept: a checkpoint, or a record
    in metrics.jsonl."""
    metrics = out / "metrics.jsonl"
    return bool(Checkpointer(checkpoint_dir(out), read_only=True).steps()
                or metrics.is_file() and metrics.stat().st_size > 0)


def where_it_stands(out: Path) -> str:
    """How to go on with the run in `out`, from what it holds: for the lines that end a run."""
    steps = Checkpointer(checkpoint_dir(out), read_only=True).steps()
    try:
        complete = steps and steps[-1] >= json.loads(config_path(out).read_text())[
            "settings"]["steps"]
    except (OSError, ValueError, KeyError, TypeError):
        complete = False
    if complete:
        return f"the run is complete, with its checkpoint of step {steps[-1]} in " \
               f"{checkpoint_dir(out)}"
    if steps:
        return (f"its latest checkpoint, of step {steps[-1]}, is in {checkpoint_dir(out)}: "
                f"continue with: train --resume --out {out}")
    if config_path(out).is_file():
        return f"{out} holds a run with no checkpoint: --overwrite starts it again"
    return "nothing was trained"


class RunFolder:
    """`train`'s hold on its --out: the lock (RunLock), and the undoing of a start that
    trained nothing. Ended by an error or an interrupt before it kept anything (trained),
    a run started afresh (start_fresh) deletes what it wrote; and whatever ends it early, the
    folders it made for --out go again if they are empty. So a `train` refused at set-up
    leaves no folder and no lock behind, and one interrupted before step 1 leaves none of
    its files."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.made = []  # the folders to make for --out, deepest first
        for folder in (self.out, *self.out.parents):
            if folder.exists():
                break
            self.made.append(folder)
        self.lock = RunLock(self.out, remove=True)
        self.fresh = False

    def __enter__(self):
        try:
            self.lock.__enter__()
        except BaseException:
            self._remove_made()
            raise
        return self

    def start_fresh(self):
        """Deletes an earlier run in --out (--overwrite): the files there are this run's."""
        clear_run(self.out)
        self.fresh = True

    def __exit__(self, kind, error, traceback):
        try:
            if kind is not None and self.fresh and not trained(self.out):
                clear_run(self.out)
        except (OSError, RunError):
            pass  # what could not be deleted stays; the error under way is the one to tell
        finally:
            self.lock.__exit__()
            if kind is not None:
                self._remove_made()

    def _remove_made(self):
        for folder in self.made:
            try:
                folder.rmdir()
            except OSError:
                break


LOCK_NAME = ".lock"


class RunLock:
    """Holds `out`'s lock from __enter__ to __exit__; a second holder gets a RunError, and so
    does a folder or lock file that cannot be written (a full disk, say). remove: delete the
    file as it lets go."""

    def __init__(self, out: Path, remove: bool = False):
        self.path = Path(out) / LOCK_NAME
        self.remove = remove
        self._file = None

    def __enter__(self):
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            while self._file is None:
                self._file = self._lock()
            self._file.seek(0)
            self._file.truncate()
            self._file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
            self._file.flush()
        except OSError as e:
            self.remove = True  # what it wrote, it takes back
            self.__exit__()
            raise write_error(self.path.parent, e) from None
        return self

    def _lock(self):
        """The lock file, open and locked; None if it was deleted before it was locked."""
        f = open(self.path, "a+")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip()
            f.close()
            raise RunError(f"another training run is using {self.path.parent}"
                           + (f" ({holder})" if holder else "")
                           + ": one run per folder; wait for it to end, or choose another "
                             "--out") from None
        except BaseException:
            f.close()
            raise
        try:
            if os.stat(self.path).st_ino == os.fstat(f.fileno()).st_ino:
                return f
        except FileNotFoundError:
            pass
        f.close()  # its holder deleted it as it let go: lock the one at the path now
        return None

    def __exit__(self, *exc):
        if self._file is not None:
            # Deleted while held, then let go: whoever opened it meanwhile finds it gone.
            try:
                if self.remove:
                    self.path.unlink()
            except OSError:
                pass
            self._file.close()  # closing the file releases the lock
            self._file = None
