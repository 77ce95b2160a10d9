"""Pretrained weights in and out: Hugging Face folders, the hub's GPT-2s, llm.c model files.

    pre = load_pretrained("gpt2")                  # or a folder, or "gpt2_124M.bin"
    pre.config, pre.params                         # the family's config, float32 numpy params
    export_hf(params, config, "out/hf")            # AutoModelForCausalLM.from_pretrained
    export_llmc(params, config, "out/model.bin")   # llm.c's train_gpt2 and load_pretrained

A Hugging Face folder holds config.json and model.safetensors (what save_pretrained writes);
its config.json's `model_type` picks the model family (`FAMILIES`: GPT2LMHeadModel,
LlamaForCausalLM, Qwen2ForCausalLM, each family's HF_ARCHITECTURE). A hub name (`HUB_NAMES`) is
downloaded into (or, offline, read from) huggingface_hub's cache. An llm.c model file is a
header of 256 little-endian int32 (magic 20240326, version 3: float32 or 5: bfloat16, then
max_seq_len, vocab_size, num_layers, num_heads, channels, padded_vocab_size) followed by the
parameters in llm.c's order (`gpt2.llmc_shapes`).

The vocabulary is padded as ours is (to a multiple of 128, the new rows zero); exports drop the
padding for transformers, and keep it for llm.c, which pads the same way. Every problem a user
can fix raises InteropError, with a one-line message that names the file or name at fault.
The layouts themselves (names, stacking, transposes) are the model family's converters, pure
functions (`blujax.model.<family>`: to_hf, from_hf, config_from_hf, hf_config; GPT-2's
to_llmc, from_llmc); this module does the file work around them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import ml_dtypes  # bfloat16 for numpy; imported, it also names it for safetensors' numpy reader
import numpy as np

from blujax import vocab
from blujax.data.errors import DataError
from blujax.data.tokenizer import Tokenizer, find_tokenizer
from blujax.data.tokenizer import gpt2 as gpt2_tokenizer
from blujax.model import FAMILIES, family_of, gpt2

log = logging.getLogger(__name__)

# A Hugging Face config.json's model_type names the family (blujax.model.FAMILIES) that
# converts its layout: each family's NAME is transformers' model_type.
# The hub's GPT-2s (openai-community/...), by the names transformers users know them by.
HUB_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
HUB_ORG = "openai-community"

LLMC_MAGIC = 20240326  # llm.c's GPT-2 model file
LLMC_HEADER_INTS = 256
LLMC_HEADER_BYTES = LLMC_HEADER_INTS * 4
LLMC_VERSIONS = {3: "float32", 5: "bfloat16"}  # both with the vocabulary padded
_LLMC_OTHER_MAGICS = {
    20240520: "an llm.c token shard, not a model file",
    20240801: "an llm.c token shard (uint32 tokens), not a model file",
    20240327: "an llm.c debug state file (gpt2_124M_debug_state.bin), not a model file",
    20240328: "an llm.c tokenizer file (gpt2_tokenizer.bin), not a model file",
    20240803: "an llm.c Llama 3 model file, which blujax does not read yet",
    0x04034B50: "a zip archive (PyTorch's pytorch_model.bin?): pass a folder with "
                "model.safetensors instead",
}

# GPT-2's tokenizer as tiktoken caches it: file name (sha1 of the URL) and sha256 of the bytes,
# under the names transformers' GPT2Tokenizer reads (see ../shared/data/SOURCES.md).
_GPT2_TOKENIZER = {
    "vocab.json": ("6c7ea1a7e38e3a7f062df639a5b80947f075ffe6",  # encoder.json
                   "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
    "merges.txt": ("6d1cbeee0f20b3d9449abfede4726ed8212e3aee",  # vocab.bpe
                   "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
}


class InteropError(ValueError):
    """Weights a user gave (or asked to write) that cannot be read or written as asked; the
    message (one line) names the file or name and what to do."""


@dataclasses.dataclass
class Pretrained:
    """A model read from elsewhere, in our layout.

    family: the model family ("gpt2"), a key of FAMILIES. config: its config (GPT2Config:
    block_size the source's positions, vocab_size its vocabulary, padded_vocab_size that rounded
    up to a multiple of 128). params: our params pytree of float32 numpy arrays, the padded
    vocabulary rows zero. source: where it came from, JSON-able: {"kind": "hf" | "hub" |
    "llmc", "path": the folder or file read, "name": the hub name or the file's name}.
    tokenizer: the model's own (a Hugging Face folder's tokenizer.json, or vocab.json and
    merges.txt; GPT-2's for the hub's GPT-2s and llm.c files), None where the folder has none.
    """
    family: str
    config: Any
    params: dict
    source: dict
    tokenizer: Tokenizer | None = None


# --------------------------------------------------------------------------------------------
# Import


def load_pretrained(src: str | os.PathLike) -> Pretrained:
    """The model at src: a Hugging Face folder (read_hf_dir), an llm.c model file (read_llmc),
    or else a hub name (HUB_NAMES, bare or as openai-community/NAME), downloaded through
    huggingface_hub or found in its cache. What exists on disk wins over a hub name."""
    path = Path(src).expanduser()
    if path.is_dir():
        return read_hf_dir(path)
    if path.is_file():
        if path.name == "config.json" or path.suffix == ".safetensors":
            raise InteropError(f"{path}: pass the folder that holds config.json and "
                               f"model.safetensors, not one of its files")
        return read_llmc(path)
    name = os.fspath(src)
    if name.removeprefix(HUB_ORG + "/") in HUB_NAMES:
        return _download(name)
    raise InteropError(f"{src}: no such file or folder, and not a hub name "
                       f"({', '.join(HUB_NAMES)})")


def read_hf_dir(path: str | os.PathLike) -> Pretrained:
    """A Hugging Face model folder: config.json and model.safetensors (or the shards that
    model.safetensors.index.json lists), in any of float32, float16 and bfloat16."""
    folder = Path(path)
    if not folder.is_dir():
        raise InteropError(f"{folder}: not a folder (expected one with config.json and "
                           f"model.safetensors)")
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise InteropError(f"{folder}: no config.json: not a Hugging Face model folder "
                           f"(expected config.json and model.safetensors)")
    try:
        hf = json.loads(cfg_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise InteropError(f"{cfg_path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InteropError(f"{cfg_path}: cannot read: {getattr(e, 'strerror', None) or e}") \
            from None
    if not isinstance(hf, dict):
        raise InteropError(f"{cfg_path}: not a model config (a JSON object)")
    family = hf.get("model_type")
    if family not in FAMILIES:
        raise InteropError(f"{cfg_path}: model_type {family!r} is not supported (blujax "
                           f"reads: {', '.join(FAMILIES)})")
    model = FAMILIES[family]
    try:
        config = model.config_from_hf(hf)
    except ValueError as e:
        raise InteropError(f"{cfg_path}: {e}") from None
    files = _safetensors_files(folder)
    tensors = {}
    for f in files:
        tensors.update(_read_safetensors(f))
    try:
        params = model.from_hf(tensors, config)
    except ValueError as e:
        where = files[0] if len(files) == 1 else folder
        raise InteropError(f"{where}: {e}") from None
    try:
        tokenizer = find_tokenizer(folder)
    except DataError as e:
        raise InteropError(str(e)) from None
    return Pretrained(family, config, params,
                      {"kind": "hf", "path": str(folder), "name": folder.name}, tokenizer)


def _safetensors_files(folder: Path) -> list[Path]:
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                                .values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise InteropError(f"{index}: not a safetensors index (no weight_map)") from None
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise InteropError(f"{folder / missing[0]}: missing (listed in {index.name})")
        return [folder / s for s in shards]
    if (folder / "pytorch_model.bin").is_file():
        raise InteropError(f"{folder}: has pytorch_model.bin but no model.safetensors: re-save "
                           f"it with save_pretrained(DIR, safe_serialization=True)")
    raise InteropError(f"{folder}: no model.safetensors (expected beside config.json)")


def _read_safetensors(path: Path) -> dict:
    """{name: float32 array} of a safetensors file; integer tensors (buffers) come as they are."""
    from safetensors import safe_open

    out = {}
    try:
        with safe_open(path, framework="np") as f:
            for key in f.keys():
                x = f.get_tensor(key)
                if x.dtype.kind == "f" or x.dtype.name == "bfloat16":
                    x = x.astype(np.float32, copy=False)
                out[key] = x
    except OSError as e:
        raise InteropError(f"{path}: cannot read: {e.strerror or e}") from None
    except Exception as e:  # safetensors' own SafetensorError (a bad header, a short file)
        raise InteropError(f"{path}: not a readable safetensors file: "
                           f"{_first_line(e)}") from None
    return out


def _download(name: str) -> Pretrained:
    """config.json and model.safetensors of a hub model, from huggingface_hub's cache where it
    has them (offline too), else downloaded into it."""
    import huggingface_hub
    from huggingface_hub import constants, errors

    files = ("config.json", "model.safetensors")
    # The name as given: "gpt2" redirects to openai-community/gpt2, and a cache that
    # transformers filled is under the name it was given.
    try:
        got = [huggingface_hub.hf_hub_download(name, f, local_files_only=True) for f in files]
    except (errors.LocalEntryNotFoundError, OSError):
        offline = InteropError(
            f"cannot download {name} from the Hugging Face hub (no network?): download it where "
            f"there is one (hf download {name} config.json model.safetensors --local-dir DIR) "
            f"and pass --init-from DIR")
        # Without a network huggingface_hub retries for half a minute; a failed name lookup
        # says as much at once.
        if constants.HF_HUB_OFFLINE or not _resolves(constants.ENDPOINT):
            raise offline from None
        try:
            got = [huggingface_hub.hf_hub_download(name, f) for f in files]
        except (errors.LocalEntryNotFoundError, ConnectionError, TimeoutError):
            raise offline from None
        except Exception as e:  # HTTP errors, and the HTTP client's own (a timeout mid-file)
            raise InteropError(f"cannot download {name} from the Hugging Face hub: "
                               f"{_first_line(e)}") from None
    pre = read_hf_dir(Path(got[0]).parent)
    pre.source = {"kind": "hub", "path": pre.source["path"], "name": name}
    pre.tokenizer = gpt2_tokenizer()  # the hub's GPT-2s
    return pre


def _resolves(url: str) -> bool:
    import socket
    import urllib.parse

    host = urllib.parse.urlsplit(url).hostname
    try:
        return bool(host and socket.getaddrinfo(host, 443))
    except OSError:
        return False


def read_llmc(path: str | os.PathLike) -> Pretrained:
    """An llm.c GPT-2 model file, version 3 (float32) or 5 (bfloat16): its header checked
    against the file's size; the bfloat16 values widened to float32 exactly."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(LLMC_HEADER_BYTES)
    except OSError as e:
        raise InteropError(f"{path}: cannot read: {e.strerror or e}") from None
    if size < LLMC_HEADER_BYTES:
        raise InteropError(f"{path}: {size} bytes, shorter than the {LLMC_HEADER_BYTES}-byte "
                           f"llm.c header: truncated, or not an llm.c model file")
    header = np.frombuffer(raw, dtype="<i4")
    magic, version = int(header[0]), int(header[1])
    if magic != LLMC_MAGIC:
        what = _LLMC_OTHER_MAGICS.get(magic, "not an llm.c GPT-2 model file")
        raise InteropError(f"{path}: bad magic number {magic} (expected {LLMC_MAGIC}): {what}")
    if version not in LLMC_VERSIONS:
        raise InteropError(f"{path}: llm.c model file version {version} is not supported "
                           f"(3: float32 or 5: bfloat16, as llm.c's train_gpt2.py writes today)")
    max_t, n_vocab, n_layer, n_head, n_embd, padded = (int(v) for v in header[2:8])
    try:
        file_config = gpt2.GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                                      block_size=max_t, vocab_size=n_vocab,
                                      padded_vocab_size=padded)
        config = dataclasses.replace(file_config, padded_vocab_size=vocab.padded(n_vocab))
    except ValueError as e:
        raise InteropError(f"{path}: corrupt header: {e}") from None
    dtype = np.dtype("<f4") if LLMC_VERSIONS[version] == "float32" else np.dtype("<u2")
    shapes = gpt2.llmc_shapes(file_config)
    expected = LLMC_HEADER_BYTES + dtype.itemsize * sum(math.prod(s) for s in shapes)
    if size != expected:
        what = "truncated" if size < expected else "longer than its header says"
        raise InteropError(f"{path}: {what}: {size} bytes, but its header ({n_layer} layers, "
                           f"{n_embd} channels, {LLMC_VERSIONS[version]}) implies {expected}")
    flat = np.fromfile(path, dtype=dtype, offset=LLMC_HEADER_BYTES)
    if dtype.itemsize == 2:
        # bfloat16 is the top half of a float32: widening is a shift.
        flat = (flat.astype("<u4") << 16).view("<f4")
    arrays, at = [], 0
    for shape in shapes:
        n = math.prod(shape)
        arrays.append(flat[at:at + n].reshape(shape))
        at += n
    params = gpt2.from_llmc(arrays, config)
    return Pretrained("gpt2", config, params,
                      {"kind": "llmc", "path": str(path), "name": path.name}, gpt2_tokenizer())


