"""Which tokenizer made a folder of token shards: a sidecar file beside them that prepare()
writes, `blujax-tokenizer.json` (the tokenizer's identity: name, fingerprint, vocab_size), and
the check that refuses shards of one tokenizer for a model of another.

Shards without a sidecar are llm.c's: its uint16 format is GPT-2's tokens, and its uint32
format names no tokenizer (unknown; the loader still checks every token against the model's
vocabulary).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from blujax.data.errors import DataError
from blujax.data.shards import TOKEN_DTYPE, read_format
from blujax.data.tokenizer import GPT2, GPT2_FINGERPRINT, Tokenizer, describe
from blujax.vocab import GPT2_VOCAB_SIZE

SIDECAR = "blujax-tokenizer.json"
# What llm.c's uint16 shards are made by, known without loading tiktoken.
GPT2_IDENTITY = {"name": GPT2, "fingerprint": GPT2_FINGERPRINT, "vocab_size": GPT2_VOCAB_SIZE}


def record_tokenizer(folder, tokenizer: Tokenizer) -> Path:
    """Writes the folder's sidecar: its shards are `tokenizer`'s tokens (a folder that already
    says so is left alone, so that reading a complete text cache writes nothing)."""
    path = Path(folder) / SIDECAR
    try:
        if read_sidecar(folder) == tokenizer.identity():
            return path
    except DataError:
        pass  # unreadable: written again below
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(tokenizer.identity(), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise DataError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def read_sidecar(folder) -> dict | None:
    """The identity a folder's sidecar records, or None where it has none."""
    path = Path(folder) / SIDECAR
    try:
        identity = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot read the record of the shards' tokenizer ({e}); "
                        f"delete it to read the shards as llm.c's") from None
    if not (isinstance(identity, dict) and isinstance(identity.get("fingerprint"), str)
            and isinstance(identity.get("vocab_size"), int)):
        raise DataError(f"{path}: not a record of a tokenizer (JSON with name, fingerprint "
                        f"and vocab_size); delete it to read the shards as llm.c's")
    return identity


def recorded_tokenizer(paths) -> dict | None:
    """The identity of the tokenizer that made the shards: their folder's sidecar, else GPT-2's
    where all are uint16 (llm.c's GPT-2 format), else None (unknown). Shards from folders of
    two tokenizers raise a DataError; unknown ones beside known ones take the known one's."""
    folders: dict[Path, list[Path]] = {}
    for p in map(Path, paths):
        folders.setdefault(p.parent, []).append(p)
    known = None
    for folder, group in folders.items():
        identity = read_sidecar(folder)
        if identity is None and all(read_format(p)[1] == TOKEN_DTYPE for p in group):
            identity = GPT2_IDENTITY
        if identity is None:
            continue
        if known is not None and known["fingerprint"] != identity["fingerprint"]:
            raise DataError(f"{group[0]}: shards made by {describe(identity)}, beside shards "
                            f"made by {describe(known)}: one data set needs one tokenizer")
        known = known or identity
    return known


def check_tokenizer(paths_or_source, tokenizer: Tokenizer, what) -> dict | None:
    """The recorded identity of the shards (a list of paths, or a DataSource's train and val,
    with the identity it recorded); a one-line DataError where `tokenizer` did not make them.
    Unknown shards pass (the loader checks their tokens against the vocabulary)."""
    if hasattr(paths_or_source, "train"):
        recorded = paths_or_source.tokenizer
    else:
        recorded = recorded_tokenizer(paths_or_source)
    if recorded is not None and recorded["fingerprint"] != tokenizer.fingerprint:
        raise DataError(f"{what}: token shards made by {describe(recorded)}, but the model "
                        f"speaks {describe(tokenizer.identity())}: tokenize the text again "
                        f"with python -m blujax.data prepare --tokenizer {tokenizer.spec}")
    return recorded
