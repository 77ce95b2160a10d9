"""What a data spec (the command line's --data) names: the shards a run trains and validates
on, and the tokens an evaluation reads.

    source = resolve("notes.txt", tokenizer=tok)  # DataSource: .train, .val, .tokenizer
    tokens, what = eval_tokens("data/", tokenizer=tok)  # [N], as evaluate.EVAL_DEFINITION reads

A spec is a text file, a directory or glob of llm.c shards, or one shard file (locate); for
training also None, the default corpus (blujax.data.corpus). Shards split into train and val
by name (llm.c's NAME_train_000001.bin, NAME_val_000000.bin). A run trains on a text file's
shards (tokenized once into a cache, corpus.tokenize_text), and an evaluation reads its whole
text; one shard trains (with its _val_ twin beside it, if any, for validation) or is evaluated
whole. Text is tokenized with the model's tokenizer (None: GPT-2's); shards made by another
tokenizer than the model's (provenance.check_tokenizer) are refused. Problems the user can fix
raise a DataError (ShardError, TextError) naming the spec or the file.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import sys
from pathlib import Path

import numpy as np

from blujax.data import corpus
from blujax.data.errors import DataError, ShardError, TextError
from blujax.data.loader import DataLoader
from blujax.data.provenance import check_tokenizer, recorded_tokenizer
from blujax.data.shards import TOKEN_DTYPE, Shard, in_split, read_header, token_dtype
from blujax.data.text import decode_text
from blujax.data.tokenizer import Tokenizer, gpt2
from blujax.vocab import GPT2_VOCAB_SIZE

TEXT, SHARDS, SHARD = "text", "shards", "shard"


@dataclasses.dataclass(frozen=True)
class DataSource:
    """The token shards of a run."""

    description: str        # what the spec named, in words
    train: list[Path]
    val: list[Path]         # may be empty: no validation loss then
    # The identity of the tokenizer that made them (provenance.recorded_tokenizer): a dict
    # of name, fingerprint, vocab_size; None where unknown (llm.c's uint32 shards).
    tokenizer: dict | None = None


def locate(spec) -> tuple[str, list[Path]]:
    """What a spec names: (SHARDS, the .bin files of a directory or glob, sorted), (SHARD,
    [one .bin file]) or (TEXT, [a text file])."""
    spec = str(spec)
    if any(c in spec for c in "*?[") and not os.path.exists(spec):
        paths = sorted(Path(p) for p in glob.glob(spec))
        if not paths:
            raise DataError(f"{spec}: the pattern matches no files")
        not_shards = [p for p in paths if p.suffix != ".bin"]
        if not_shards:
            raise DataError(f"{spec}: a pattern must name llm.c .bin token shards, but it "
                            f"matches {not_shards[0]}; pass one text file instead")
        return SHARDS, paths
    path = Path(spec)
    if path.is_dir():
        paths = sorted(path.glob("*.bin"))
        if not paths:
            raise DataError(f"{spec}: the directory holds no .bin token shards")
        _check_prepared(path, paths, spec)
        return SHARDS, paths
    if not path.exists():
        raise DataError(f"{spec}: no such file or directory")
    return (SHARD if path.suffix == ".bin" else TEXT), [path]


def resolve(spec, *, tokenizer: Tokenizer | None = None, progress: bool = False) -> DataSource:
    """The shards a run trains and validates on; spec None: the default corpus. Text is
    tokenized with `tokenizer` (None: GPT-2's); with a tokenizer, shards another one made
    raise a DataError. Every shard's header is read now, so that a bad file is reported
    before anything compiles."""
    if spec is None:
        train, val = corpus.default_corpus_shards(progress=progress, tokenizer=tokenizer)
        return _recorded(DataSource(f"the default corpus ({corpus.CORPUS_NAME})", train, val))
    kind, paths = locate(spec)
    if kind == TEXT:
        train, val = corpus.tokenize_text(paths[0], progress=progress, tokenizer=tokenizer)
        return _recorded(DataSource(f"text file {paths[0]}", train, val))
    if kind == SHARD:
        path = paths[0]
        twin = path.with_name(path.name.replace("train", "val"))
        val = [twin] if "train" in path.name and twin.is_file() else []
        source = DataSource(f"token shard {path}", [path], val)
    else:
        train, val = _split(paths)
        if not train:
            if val:
                raise DataError(f"{spec}: only validation shards ({val[0].name} ...), no "
                                f"shard has 'train' in its name")
            train = paths  # named neither way: all of them train
        source = DataSource(f"token shards {spec}", train, val)
    for p in source.train + source.val:
        read_header(p)  # ShardError names the file and the problem
    source = _recorded(source)
    if tokenizer is not None:
        check_tokenizer(source, tokenizer, spec)
    return source


def eval_tokens(spec, *, tokenizer: Tokenizer | None = None,
                progress: bool = False) -> tuple[np.ndarray, str]:
    """The evaluation tokens [N] of what `spec` names, and a description of them: a text
    file's whole text (the tokenizer's encode, None: GPT-2's; no document token added), the
    validation split of a directory or glob of shards, all tokens of one shard. uint16, or
    uint32 for a vocabulary beyond 65,536 tokens (or from uint32 shards). With a tokenizer,
    shards another one made raise a DataError."""
    kind, paths = locate(spec)
    if kind == TEXT:
        return _text_tokens(paths[0], progress, tokenizer), f"text file {paths[0]}"
    if kind == SHARD:
        tokens = _read_shards(paths, progress, tokenizer, spec)
        return tokens, f"token shard {paths[0]} (all {tokens.size:,} tokens)"
    _, val = _split(paths)
    if not val:
        raise DataError(f"{spec}: no validation shards (none of the {len(paths)} .bin files "
                        f"has 'val' in its name, as in NAME_val_000000.bin); pass one .bin "
                        f"shard to evaluate all of its tokens")
    tokens = _read_shards(val, progress, tokenizer, spec)
    what = val[0].name if len(val) == 1 else f"{len(val)} shards {val[0].name} ..."
    return tokens, f"the validation split of {spec} ({what}, {tokens.size:,} tokens)"


def val_batches(paths: list[Path], *, batch: int, seq: int, max_batches: int | None = None,
                rows_multiple: int = 1,
                vocab_size: int = GPT2_VOCAB_SIZE) -> list[tuple[np.ndarray, np.ndarray]]:
    """The first max_batches (all if None) (inputs, targets) int32 batches of validation
    shards, in order, as the training loader reads them unshuffled: `batch` rows of `seq`
    tokens, or fewer where the split is too small for a full batch (a multiple of
    rows_multiple, the data-parallel size, so that they split over it); none without shards
    or when not even rows_multiple rows fit."""
    if not paths:
        return []
    rows = min(batch, (max(read_header(p) for p in paths) - 1) // seq)
    rows -= rows % rows_multiple
    if rows < 1:
        return []
    with DataLoader(paths, None, batch_size=rows, seq_len=seq, shuffle=False,
                    process_index=0, process_count=1, vocab_size=vocab_size) as loader:
        n = loader.batches_per_epoch
        # Its batches are new arrays, the caller's to keep (see DataLoader).
        return [tuple(next(loader))
                for _ in range(n if max_batches is None else min(n, max_batches))]


def _recorded(source: DataSource) -> DataSource:
    return dataclasses.replace(source, tokenizer=recorded_tokenizer(source.train + source.val))


def _split(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    return [p for p in paths if in_split(p, "train")], [p for p in paths if in_split(p, "val")]


def _check_prepared(folder: Path, paths: list[Path], spec: str):
    """`python -m blujax.data prepare` records its progress in NAME.prepare.json beside the
    shards: one that stopped before the end (interrupted; it resumes when run again) left
    shards that look like a whole data set but are not."""
    for record in folder.glob("*.prepare.json"):
        name = record.name[:-len(".prepare.json")]
        shard_name = re.compile(rf"{re.escape(name)}_(train|val)_\d{{6}}\.bin")
        if not any(shard_name.fullmatch(p.name) for p in paths):
            continue
        try:
            shards = json.loads(record.read_text()).get("shards") or [{}]
            finished = bool(shards[-1].get("last"))
        except (OSError, ValueError, AttributeError):
            continue  # not ours to judge
        if not finished:
            raise DataError(f"{spec}: the shards of {name} are incomplete: python -m "
                            f"blujax.data prepare stopped before the end ({record.name}); "
                            f"run it again to finish them")


def _read_shards(paths: list[Path], progress: bool, tokenizer: Tokenizer | None,
                 spec) -> np.ndarray:
    """The shards' tokens, concatenated in order, checked against the vocabulary of the
    tokenizer (which must be the one that made them), else of the one recorded; shards of an
    unknown tokenizer are checked by the evaluation, against the model's."""
    for p in paths:
        read_header(p)  # ShardError names the file and the problem
    if tokenizer is not None:
        check_tokenizer(paths, tokenizer, spec)
        vocab = tokenizer.vocab_size
    else:
        vocab = (recorded_tokenizer(paths) or {}).get("vocab_size")
    from tqdm import tqdm
    parts = []
    for p in tqdm(paths, desc="reading shards", unit="shard", file=sys.stderr,
                  disable=not progress or len(paths) < 2):
        with Shard(p, vocab, check_tokens=vocab is not None) as shard:
            parts.append(np.array(shard.tokens))  # a copy: the mapping closes here
    tokens = np.concatenate(parts) if parts else np.zeros(0, TOKEN_DTYPE)
    if not tokens.size:
        raise ShardError(f"{paths[0] if len(paths) == 1 else paths[0].parent}: the "
                         f"shards hold no tokens: nothing to evaluate")
    return tokens


def _text_tokens(path: Path, progress: bool, tokenizer: Tokenizer | None) -> np.ndarray:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise TextError(f"{path}: cannot read: {e.strerror or e}") from None
    text = decode_text(raw, path)  # TextError with the first bad byte's offset
    del raw
    if progress:
        print(f"tokenizing {path} ({len(text):,} characters)", file=sys.stderr)
    tok = gpt2() if tokenizer is None else tokenizer  # gpt2(): a DataError offline
    tokens = np.asarray(tok.encode(text), token_dtype(tok.vocab_size))
    if not tokens.size:
        raise TextError(f"{path}: the file is empty: there is no text in it")
    return tokens
