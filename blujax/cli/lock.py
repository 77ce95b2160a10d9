"""One training run per folder: a lock on --out that a second `train` meets and refuses.

The lock is an advisory `flock` on `--out/.lock`, held by the open file for as long as the run
lasts. The kernel drops it when the process ends however it ends (an exception, SIGKILL, a
crash), so a dead run never leaves the folder locked; the file itself may stay, harmless. The
file holds the holder's pid and host, to name it in the refusal.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from blujax.cli.settings import UsageError

LOCK_NAME = ".lock"


class RunLock:
    """Holds `out`'s lock from __enter__ to __exit__; a second holder gets a UsageError."""

    def __init__(self, out: Path):
        self.path = Path(out) / LOCK_NAME
        self._file = None

    def __enter__(self):
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            f = open(self.path, "a+")
        except OSError as e:
            raise UsageError(f"cannot write in {self.path.parent}: {e.strerror or e}") from None
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip()
            f.close()
            raise UsageError(f"another training run is using {self.path.parent}"
                             + (f" ({holder})" if holder else "")
                             + ": one run per folder; wait for it to end, or choose another "
                               "--out") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        self._file = f
        return self

    def __exit__(self, *exc):
        if self._file is not None:
            self._file.close()  # closing the file releases the lock
            self._file = None
