"""Text generation from a model's params pytree (any family): jitted, with a KV cache, temperature and top-k.

    tokens = generate(params, prompt, config=config, key=jax.random.key(0), max_new_tokens=64,
                      temperature=0.8, top_k=200, ops=blujax.kernels)

The prompt runs through the model once (on `ops`, our attention kernel included) and leaves
each layer's keys and values in a cache of the final length; every new token then costs one
position's work, attending to the cache. `use_cache=False` recomputes the whole sequence for
every token instead: slower, the reference the cached path is tested against. Both draw token i
with `fold_in(key, i)`, so for one key they sample the same text.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from blujax.model import family_of


def generate(params, prompt, *, config, key, max_new_tokens: int,
             temperature: float = 1.0, top_k: int | None = None, ops, dtype=jnp.float32,
             use_cache: bool = True):
    """The prompt [B, P] (int) followed by max_new_tokens sampled tokens: [B, P + new].

    temperature 0 picks the most likely token; top_k keeps only the k most likely. Tokens are
    drawn from the real vocabulary (never a padding id). P + max_new_tokens must fit the
    model's block_size.
    """
    prompt = jnp.asarray(prompt)
    family_of(config).check_tokens(prompt, config)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    total = prompt.shape[1] + max_new_tokens
    if total > config.block_size:
        n = prompt.shape[1]
        raise ValueError(f"generate: prompt ({n} token{'s' * (n != 1)}) + max_new_tokens "
                         f"({max_new_tokens}) = {total} exceeds the model's block_size "
                         f"({config.block_size})")
    if not temperature >= 0:
        raise ValueError(f"generate: temperature must be >= 0, got {temperature!r}")
    if top_k is not None and not 1 <= top_k <= config.vocab_size:
        raise ValueError(f"generate: top_k must be in [1, {config.vocab_size}], got {top_k!r}")
    if max_new_tokens == 0:
        return prompt
    run = _generate_cached if use_cache else _generate_full
    new = run(params, prompt.astype(jnp.int32), key, config=config, new=max_new_tokens,
              temperature=float(temperature), top_k=top_k, ops=ops, dtype=jnp.dtype(dtype))
    return jnp.concatenate([prompt.astype(jnp.int32), new], axis=1)


def _pick(logits, key, temperature, top_k, vocab_size):
    """One token per row from logits [B, padded_vocab]."""
    logits = logits[:, :vocab_size].astype(jnp.float32)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


_static = ("config", "new", "temperature", "top_k", "ops", "dtype")


@partial(jax.jit, static_argnames=_static)
def _generate_full(params, prompt, key, *, config, new, temperature, top_k, ops, dtype):
    B, P = prompt.shape
    seq = jnp.concatenate([prompt, jnp.zeros((B, new), jnp.int32)], axis=1)

    def step(seq, i):
        # Causal attention: the zeros after position P + i - 1 do not reach its logits.
        logits = family_of(config).forward(params, seq, config=config, ops=ops, dtype=dtype)
        last = jax.lax.dynamic_index_in_dim(logits, P + i - 1, axis=1, keepdims=False)
        tok = _pick(last, jax.random.fold_in(key, i), temperature, top_k, config.vocab_size)
        return jax.lax.dynamic_update_index_in_dim(seq, tok, P + i, axis=1), tok

    _, toks = jax.lax.scan(step, seq, jnp.arange(new))
    return toks.T


@partial(jax.jit, static_argnames=_static)
def _generate_cached(params, prompt, key, *, config, new, temperature, top_k, ops, dtype):
    family = family_of(config)
    # Cast once, not at every token (the family's own casts are then no-ops).
    params = jax.tree.map(lambda x: x.astype(dtype), params)
    logits, cache = family.prefill(params, prompt, config=config, ops=ops, dtype=dtype,
                                   length=prompt.shape[1] + new)

    # Decode: one position at a time against the cache.
    def decode(carry, i):
        logits, cache = carry
        tok = _pick(logits, jax.random.fold_in(key, i), temperature, top_k, config.vocab_size)
        logits, cache = family.decode(params, tok, prompt.shape[1] + i, cache, config=config,
                                      ops=ops, dtype=dtype)
        return (logits, cache), tok

    _, toks = jax.lax.scan(decode, (logits, cache), jnp.arange(new))
    return toks.T
