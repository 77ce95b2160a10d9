"""A model's tokenizer: GPT-2's tiktoken encoding, or a Hugging Face folder's tokenizer.json
(through the `tokenizers` library), behind one object that the data layer, evaluation,
HellaSwag and sampling all use.

    tok = load_tokenizer("gpt2")                 # tiktoken's GPT-2 encoding
    tok = load_tokenizer("path/to/Llama-3.2-1B")  # its tokenizer.json (or vocab.json + merges.txt)
    ids = tok.encode("Hello")                    # no special tokens, as data is tokenized
    tok.decode(ids), tok.doc_token, tok.stop_tokens, tok.vocab_size, tok.fingerprint

A tokenizer is known by its fingerprint: a hash of every token's bytes in id order, the same
for GPT-2's vocabulary whether tiktoken or a Hugging Face folder supplies it. Token shards and
runs record it, so that tokens made by one tokenizer never reach a model of another.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Callable

from blujax.data.errors import DataError
from blujax.vocab import GPT2_EOT, GPT2_VOCAB_SIZE

GPT2 = "gpt2"
# fingerprint(GPT-2's encoding), so that GPT-2's shards (llm.c's uint16 format, which names no
# tokenizer) are recognised without loading tiktoken; tests check it against tiktoken.
GPT2_FINGERPRINT = "90216161d662f94a"
# A Hugging Face folder's tokenizer files, copied into a run folder and into an export.
HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "generation_config.json", "vocab.json", "merges.txt")


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """name: "gpt2" or the folder's name. fingerprint: 16 hex digits identifying the
    vocabulary. vocab_size: ids are in [0, vocab_size). doc_token: the token that begins every
    document in token shards (GPT-2's <|endoftext|>, as llm.c writes; a Hugging Face
    tokenizer's bos token, else its eos). stop_tokens: where generation ends. folder: the
    Hugging Face files it came from (None for tiktoken's GPT-2)."""

    name: str
    fingerprint: str
    vocab_size: int
    doc_token: int
    stop_tokens: tuple[int, ...]
    folder: Path | None
    _encode: Callable[[str], list[int]] = dataclasses.field(repr=False)
    _decode: Callable[[list[int]], str] = dataclasses.field(repr=False)

    def encode(self, text: str) -> list[int]:
        """text's token ids, special-token text encoded as plain text (data, prompts)."""
        return self._encode(text)

    def decode(self, ids) -> str:
        """The text of ids; ids past the vocabulary (the padded embedding rows) are dropped."""
        return self._decode([int(i) for i in ids if 0 <= int(i) < self.vocab_size])

    @property
    def is_gpt2(self) -> bool:
        return self.fingerprint == GPT2_FINGERPRINT

    def identity(self) -> dict:
        """What a shard folder or run records of it (JSON)."""
        return {"name": self.name, "fingerprint": self.fingerprint,
                "vocab_size": self.vocab_size}

    @property
    def spec(self) -> str:
        """What load_tokenizer takes to load it again (in another process)."""
        return GPT2 if self.folder is None else str(self.folder)

    def save(self, folder: Path) -> list[str]:
        """Copies its Hugging Face files into folder (none for tiktoken's GPT-2); the names."""
        if self.folder is None:
            return []
        folder.mkdir(parents=True, exist_ok=True)
        names = [n for n in HF_FILES if (self.folder / n).is_file()]
        for name in names:
            if (self.folder / name).resolve() != (folder / name).resolve():
                shutil.copyfile(self.folder / name, folder / name)
        if "tokenizer_config.json" not in names:  # say which tokens are bos and eos
            specials = {"tokenizer_class": "PreTrainedTokenizerFast",
                        "eos_token": self._token_text(self.stop_tokens[0]),
                        "bos_token": self._token_text(self.doc_token)}
            (folder / "tokenizer_config.json").write_text(json.dumps(specials, indent=2) + "\n",
                                                          encoding="utf-8")
            names.append("tokenizer_config.json")
        return names

    def _token_text(self, i: int) -> str:
        return self._decode([i])


def describe(identity: dict | None) -> str:
    """A recorded identity in words: "gpt2" or "NAME (fingerprint F, V tokens)"."""
    if identity is None:
        return "an unrecorded tokenizer"
    if identity.get("fingerprint") == GPT2_FINGERPRINT:
        return "GPT-2's tokenizer"
    return (f"the tokenizer {identity.get('name')!r} ({identity.get('vocab_size')} tokens, "
            f"fingerprint {identity.get('fingerprint')})")


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """"gpt2" (tiktoken), or a folder with tokenizer.json or vocab.json + merges.txt (a Hugging
    Face model folder, a run folder's tokenizer/). A DataError says what is missing."""
    if str(spec) == GPT2:
        return gpt2()
    folder = Path(spec)
    if not folder.is_dir():
        raise DataError(f"tokenizer {spec}: not 'gpt2' and not a folder with tokenizer.json")
    return _hf(folder.resolve())


def find_tokenizer(folder: Path) -> Tokenizer | None:
    """The tokenizer of a Hugging Face model folder, or None when it holds no tokenizer files."""
    if (folder / "tokenizer.json").is_file() or (
            (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file()):
        return load_tokenizer(folder)
    return None


@functools.cache
def gpt2() -> Tokenizer:
    """GPT-2's encoding. tiktoken loads it at the first encode or decode, so that a run on token
    shards needs no tokenizer files; there a DataError says what to do on an offline machine."""
    def encoding():
        from blujax.data.text import get_encoding
        try:
            return get_encoding(GPT2)  # tiktoken caches it
        except RuntimeError as e:
            raise DataError(str(e)) from None

    return Tokenizer(GPT2, GPT2_FINGERPRINT, GPT2_VOCAB_SIZE, GPT2_EOT, (GPT2_EOT,), None,
                     lambda text: encoding().encode_ordinary(text),
                     lambda ids: encoding().decode(ids))


def fingerprint(token_bytes) -> str:
    """16 hex digits of sha256 over every token's bytes, in id order (length-prefixed)."""
    h = hashlib.sha256()
    n = 0
    for b in token_bytes:
        h.update(len(b).to_bytes(4, "little"))
        h.update(b)
        n += 1
    h.update(n.to_bytes(8, "little"))
    return h.hexdigest()[:16]


def tiktoken_fingerprint(enc) -> str:
    return fingerprint(enc.decode_single_token_bytes(i) for i in range(enc.n_vocab))


@functools.lru_cache(maxsize=8)
def _hf(folder: Path) -> Tokenizer:
    try:
        import tokenizers
    except ImportError as e:
        raise DataError("a model folder's tokenizer needs the tokenizers library (pip install "
                        "tokenizers)") from e
    try:
        if (folder / "tokenizer.json").is_file():
            tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        else:  # GPT-2's layout: a byte-level BPE
            from tokenizers import decoders, models, pre_tokenizers
            tok = tokenizers.Tokenizer(models.BPE.from_file(str(folder / "vocab.json"),
                                                            str(folder / "merges.txt")))
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tok.decoder = decoders.ByteLevel()
    except FileNotFoundError:
        raise DataError(f"{folder}: no tokenizer.json (nor vocab.json and merges.txt)") from None
    except Exception as e:  # the library's own errors: a file it cannot parse
        raise DataError(f"{folder}: cannot read its tokenizer: {str(e).splitlines()[0]}") \
            from None
    # Special-token text in data is plain text, as tiktoken's encode_ordinary has it: else a
    # document could forge the token that begins documents.
    tok.encode_special_tokens = True
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    byte_level = _is_byte_level(json.loads(tok.to_str()))
    tokens = [tok.id_to_token(i) for i in range(vocab_size)]
    if any(t is None for t in tokens):
        raise DataError(f"{folder}: its tokenizer's ids are not contiguous from 0")
    fp = fingerprint(_token_bytes(t) if byte_level else t.encode("utf-8") for t in tokens)
    settings = _read_json(folder / "tokenizer_config.json")
    model = _read_json(folder / "config.json")
    generation = _read_json(folder / "generation_config.json")

    def token_id(value) -> int | None:
        if isinstance(value, dict):
            value = value.get("content")
        return tok.token_to_id(value) if isinstance(value, str) else None

    def ids(value) -> list[int]:
        values = value if isinstance(value, list) else [value]
        return [v for v in values if isinstance(v, int) and 0 <= v < vocab_size]

    eos = (ids(generation.get("eos_token_id")) or ids(model.get("eos_token_id"))
           or ids(token_id(settings.get("eos_token"))))
    bos = (ids(token_id(settings.get("bos_token"))) or ids(model.get("bos_token_id"))
           or ids(generation.get("bos_token_id")))
    if fp == GPT2_FINGERPRINT:
        eos, bos = eos or [GPT2_EOT], [GPT2_EOT]  # llm.c's documents begin with end-of-text
    if not eos and not bos:
        raise DataError(f"{folder}: its tokenizer names no bos or eos token (tokenizer_config."
                        f"json bos_token / eos_token), so documents cannot be separated")
    name = GPT2 if fp == GPT2_FINGERPRINT else folder.name
    return Tokenizer(name, fp, vocab_size, (bos or eos)[0], tuple(eos or bos), folder,
                     lambda text: tok.encode(text, add_special_tokens=False).ids,
                     lambda ids: tok.decode(ids, skip_special_tokens=False))


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _is_byte_level(spec: Any) -> bool:
    """Whether a tokenizer.json decodes through GPT-2's byte-to-unicode map."""
    decoder = spec.get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(isinstance(d, dict) and d.get("type") == "ByteLevel" for d in parts)


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's bytes-to-unicode map: printable bytes stand for themselves, the
    rest for code points from 256 on, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _token_bytes(token: str) -> bytes:
    """A byte-level token's bytes; characters outside the map (an added special token's text)
    as their UTF-8."""
    table = _unicode_to_byte()
    out = bytearray()
    for ch in token:
        b = table.get(ch)
        out += bytes([b]) if b is not None else ch.encode("utf-8")
    return bytes(out)



def for_text(tokenizer: Tokenizer | None, vocab_size: int, where: str) -> Tokenizer:
    """The tokenizer through which text reaches a model of vocab_size: its own; without one,
    GPT-2's where the vocabulary holds GPT-2's ids (a model trained from scratch here); else a
    DataError saying what to give instead."""
    if tokenizer is None:
        if vocab_size < GPT2_VOCAB_SIZE:
            raise DataError(f"{where} has no tokenizer files (tokenizer.json) and its "
                            f"vocabulary ({vocab_size} tokens) cannot hold GPT-2's: give token "
                            f"shards made for it, or put its tokenizer.json beside its weights")
        return gpt2()
    if tokenizer.vocab_size > vocab_size:
        raise DataError(f"{where}: its tokenizer has {tokenizer.vocab_size} tokens, more than "
                        f"the model's vocabulary ({vocab_size})")
    return tokenizer
