"""Token data: llm.c-format shards, the GPT-2 tokenizer that fills them, and the training loader.

A shard is a header of 256 little-endian int32 (magic 20240520, version 1, token count, zeros)
followed by that many uint16 GPT-2 tokens, so FineWeb/FineWeb-Edu shards published for llm.c
load unchanged.

    python -m blujax.data prepare corpus.jsonl more.txt --out data/ [--shard-tokens 100M]
    python -m blujax.data check data/*.bin

    loader = DataLoader("data/", "train", batch_size=64, seq_len=1024, seed=0)
    loader.check_all()                    # every shard's tokens, before the first step
    inputs, targets = next(loader)        # int32 [64 // process_count, 1024]
    state = loader.state()                # JSON-able; loader.load_state(state) resumes after it

    source = resolve("notes.txt")         # what a --data spec names: .train, .val shards
    tokens, what = eval_tokens("data/")   # the tokens an evaluation reads

Offline, tiktoken reads its GPT-2 files from the folder named by TIKTOKEN_CACHE_DIR. Data a
user can fix (a bad shard, text that is not UTF-8) raises a DataError with a one-line message.
"""

# The package's API, from the modules that hold it: errors.py (the errors of user data),
# shards.py (the llm.c shard format), loader.py (the training loader), text.py (tiktoken and
# text/JSON-lines documents), tokenizing.py (prepare: documents into shards, resumably),
# sources.py (what a data spec names), corpus.py (text tokenized once and cached; the default
# corpus) and cli.py (the command line).
from blujax.data.errors import DataError, ShardError, TextError
from blujax.data.shards import (GPT2_VOCAB_SIZE, HEADER_BYTES, HEADER_INTS, MAGIC, TOKEN_DTYPE,
                                VERSION, Shard, find_shards, in_split, read_header,
                                write_shard)
from blujax.data.loader import Batch, DataLoader, rank_slice
from blujax.data.text import decode_text, get_encoding
from blujax.data.tokenizing import (DEFAULT_SHARD_TOKENS, DEFAULT_VAL_FRACTION, PrepareResult,
                                    default_val_tokens, prepare)
from blujax.data.sources import DataSource, eval_tokens, locate, resolve, val_batches
from blujax.data.cli import main

__all__ = [
    "DataError", "ShardError", "TextError",
    "GPT2_VOCAB_SIZE", "HEADER_BYTES", "HEADER_INTS", "MAGIC", "TOKEN_DTYPE", "VERSION",
    "Shard", "find_shards", "in_split", "read_header", "write_shard",
    "Batch", "DataLoader", "rank_slice",
    "decode_text", "get_encoding",
    "DEFAULT_SHARD_TOKENS", "DEFAULT_VAL_FRACTION", "PrepareResult", "default_val_tokens",
    "prepare",
    "DataSource", "eval_tokens", "locate", "resolve", "val_batches",
    "main",
]
