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

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Any

import ml_dtypes  # bfloat16 for numpy; imported, it also names it for safetensors' numpy reader
import numpy as np

from blujax import vocab
from blujax.checkpoint import fsync_dir
from blujax.data.errors import DataError
from blujax.data.tokenizer import HF_FILES, Tokenizer, find_tokenizer
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
#
# An export never lands where it would destroy what the user has: never in a blujax run folder
# (its config.json is what eval, sample and --resume read) or the run's ckpt/ and tokenizer/,
# never over a device, pipe or socket, and over files it does not write itself only when asked
# (overwrite: `export --overwrite`). It writes into a temporary beside the target, renamed into
# place at the end, so that a failed write (a full disk) leaves the target as it was. A link is
# written through: its target is replaced, the link kept. Each refusal and each failed write is
# an InteropError of one line.

# The files an export writes into a Hugging Face folder: those it may replace there.
HF_EXPORT_FILES = ("config.json", "model.safetensors", *HF_FILES)
# A blujax run folder (what `train --out` writes) has config.json with "settings", or ckpt/;
# its ckpt/ and tokenizer/ are the run's too.
_RUN_PARTS = ("ckpt", "tokenizer")
# The magic numbers of llm.c model files, which an llm.c export may replace.
_LLMC_MODEL_MAGICS = (LLMC_MAGIC, 20240803)