# --------------------------------------------------------------------------------------------
# Export


def export_hf(params, config, directory: str | os.PathLike, *,
              tokenizer: Tokenizer | bool | None = True) -> Path:
    """Writes params (ours; numpy or jax arrays) into directory so that transformers'
    AutoModelForCausalLM.from_pretrained(directory) loads them (as the family's HF_ARCHITECTURE:
    GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM) and computes our logits on the
    unpadded vocabulary: config.json and model.safetensors (float32, save_pretrained's names).

    tokenizer: the model's (blujax.data.Tokenizer): a Hugging Face tokenizer's files are copied
    alongside, and config.json names its bos and eos tokens. GPT-2's (or True, with a
    vocabulary of GPT-2's size) writes GPT-2's files (vocab.json, merges.txt,
    tokenizer_config.json, special_tokens_map.json) where tiktoken's cache holds them
    (`gpt2_tokenizer_files`); otherwise they are skipped with a log note (logger
    blujax.interop, INFO), never an error. None or False: no tokenizer files. Returns the
    directory."""
    from safetensors.numpy import save_file

    folder = Path(directory)
    if folder.exists() and not folder.is_dir():
        raise InteropError(f"{folder}: exists and is not a folder")
    model = _family_of(config)
    try:
        hf = model.hf_config(config)
        if isinstance(tokenizer, Tokenizer) and not tokenizer.is_gpt2:
            hf.update(bos_token_id=tokenizer.doc_token, eos_token_id=tokenizer.stop_tokens[0])
        tensors = model.to_hf(params, config)
    except ValueError as e:
        raise InteropError(f"cannot export to {folder}: {e}") from None
    folder.mkdir(parents=True, exist_ok=True)
    _write_atomic(folder / "config.json",
                  lambda f: f.write((json.dumps(hf, indent=2) + "\n").encode()))
    # transformers refuses a safetensors file without format "pt" in its metadata.
    tmp = _tmp_name(folder / "model.safetensors")
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        shutil.copymode(folder / "config.json", tmp)  # safetensors makes it owner-only
        os.replace(tmp, folder / "model.safetensors")
    finally:
        tmp.unlink(missing_ok=True)
    if isinstance(tokenizer, Tokenizer) and not tokenizer.is_gpt2:
        written = tokenizer.save(folder)
        log.info("%s: wrote the tokenizer of %s (%s)", folder, tokenizer.name,
                 ", ".join(written))
    elif tokenizer:
        _export_tokenizer(folder, config)
    return folder


