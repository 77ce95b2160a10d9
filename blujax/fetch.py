"""Files blujax fetches once where there is a network: the user cache, and downloading into it.

    path = user_cache_dir() / "tinyshakespeare.txt"
    download(url, path, sha256=..., progress=True)     # atomically; checked before it lands

The cache is $XDG_CACHE_HOME/blujax, else ~/.cache/blujax.
"""

from __future__ import annotations

import hashlib
import os
import sys
import urllib.request
from pathlib import Path
from typing import Callable


def user_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(root) / "blujax"


def download(url: str, dest: Path, *, sha256: str | None = None, progress: bool,
             check: Callable[[Path], None] | None = None, timeout: float = 30):
    """Downloads url to dest atomically, with a progress bar. Before it replaces dest: a
    download shorter than its Content-Length, a sha256 other than `sha256` (if given), or
    check(path) raising (a ValueError saying why) fails it. Network errors propagate as
    urllib raises them (OSError)."""
    from tqdm import tqdm
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as f:
            total = int(response.headers.get("Content-Length") or 0) or None
            size = 0
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"downloading {dest.name}",
                      disable=not progress, file=sys.stderr) as bar:
                while chunk := response.read(1 << 16):
                    f.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                    bar.update(len(chunk))
        if total is not None and size != total:
            raise ValueError(f"the download was cut short: {size} of {total} bytes")
        if sha256 is not None and digest.hexdigest() != sha256:
            raise ValueError(f"the download's sha256 is {digest.hexdigest()}, not the "
                             f"expected {sha256}")
        if check is not None:
            check(tmp)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
