"""Text in: tiktoken's encoding, and the documents of text and JSON-lines files, read as
UTF-8 with errors that name the file and the place."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from blujax.data.errors import TextError


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


def decode_text(raw: bytes, path: Path, offset: int = 0, line: int = 1) -> str:
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
                    decoded = decode_text(line, path, start, lineno)
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
            text, size = decode_text(raw, path), len(raw)
            del raw
            if separator:
                pieces = text.split(separator)
                for i, piece in enumerate(pieces):
                    doc = piece + separator if i < len(pieces) - 1 else piece
                    yield doc, len(doc.encode("utf-8"))
            else:
                yield text, size