def gpt2_tokenizer_files() -> dict[str, Path] | None:
    """GPT-2's vocab.json and merges.txt (OpenAI's encoder.json and vocab.bpe) in tiktoken's
    cache ($TIKTOKEN_CACHE_DIR, else $DATA_GYM_CACHE_DIR, else data-gym-cache in the temporary
    folder, as tiktoken looks), checked against their sha256; None where either is absent."""
    cache = (os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
             or os.path.join(tempfile.gettempdir(), "data-gym-cache"))
    found = {}
    for name, (key, sha256) in _GPT2_TOKENIZER.items():
        path = Path(cache) / key
        try:
            if hashlib.sha256(path.read_bytes()).hexdigest() != sha256:
                return None
        except OSError:
            return None
        found[name] = path
    return found


def _export_tokenizer(folder: Path, config) -> list[str]:
    if config.vocab_size != vocab.GPT2_VOCAB_SIZE:
        log.info("%s: no tokenizer files written: the vocabulary (%d) is not GPT-2's", folder,
                 config.vocab_size)
        return []
    files = gpt2_tokenizer_files()
    if files is None:
        log.info("%s: no tokenizer files written: GPT-2's are not in tiktoken's cache (set "
                 "TIKTOKEN_CACHE_DIR)", folder)
        return []
    for name, src in files.items():
        shutil.copyfile(src, folder / name)
    eot = "<|endoftext|>"
    special = {"bos_token": eot, "eos_token": eot, "unk_token": eot}
    tok_config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": config.block_size,
                  "add_prefix_space": False, "errors": "replace", **special}
    for name, content in (("tokenizer_config.json", tok_config),
                          ("special_tokens_map.json", special)):
        (folder / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    written = [*files, "tokenizer_config.json", "special_tokens_map.json"]
    log.info("%s: wrote GPT-2's tokenizer (%s)", folder, ", ".join(written))
    return written


def export_llmc(params, config, path: str | os.PathLike, *,
                dtype: str = "float32") -> Path:
    """Writes params as an llm.c model file that llm.c's train_gpt2 and read_llmc both read:
    dtype "float32" (header version 3; train_gpt2.c and train_gpt2.cu built with
    PRECISION=FP32) or "bfloat16" (version 5, rounded to nearest even; train_gpt2.cu's
    default). The embedding keeps config's padded rows. Returns the path."""
    if dtype not in LLMC_VERSIONS.values():
        raise InteropError(f"llm.c model files are float32 or bfloat16, not {dtype!r}")
    path = Path(path)
    if path.is_dir():
        raise InteropError(f"{path}: is a folder (expected a file name such as model.bin)")
    model = _family_of(config)
    if not hasattr(model, "to_llmc"):
        raise InteropError(f"cannot export to {path}: llm.c model files hold GPT-2 only")
    try:
        arrays = model.to_llmc(params, config)
    except ValueError as e:
        raise InteropError(f"cannot export to {path}: {e}") from None
    version = {v: k for k, v in LLMC_VERSIONS.items()}[dtype]
    header = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
    header[:8] = (LLMC_MAGIC, version, config.block_size, config.vocab_size, config.n_layer,
                  config.n_head, config.n_embd, config.padded_vocab_size)

    def write(f):
        f.write(header.tobytes())
        for x in arrays:
            if dtype == "bfloat16":
                x = x.astype(ml_dtypes.bfloat16)
            else:
                x = x.astype("<f4", copy=False)
            f.write(x.tobytes())

    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, write)
    return path


# --------------------------------------------------------------------------------------------
# Helpers


def _family_of(config):
    """The family module of a config: each family defines its own config class."""
    try:
        return family_of(config)
    except TypeError:
        raise InteropError(f"cannot export a {type(config).__name__}: blujax exports "
                           f"{', '.join(FAMILIES)}") from None


def _tmp_name(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def _write_atomic(path: Path, write):
    """Writes path through a temporary file, so a crash never leaves half a file there."""
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
