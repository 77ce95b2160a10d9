"""Text generation from a GPT-2 params pytree: jitted, with a KV cache, temperature and top-k.

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

from blujax.model import gpt2


def generate(params, prompt, *, config: gpt2.GPT2Config, key, max_new_tokens: int,
             temperature: float = 1.0, top_k: int | None = None, ops, dtype=jnp.float32,
             use_cache: bool = True):
    """The prompt [B, P] (int) followed by max_new_tokens sampled tokens: [B, P + new].

    temperature 0 picks the most likely token; top_k keeps only the k most likely. Tokens are
    drawn from the real vocabulary (never a padding id). P + max_new_tokens must fit the
    model's block_size.
    """
    prompt = jnp.asarray(prompt)
    gpt2.check_tokens(prompt, config)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    total = prompt.shape[1] + max_new_tokens
    if total > config.block_size:
        raise ValueError(f"generate: prompt ({prompt.shape[1]} tokens) + max_new_tokens "
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
        logits = gpt2.forward(params, seq, config=config, ops=ops, dtype=dtype)
        last = jax.lax.dynamic_index_in_dim(logits, P + i - 1, axis=1, keepdims=False)
        tok = _pick(last, jax.random.fold_in(key, i), temperature, top_k, config.vocab_size)
        return jax.lax.dynamic_update_index_in_dim(seq, tok, P + i, axis=1), tok

    _, toks = jax.lax.scan(step, seq, jnp.arange(new))
    return toks.T


@partial(jax.jit, static_argnames=_static)
def _generate_cached(params, prompt, key, *, config, new, temperature, top_k, ops, dtype):
    B, P = prompt.shape
    total = P + new
    p = gpt2.cast(params, dtype)
    block = partial(gpt2._block, n_head=config.n_head, ops=ops)

    # Prefill: the prompt through every layer, keeping each layer's k and v.
    def prefill(carry, layer):
        *carry, (k, v) = block(layer, *carry, attend=partial(gpt2._attend, ops))
        pad = ((0, 0), (0, total - P), (0, 0), (0, 0))
        return tuple(carry), (jnp.pad(k, pad), jnp.pad(v, pad))

    tok, pos = gpt2._embed(p, prompt)
    (s, d, d_bias), cache = jax.lax.scan(prefill, gpt2.start(pos, tok), p["blocks"])
    logits = gpt2._head(p, s[:, -1:], d[:, -1:], d_bias, ops)[:, 0]

    # Decode: one position at a time against the cache.
    def decode(carry, i):
        logits, cache = carry
        tok = _pick(logits, jax.random.fold_in(key, i), temperature, top_k, config.vocab_size)
        at = P + i
        x, pos = gpt2._embed(p, tok[:, None], start=at)

        def layer_step(carry, xs):
            layer, ck, cv = xs
            *carry, kv = block(layer, *carry, attend=partial(_attend_cached, ck, cv, at))
            return tuple(carry), kv

        carry, cache = jax.lax.scan(layer_step, gpt2.start(pos, x), (p["blocks"], *cache))
        return (gpt2._head(p, *carry, ops)[:, 0], cache), tok

    _, toks = jax.lax.scan(decode, (logits, cache), jnp.arange(new))
    return toks.T


def _attend_cached(cache_k, cache_v, at, qkv):
    """qkv [B, 1, 3, H, D] at position `at`: store its k, v there and attend to positions
    <= at. One query against the cache is memory-bound work: plain jnp, in float32."""
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    cache_k = jax.lax.dynamic_update_slice_in_dim(cache_k, k, at, axis=1)
    cache_v = jax.lax.dynamic_update_slice_in_dim(cache_v, v, at, axis=1)
    scale = 1.0 / jnp.sqrt(jnp.float32(q.shape[-1]))
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), cache_k.astype(jnp.float32))
    s = jnp.where(jnp.arange(cache_k.shape[1]) <= at, s * scale, -jnp.inf)
    w = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", w, cache_v.astype(jnp.float32)).astype(q.dtype)
    return out, (cache_k, cache_v)
