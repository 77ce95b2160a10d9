"""Token data: llm.c-format shards, the tokenizer that fills them, and the training loader.

A shard is a header of 256 little-endian int32 (magic, version, token count, zeros) followed by
that many tokens: magic 20240520, version 1 and uint16 tokens (llm.c's GPT-2 shards, so
FineWeb/FineWeb-Edu shards published for llm.c load unchanged), or magic 20240801, version 7
and uint32 tokens (llm.c's Llama 3 shards), which prepare writes for a vocabulary beyond
65,536 tokens. prepare records the tokenizer that made a folder's shards in a sidecar file,
blujax-tokenizer.json, and shards are refused for a model of another tokenizer; shards without
one are GPT-2's when uint16, unknown when uint32.

    python -m blujax.data prepare corpus.jsonl more.txt --out data/ [--shard-tokens 100M]
                                  [--tokenizer gpt2 | path/to/Llama-3.2-1B]
    python -m blujax.data check data/*.bin

    loader = DataLoader("data/", "train", batch_size=64, seq_len=1024, seed=0)
    loader.check_all()                    # every shard's tokens, before the first step
    inputs, targets = next(loader)        # int32 [64 // process_count, 1024]
    state = loader.state()                # JSON-able; loader.load_state(state) resumes after it

    tok = load_tokenizer("gpt2")          # or a model folder with its tokenizer.json
    source = resolve("notes.txt", tokenizer=tok)   # what a --data spec names: .train, .val
    tokens, what = eval_tokens("data/", tokenizer=tok)  # the tokens an evaluation reads

Offline, tiktoken reads its GPT-2 files from the folder named by TIKTOKEN_CACHE_DIR. Data a
user can fix (a bad shard, text that is not UTF-8) raises a DataError with a one-line message.
"""

# The package's API, from the modules that hold it: errors.py (the errors of user data),
# shards.py (llm.c's shard formats), tokenizer.py (a model's tokenizer), provenance.py (which
# tokenizer made a folder of shards), loader.py (the training loader), text.py (tiktoken and
# text/JSON-lines documents), tokenizing.py (prepare: documents into shards, resumably),
# sources.py (what a data spec names), corpus.py (text tokenized once and cached; the default
# corpus) and cli.py (the command line).
from blujax.data.errors import DataError, ShardError, TextError
from blujax.data.shards import (GPT2_VOCAB_SIZE, HEADER_BYTES, HEADER_INTS, MAGIC, TOKEN_DTYPE,
                                VERSION, WIDE_MAGIC, WIDE_TOKEN_DTYPE, WIDE_VERSION, Shard,
                                find_shards, in_split, read_format, read_header, token_dtype,
                                write_shard)
from blujax.data.tokenizer import Tokenizer, load_tokenizer
from blujax.data.provenance import (GPT2_IDENTITY, SIDECAR, check_tokenizer, record_tokenizer,
                                    recorded_tokenizer)
from blujax.data.loader import Batch, DataLoader, rank_slice
from blujax.data.text import decode_text, get_encoding
from blujax.data.tokenizing import (DEFAULT_SHARD_TOKENS, DEFAULT_VAL_FRACTION, PrepareResult,
                                    default_val_tokens, prepare)
from blujax.data.sources import DataSource, eval_tokens, locate, resolve, val_batches
from blujax.data.cli import main

__all__ = [
    "DataError", "ShardError", "TextError",
    "GPT2_VOCAB_SIZE", "HEADER_BYTES", "HEADER_INTS", "MAGIC", "TOKEN_DTYPE", "VERSION",
    "WIDE_MAGIC", "WIDE_TOKEN_DTYPE", "WIDE_VERSION",
    "Shard", "find_shards", "in_split", "read_format", "read_header", "token_dtype",
    "write_shard",
    "Tokenizer", "load_tokenizer",
    "GPT2_IDENTITY", "SIDECAR", "check_tokenizer", "record_tokenizer", "recorded_tokenizer",
    "Batch", "DataLoader", "rank_slice",
    "decode_text", "get_encoding",
    "DEFAULT_SHARD_TOKENS", "DEFAULT_VAL_FRACTION", "PrepareResult", "default_val_tokens",
    "prepare",
    "DataSource", "eval_tokens", "locate", "resolve", "val_batches",
    "main",
]
