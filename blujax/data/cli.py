"""The command line, `python -m blujax.data prepare | check`: a thin shell over prepare() and
Shard."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from blujax.data.errors import DataError
from blujax.data.provenance import SIDECAR, recorded_tokenizer
from blujax.data.shards import Shard, format_name
from blujax.data.tokenizer import GPT2, describe
from blujax.data.tokenizing import DEFAULT_SHARD_TOKENS, prepare


def _count(text: str) -> int:
    """100M, 1.5G, 32768, 1e6 -> an int."""
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}.get(text[-1:].lower())
    try:
        value = float(text[:-1]) * scale if scale else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count: {text!r}") from None
    if value != int(value):
        raise argparse.ArgumentTypeError(f"not a whole count: {text!r}")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    import blujax.data  # its docstring is the command's description
    parser = argparse.ArgumentParser(prog="python -m blujax.data",
                                     description=blujax.data.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser(
        "prepare", help="tokenize text / JSON-lines files into shards",
        description="Tokenizes text files (UTF-8; each one document) and JSON-lines files (one "
                    "document per line) with a tokenizer (GPT-2's, or a model folder's) into "
                    "llm.c shards NAME_val_000000.bin, NAME_train_000001.bin, ... (uint16 "
                    "tokens, or uint32 for a vocabulary beyond 65,536), and records the "
                    f"tokenizer in {SIDECAR} beside them. The validation split is "
                    "the first tokens: --val-tokens of them, by default one shard's worth but "
                    "at most a tenth of the corpus (a small corpus keeps nine tenths for "
                    "training). A re-run keeps the complete shards and goes on after them.")
    p.add_argument("inputs", nargs="+", type=Path,
                   help="text files (one document each) and .jsonl files (one per line)")
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--name", help="shard name prefix (default: the first input's name)")
    p.add_argument("--shard-tokens", type=_count, default=DEFAULT_SHARD_TOKENS,
                   help="tokens per shard (default 100M)")
    p.add_argument("--val-tokens", type=_count, default=None,
                   help="tokens of the validation split, taken first (default: one shard, "
                        "but at most a tenth of the corpus)")
    p.add_argument("--workers", type=int, default=None,
                   help="tokenizing processes (default: all CPUs)")
    p.add_argument("--paragraph-docs", action="store_true",
                   help="each blank-line-separated paragraph of a text file is a document "
                        "(llm.c's tinyshakespeare convention)")
    p.add_argument("--text-field", default="text", help="JSON field with the text")
    p.add_argument("--tokenizer", default=GPT2,
                   help="gpt2 (tiktoken's GPT-2 encoding, the default), or a model folder "
                        "with its tokenizer.json (a Hugging Face model's, or a run folder's "
                        "tokenizer/): the tokenizer of the model that will train on the shards")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    c = commands.add_parser("check", help="validate shards: header, size, token range")
    c.add_argument("shards", nargs="+", type=Path)
    c.add_argument("--vocab-size", type=int, default=None,
                   help=f"token ids must be below it (default: the vocabulary of the tokenizer "
                        f"that made the shards: their folder's {SIDECAR}, else GPT-2's for "
                        f"uint16 shards)")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run_command(args)
    except (DataError, ValueError, OSError, RuntimeError) as e:  # bad input, said plainly
        print(f"error: {e}", file=sys.stderr)
        return 2


def _run_command(args) -> int:
    if args.command == "prepare":
        result = prepare(args.inputs, args.out, name=args.name, shard_tokens=args.shard_tokens,
                         val_tokens=args.val_tokens, workers=args.workers,
                         doc_separator="\n\n" if args.paragraph_docs else None,
                         text_field=args.text_field, tokenizer=args.tokenizer,
                         progress=not args.no_progress)
        print(f"{len(result.files)} shards in {args.out} ({len(result.written)} written, "
              f"{len(result.skipped)} already complete); tokens: "
              + ", ".join(f"{k} {v:,}" for k, v in sorted(result.tokens.items())))
        return 0
    failed = 0
    for path in args.shards:
        try:
            recorded = recorded_tokenizer([path])
            vocab = args.vocab_size or (recorded or {}).get("vocab_size")
            with Shard(path, vocab, check_tokens=vocab is not None) as shard:
                unchecked = "" if vocab else " (ids unchecked: pass --vocab-size)"
                print(f"{path}: ok, {shard.num_tokens:,} tokens{unchecked}; "
                      f"{format_name(shard.dtype)}; made by {describe(recorded)}")
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            failed += 1
    return 1 if failed else 0