def export_hf(params, config, directory: str | os.PathLike, *,
              tokenizer: Tokenizer | bool | None = True, overwrite: bool = False) -> Path:
    """Writes params (ours; numpy or jax arrays) into directory so that transformers'
    AutoModelForCausalLM.from_pretrained(directory) loads them (as the family's HF_ARCHITECTURE:
    GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM) and computes our logits on the
    unpadded vocabulary: config.json and model.safetensors (float32, save_pretrained's names).

    tokenizer: the model's (blujax.data.Tokenizer): a Hugging Face tokenizer's files are copied
    alongside, and config.json names its bos and eos tokens. GPT-2's (for a vocabulary of
    GPT-2's size or larger, such as llama-8b's trained here; True: of GPT-2's size only)
    writes GPT-2's files (vocab.json, merges.txt, tokenizer_config.json,
    special_tokens_map.json) where tiktoken's cache holds them (`gpt2_tokenizer_files`);
    otherwise they are skipped with a log note (logger blujax.interop, INFO), never an error.
    None or False: no tokenizer files.

    directory: a new folder, or one holding an earlier export, which this one replaces (the
    export's files, HF_EXPORT_FILES, that it does not write again are removed). A folder that
    holds other files too only with overwrite, and those are kept; a blujax run folder (or its
    ckpt/, tokenizer/) never. Nothing in directory changes until every file is written: they
    are written into a temporary folder beside it, then moved in. Returns the directory."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    folder = Path(directory)
    target = _hf_target(folder, overwrite)
    model = _family_of(config)
    try:
        hf = model.hf_config(config)
        if isinstance(tokenizer, Tokenizer) and not tokenizer.is_gpt2:
            hf.update(bos_token_id=tokenizer.doc_token, eos_token_id=tokenizer.stop_tokens[0])
        elif _gpt2_beyond(tokenizer, config):
            hf.update(vocab.special_tokens(vocab.GPT2_VOCAB_SIZE))
        tensors = model.to_hf(params, config)
    except ValueError as e:
        raise InteropError(f"cannot export to {folder}: {e}") from None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = _temp_sibling(target, "tmp")
        os.mkdir(tmp)
        try:
            (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n", encoding="utf-8")
            try:
                # transformers refuses a safetensors file without format "pt" in its metadata.
                save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            except SafetensorError as e:  # a write that failed (disk full) among them
                raise _os_error(e) from None
            shutil.copymode(tmp / "config.json", tmp / "model.safetensors")  # was owner-only
            if isinstance(tokenizer, Tokenizer) and not tokenizer.is_gpt2:
                written = tokenizer.save(tmp)
                log.info("%s: wrote the tokenizer of %s (%s)", folder, tokenizer.name,
                         ", ".join(written))
            elif tokenizer:
                _export_tokenizer(tmp, config, folder, _gpt2_beyond(tokenizer, config))
            _commit_folder(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        raise InteropError(f"cannot write {folder}: {_why(e, target)}") from None
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


def _gpt2_beyond(tokenizer, config) -> bool:
    """Whether the model speaks GPT-2's tokenizer (given as the model's) in a vocabulary larger
    than GPT-2's: a preset of a pretrained model's vocabulary trained here from scratch
    (llama-8b's 128256), whose export needs GPT-2's files and end-of-text all the same."""
    return (isinstance(tokenizer, Tokenizer) and tokenizer.is_gpt2
            and config.vocab_size > vocab.GPT2_VOCAB_SIZE)


def _export_tokenizer(into: Path, config, folder: Path, beyond: bool = False) -> list[str]:
    """GPT-2's tokenizer files into `into`, on their way to `folder` (named in the log): for
    GPT-2's vocabulary, or (beyond: _gpt2_beyond) a larger one that the model's GPT-2
    tokenizer fills the start of."""
    if config.vocab_size != vocab.GPT2_VOCAB_SIZE and not beyond:
        log.info("%s: no tokenizer files written: the vocabulary (%d) is not GPT-2's", folder,
                 config.vocab_size)
        return []
    files = gpt2_tokenizer_files()
    if files is None:
        log.info("%s: no tokenizer files written: GPT-2's are not in tiktoken's cache (set "
                 "TIKTOKEN_CACHE_DIR)", folder)
        return []
    for name, src in files.items():
        shutil.copyfile(src, into / name)
    eot = "<|endoftext|>"
    special = {"bos_token": eot, "eos_token": eot, "unk_token": eot}
    tok_config = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": config.block_size,
                  "add_prefix_space": False, "errors": "replace", **special}
    for name, content in (("tokenizer_config.json", tok_config),
                          ("special_tokens_map.json", special)):
        (into / name).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    written = [*files, "tokenizer_config.json", "special_tokens_map.json"]
    log.info("%s: wrote GPT-2's tokenizer (%s)", folder, ", ".join(written))
    return written


def export_llmc(params, config, path: str | os.PathLike, *,
                dtype: str = "float32", overwrite: bool = False) -> Path:
    """Writes params as an llm.c model file that llm.c's train_gpt2 and read_llmc both read:
    dtype "float32" (header version 3; train_gpt2.c and train_gpt2.cu built with
    PRECISION=FP32) or "bfloat16" (version 5, rounded to nearest even; train_gpt2.cu's
    default). The embedding keeps config's padded rows. path: a new file or an llm.c model file,
    which it replaces; another file only with overwrite, and never one of a blujax run's;
    never a folder, device, pipe or socket. It is written whole or not at all (a temporary
    file beside it, renamed over it). Returns the path."""
    if dtype not in LLMC_VERSIONS.values():
        raise InteropError(f"llm.c model files are float32 or bfloat16, not {dtype!r}")
    path = Path(path)
    target = _llmc_target(path, overwrite)
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

    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _write_atomic(target, write)
    except OSError as e:
        raise InteropError(f"cannot write {path}: {_why(e, target)}") from None
    return path


# --------------------------------------------------------------------------------------------
# Export targets: what may be written, and writing it whole


def _hf_target(folder: Path, overwrite: bool) -> Path:
    """Where export_hf writes `folder` (links resolved), once it is known to be nothing yet or
    a folder that is no run's, holding an export's files only (or overwrite)."""
    target = Path(os.path.realpath(folder))
    st = _stat(target, folder)
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise InteropError(f"{folder}: exists and is not a folder (a {_kind(st.st_mode)})")
    if target == target.parent:
        raise InteropError(f"{folder}: the root folder cannot hold an export; name a folder")
    run = _run_of(target)
    if run is not None and run[1] is None:
        raise InteropError(
            f"{folder}: is a blujax run folder ({_run_markers(target)}); an export there would "
            f"replace the run's config.json, so it is refused even with --overwrite; export "
            f"into a folder of its own, e.g. {folder / 'hf'}")
    if run is not None:
        shown = _shown(run[0], folder, target)
        raise InteropError(
            f"{folder}: lies in {run[1]}/ of the blujax run {shown}, which the run needs; "
            f"refused even with --overwrite; export into a folder of its own, e.g. "
            f"{shown / 'hf'}")
    if st is None or overwrite:
        return target
    try:
        foreign = _foreign_files(target)
    except OSError as e:
        raise InteropError(f"cannot write {folder}: {_why(e, target)}") from None
    if foreign:
        names = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3
                                          else "")
        raise InteropError(
            f"{folder}: holds files an export does not write ({names}); --overwrite exports "
            f"into it anyway, keeping them (only an export's own files are replaced), or "
            f"choose a new folder")
    return target


def _llmc_target(path: Path, overwrite: bool) -> Path:
    """Where export_llmc writes `path` (links resolved), once it is known to be nothing yet, an
    empty file or an llm.c model file, or (overwrite) another file that is no run's."""
    target = Path(os.path.realpath(path))
    st = _stat(target, path)
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise InteropError(f"{path}: is a folder (expected a file name such as model.bin)")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise InteropError(f"{path}: is a {_kind(st.st_mode)}, not a regular file; an llm.c "
                           f"model file is written as a file of its own, e.g. model.bin")
    run = _run_of(target.parent)
    if run is not None and run[1] is not None:
        shown = _shown(run[0], path.parent, target.parent)
        raise InteropError(f"{path}: lies in {run[1]}/ of the blujax run {shown}, which the "
                           f"run needs; refused even with --overwrite; export to a file of "
                           f"its own, e.g. {shown / 'model.bin'}")
    if st is None or st.st_size == 0 or _magic(target) in _LLMC_MODEL_MAGICS:
        return target
    if run is not None:
        shown = _shown(run[0], path.parent, target.parent)
        raise InteropError(f"{path}: is a file of the blujax run {shown}, not an llm.c model "
                           f"file; refused even with --overwrite; export to a file of its "
                           f"own, e.g. {shown / 'model.bin'}")
    if not overwrite:
        raise InteropError(f"{path}: exists and is not an llm.c model file; --overwrite "
                           f"replaces it, or choose a new file name")
    return target


def _stat(target: Path, given: Path) -> os.stat_result | None:
    try:
        return os.stat(target)
    except FileNotFoundError:
        return None
    except OSError as e:  # a link loop, a folder we may not enter
        raise InteropError(f"cannot write {given}: {e.strerror or e}") from None


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "file"), (stat.S_ISDIR, "folder"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
                       (stat.S_ISFIFO, "named pipe"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def _magic(path: Path) -> int | None:
    """The first int32 of a regular file, None where it has fewer than 4 bytes."""
    try:
        with open(path, "rb") as f:
            raw = f.read(4)
    except OSError:
        return None
    return int(np.frombuffer(raw, "<i4")[0]) if len(raw) == 4 else None


def _json_object(path: Path) -> dict:
    """The JSON object in the regular file path; {} where there is none."""
    try:
        if not path.is_file() or path.stat().st_size > 1 << 20:
            return {}
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _is_run(folder: Path) -> bool:
    return (folder / "ckpt").is_dir() or "settings" in _json_object(folder / "config.json")


def _run_markers(folder: Path) -> str:
    marks = ["config.json with the run's settings"] \
        if "settings" in _json_object(folder / "config.json") else []
    return ", ".join(marks + ["ckpt/"] * (folder / "ckpt").is_dir())


def _run_of(path: Path) -> tuple[Path, str | None] | None:
    """(the run folder, None) where path is a blujax run folder; (it, "ckpt" or "tokenizer")
    where path is or lies in that part of one; else None."""
    try:
        if _is_run(path):
            return path, None
        for part in (path, *path.parents):
            if part.name in _RUN_PARTS and _is_run(part.parent):
                return part.parent, part.name
    except OSError:
        pass  # what cannot be looked at is written, or its write fails, as it will
    return None


def _shown(run: Path, given: Path, resolved: Path) -> Path:
    """The run folder as the user named it: `given`'s ancestor where its links allow."""
    up = len(resolved.relative_to(run).parts)
    shown = ([given, *given.parents][up] if up <= len(given.parents) else None)
    return shown if shown is not None and os.path.realpath(shown) == str(run) else run


def _foreign_files(folder: Path) -> list[str]:
    """The names in folder that are not an earlier export's files (a config.json without a
    model_type is not a Hugging Face config); folders end in "/"."""
    foreign = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name in HF_EXPORT_FILES and entry.is_file() and (
                entry.name != "config.json" or "model_type" in _json_object(Path(entry.path))):
            continue
        foreign.append(entry.name + "/" * entry.is_dir())
    return foreign


def _temp_sibling(path: Path, kind: str) -> Path:
    """A new hidden name beside path: the same folder, so renames from it are atomic."""
    return path.with_name(f".{path.name}.{os.urandom(4).hex()}.{kind}")


def _write_atomic(path: Path, write):
    """Writes the file path (links resolved) through a new temporary file beside it, fsynced
    and renamed over it: a crash or a failed write leaves path as it was, and no temporary. It
    keeps the mode of the file it replaces."""
    tmp = _temp_sibling(path, "tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            try:
                os.fchmod(f.fileno(), stat.S_IMODE(os.stat(path).st_mode))
            except FileNotFoundError:
                pass
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def _commit_folder(tmp: Path, target: Path):
    """Moves the written folder tmp into place at target: renamed, where target is new; else
    its files renamed into target, the export's files already there set aside first and put
    back should a rename fail, removed once all are in. Other files in target stay."""
    for path in tmp.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    if not os.path.lexists(target):
        os.rename(tmp, target)
        fsync_dir(target.parent)
        return
    old = [name for name in HF_EXPORT_FILES if os.path.lexists(target / name)]
    aside = _temp_sibling(target, "old")
    os.mkdir(aside)
    moved, placed = [], []
    try:
        for name in old:
            os.rename(target / name, aside / name)
            moved.append(name)
        for path in sorted(tmp.iterdir()):
            os.rename(path, target / path.name)
            placed.append(path.name)
    except OSError:
        for name in placed:
            if name not in moved:
                with contextlib.suppress(OSError):
                    os.unlink(target / name)
        for name in moved:
            with contextlib.suppress(OSError):
                os.rename(aside / name, target / name)
        with contextlib.suppress(OSError):
            os.rmdir(aside)  # kept, should an old file not have gone back
        raise
    shutil.rmtree(aside, ignore_errors=True)
    fsync_dir(target)


def _os_error(e: Exception) -> OSError:
    """safetensors' error of a failed write as the OSError it wraps ("... (os error 28)")."""
    found = re.search(r"os error (\d+)", str(e))
    if found:
        code = int(found.group(1))
        return OSError(code, os.strerror(code))
    return OSError(_first_line(e))


def _why(e: OSError, target: Path) -> str:
    """An OSError of writing target in words, naming the file where it is not one written."""
    why = e.strerror or _first_line(e)
    if not e.filename:
        return why
    name = Path(os.fsdecode(e.filename))
    ours = any(p == target or p.name.startswith(f".{target.name}.") for p in
               (name, *name.parents))
    return why if ours else f"{name}: {why}"


# --------------------------------------------------------------------------------------------
# Helpers


def _family_of(config):
    """The family module of a config: each family defines its own config class."""
    try:
        return family_of(config)
    except TypeError:
        raise InteropError(f"cannot export a {type(config).__name__}: blujax exports "
                           f"{', '.join(FAMILIES)}") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]
