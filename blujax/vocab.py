"""GPT-2's vocabulary, which the data layer stores and every model trained from scratch speaks,
and the padding of a vocabulary for the LM head: the constants in one place.

The models pad their embedding rows (and the head's columns) to a multiple of 128 so that the
head's matrix product tiles evenly (50257 -> 50304, as llm.c does); the padded rows start at
zero and no loss reaches them.
"""

from __future__ import annotations

GPT2_VOCAB_SIZE = 50257   # tiktoken's "gpt2" encoding
GPT2_EOT = 50256          # its <|endoftext|>, which separates documents
PAD_MULTIPLE = 128
GPT2_PADDED_VOCAB_SIZE = 50304


def padded(vocab_size: int, multiple: int = PAD_MULTIPLE) -> int:
    """vocab_size rounded up to a multiple of `multiple` (50257 -> 50304)."""
    return -(-vocab_size // multiple) * multiple


def special_tokens(vocab_size: int) -> dict:
    """The bos/eos token ids a Hugging Face config.json gives a model of this vocabulary:
    GPT-2's end-of-text for GPT-2's vocabulary, none otherwise."""
    eot = GPT2_EOT if vocab_size == GPT2_VOCAB_SIZE else None
    return {"bos_token_id": eot, "eos_token_id": eot}


assert padded(GPT2_VOCAB_SIZE) == GPT2_PADDED_VOCAB_SIZE
