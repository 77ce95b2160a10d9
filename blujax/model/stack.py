"""The transformer stack every family shares, written once: the block runner, the forward, and
sampling with a KV cache.

A family's model file writes what is its own: its config, its parameters (`declare`), how
tokens enter the residual stream (`embed`), one block, the final norm and the head's weight.
`Decoder` takes those pieces and runs them:

    DECODER = stack.Decoder("llama", embed=embed, block=block, norm=norm,
                            head_weight=head_weight, rope=rope_tables)
    logits = DECODER.forward(params, tokens, config=config, ops=blujax.kernels)

The layers' parameters are stacked along a leading axis (params["blocks"], logical axis
"layers"); the blocks run under `lax.scan`, so compile time does not grow with depth, or as a
Python loop on a GPU, where a scan costs copies around our custom calls (their operands and
results are copied out of and into slices of the scan's stacked activations). Both compute the
same values. Each layer's float32 parameters are cast to the compute dtype where the layer runs,
by the device's `take` hook: a parallel run may hook its gradient reduction there, one layer at
a time, and gathers a layer's weights split over "fsdp" there.

Activation memory (`remat`): "none" keeps what the backward needs; "full" keeps only each
block's input and recomputes the block in the backward (`jax.checkpoint`); "selective" keeps
the outputs of the matrix products and of attention (the expensive work, named in the hooks
and the attention kernel: SAVED) and recomputes the norms, activations and rotary embeddings.
Weights gathered over "fsdp" are kept with "none" (the products' operands), and gathered
again in the backward with "selective" and "full" unless the hooks say keep_gathered.

The blocks pass a *carry* from one to the next, whatever tuple the family chooses (GPT-2:
the residual stream, the sublayer output not yet added to it and that output's bias; Llama:
the first two); the stack only hands it on.

Sampling: the prompt runs through the model once (`prefill`) and leaves each layer's keys and
values in a cache of the final length, of the model's key/value heads ([L, B, length, KV, D];
GPT-2 is the case KV = H); every new token (`decode`) then costs one position's work,
attending to the cache.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp

from blujax import vocab
from blujax.fp8 import Hooks as Fp8Hooks, Layer as Fp8Layer
from blujax.model import family
from blujax.model.family import ATTENTION, GATHERED, MATMUL, ONE_DEVICE, Attend

# The values "selective" recomputation keeps: the matrix products' outputs, and attention's
# (its output and log-sum-exp).
SAVED = (MATMUL, ATTENTION)
REMAT = ("none", "selective", "full")


def remat_mode(remat) -> str:
    """One of REMAT from a remat setting: False / None "none", True "full", or the name."""
    if remat is None or remat is False:
        return "none"
    if remat is True:
        return "full"
    if remat not in REMAT:
        raise ValueError(f"remat must be one of {', '.join(REMAT)} (or a bool), got {remat!r}")
    return remat


def cast(tree, dtype):
    """Every array of a params (sub)tree in `dtype`."""
    return jax.tree.map(lambda x: x.astype(dtype), tree)


@dataclasses.dataclass(frozen=True)
class Decoder:
    """A decoder-only transformer from a family's pieces (all pure functions):

    embed(p, tokens, *, config, par, start) -> carry: the blocks' first carry for int tokens
      [B, T] at positions start, start + 1, ... (p: the params but the blocks, in the compute
      dtype; par: the device's hooks).
    block(layer, carry, *, config, ops, par, attend, rope) -> (carry, (k, v)): one block on
      one layer's params; attend: a family.Attend; rope: (cos, sin) [T, D / 2] of the block's
      positions, or None for a family without rotary positions.
    norm(p, carry, *, config, ops) -> h [B, T, C]: the final norm of the last carry.
    head_weight(p) -> [padded_vocab, C]: the LM head (the tied embedding or its own).
    rope(config) -> (cos, sin) float32 [block_size, D / 2] of every position, or None.
    name: the family's, in error messages.
    """

    name: str
    embed: Callable
    block: Callable
    norm: Callable
    head_weight: Callable
    rope: Callable | None = None

    def forward(self, params, tokens, *, config, ops, dtype=jnp.float32, remat: bool = False,
                parallel=None, scan_layers: bool | None = None, fp8=None):
        """Logits [B, T, padded_vocab_size] in `dtype` for int tokens [B, T], T <= block_size.

        The float32 params are cast to `dtype` (bfloat16: mixed precision; the kernels keep
        their statistics in float32). remat: which activations the backward recomputes
        instead of keeping ("none", "selective", "full"; True is "full": see the module's
        docstring). scan_layers: the blocks under
        `lax.scan` or as a Python loop; None picks the loop on a GPU and the scan elsewhere.

        parallel: None on one device. Inside `shard_map`, a `blujax.sharding.Parallel`: the
        params and tokens are then this device's shards and the logits its block
        [B, T_local, padded_vocab_size / tensor] (see blujax/sharding/parallel.py).

        fp8: None, or a `blujax.fp8.Layer` of every layer (its histories stacked as the blocks
        are): the blocks' products in FP8 as its recipe says.
        """
        par = ONE_DEVICE if parallel is None else parallel
        p, carry = self._run(params, tokens, config, ops, dtype, remat, par, scan_layers, fp8)
        return par.gather_matmul(self.norm(p, carry, config=config, ops=ops),
                                 self.head_weight(p).T)

    def hidden(self, params, tokens, *, config, ops, dtype=jnp.float32,
               scan_layers: bool | None = None):
        """The final norm's output [B, T, C] in `dtype` (one device): `forward` without the LM
        head, for work that needs logits at some positions only (`head`)."""
        p, carry = self._run(params, tokens, config, ops, dtype, False, ONE_DEVICE, scan_layers)
        return self.norm(p, carry, config=config, ops=ops)

    def head(self, params, h, *, dtype=jnp.float32):
        """Logits [..., padded_vocab_size] of hidden states h [..., C]."""
        return h.astype(dtype) @ self.head_weight(params).astype(dtype).T

    def check_tokens(self, tokens, config):
        family.check_tokens(self.name, tokens, config.block_size)

    def _run(self, params, tokens, config, ops, dtype, remat, par, scan_layers, fp8=None):
        """(the params but the blocks, in dtype; the carry after the last block)."""
        self.check_tokens(tokens, config)
        p = par.take({k: v for k, v in params.items() if k != "blocks"}, dtype)
        # Rotary tables for the tokens a column-parallel product's output holds: this
        # device's whole (context) sequence, gathered over "tensor".
        rope = self._rope(config, lambda t: par.at_gathered_positions(t, tokens.shape[1]))
        block = partial(self.block, config=config, ops=ops, par=par,
                        attend=par.attention(ops), rope=rope)
        carry = self.embed(p, tokens, config=config, par=par, start=0)
        return p, run_layers(block, carry, params["blocks"], dtype=dtype, par=par,
                             remat=remat, scan_layers=scan_layers, fp8=fp8)

    def _rope(self, config, at):
        return None if self.rope is None else tuple(at(t) for t in self.rope(config))

    # ----------------------------------------------------------------------------------------
    # Sampling with a KV cache

    def prefill(self, params, prompt, *, config, ops, dtype, length: int):
        """(logits [B, padded_vocab] of the prompt's last position, the cache: each layer's k
        and v [L, B, length, KV, D], the prompt's positions filled)."""
        self.check_tokens(prompt, config)
        p = cast(params, dtype)
        P = prompt.shape[1]
        block = partial(self.block, config=config, ops=ops, par=ONE_DEVICE,
                        attend=ONE_DEVICE.attention(ops), rope=self._rope(config,
                                                                          lambda t: t[:P]))

        def layer(carry, params):
            carry, (k, v) = block(params, carry)
            pad = ((0, 0), (0, length - P), (0, 0), (0, 0))
            return carry, (jnp.pad(k, pad), jnp.pad(v, pad))

        carry = self.embed(p, prompt, config=config, par=ONE_DEVICE, start=0)
        carry, cache = jax.lax.scan(layer, carry, p["blocks"])
        h = self.norm(p, carry, config=config, ops=ops)[:, -1:]
        return (h @ self.head_weight(p).T)[:, 0], cache

    def decode(self, params, tokens, at, cache, *, config, ops, dtype):
        """(logits [B, padded_vocab] after tokens [B] at position `at`, the cache with their k,
        v stored)."""
        p = cast(params, dtype)
        rope = self._rope(config, lambda t: jax.lax.dynamic_slice_in_dim(t, at, 1))

        def layer(carry, xs):
            params, cache_k, cache_v = xs
            return self.block(params, carry, config=config, ops=ops, par=ONE_DEVICE,
                              attend=cached_attention(cache_k, cache_v, at), rope=rope)

        carry = self.embed(p, tokens[:, None], config=config, par=ONE_DEVICE, start=at)
        carry, cache = jax.lax.scan(layer, carry, (p["blocks"], *cache))
        h = self.norm(p, carry, config=config, ops=ops)
        return (h @ self.head_weight(p).T)[:, 0], cache


def run_layers(block, carry, blocks, *, dtype, par=ONE_DEVICE, remat=False,
               scan_layers: bool | None = None, fp8=None):
    """`carry` through block(layer, carry, par=) -> (carry, _) for every layer of the stacked
    `blocks`, each layer's params taken (par.take: shared, in dtype, gathered) where it runs;
    remat: what the backward recomputes (remat_mode); scan_layers as Decoder.forward's; fp8:
    a blujax.fp8.Layer of all the layers or None (each block then gets fp8.Hooks of its
    own layer's histories)."""
    histories = None if fp8 is None else fp8.histories

    def step(carry, xs):
        layer, hist = xs
        hooks = par if fp8 is None else Fp8Hooks(par, Fp8Layer(fp8.recipe, hist))
        carry, _ = block(par.take(layer, dtype, within="blocks"), carry, par=hooks)
        return carry, None

    policy = checkpoint_policy(remat_mode(remat), par.gathers and par.keep_gathered)
    if policy is not None:
        step = jax.checkpoint(step, policy=policy())
    if scan_layers is None:
        scan_layers = jax.default_backend() != "gpu"
    if scan_layers:
        return jax.lax.scan(step, carry, (blocks, histories))[0]
    for i in range(jax.tree.leaves(blocks)[0].shape[0]):
        carry, _ = step(carry, jax.tree.map(lambda x: x[i], (blocks, histories)))
    return carry


def checkpoint_policy(mode: str, keep_gathered: bool):
    """A function giving the jax.checkpoint policy of one layer for a remat mode (its `policy`
    argument; a policy of None saves only the layer's inputs), or None: no checkpoint at all,
    every value the backward reads kept (weights gathered over "fsdp" too: the products keep
    their operands). With "selective" and "full" the gathered weights are gathered again in
    the backward, unless keep_gathered."""
    kept = (GATHERED,) if keep_gathered else ()
    if mode == "selective":
        return lambda: jax.checkpoint_policies.save_only_these_names(*SAVED, *kept)
    if mode == "full":
        return lambda: jax.checkpoint_policies.save_only_these_names(*kept) if kept else None
    return None


def cached_attention(cache_k, cache_v, at) -> Attend:
    """Attention of the tokens at position `at` against a layer's cache [B, length, KV, D]:
    their k, v stored there, each query head attending to its group's key/value head at the
    positions <= at (no repeated copies). One query against the cache is memory-bound work:
    plain jnp, in float32."""
    def heads(q, k, v):
        ck = jax.lax.dynamic_update_slice_in_dim(cache_k, k, at, axis=1)
        cv = jax.lax.dynamic_update_slice_in_dim(cache_v, v, at, axis=1)
        B, T, H, D = q.shape
        KV = k.shape[2]
        qg = q.reshape(B, T, KV, H // KV, D).astype(jnp.float32)
        s = jnp.einsum("bqkgd,btkd->bkgqt", qg, ck.astype(jnp.float32)) / math.sqrt(D)
        s = jnp.where(jnp.arange(ck.shape[1]) <= at, s, -jnp.inf)
        w = jax.nn.softmax(s, axis=-1)
        out = jnp.einsum("bkgqt,btkd->bqkgd", w, cv.astype(jnp.float32))
        return out.reshape(B, T, H, D).astype(q.dtype), (ck, cv)

    def fused(qkv):
        return heads(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])

    return Attend(fused, heads)


# --------------------------------------------------------------------------------------------
# The config every family's derives from


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """What every family's config holds (its Config derives from this one, keyword-only): the
    number of blocks, of attention heads, the width, the longest sequence, the vocabulary and
    its padded size (GPT-2's tokenizer unless a model was imported)."""

    n_layer: int
    n_head: int
    n_embd: int
    block_size: int = 1024
    vocab_size: int = vocab.GPT2_VOCAB_SIZE
    padded_vocab_size: int = vocab.GPT2_PADDED_VOCAB_SIZE

    def __post_init__(self):
        self.check(ints=("n_layer", "n_head", "n_embd", "block_size", "vocab_size",
                         "padded_vocab_size"))
        name = type(self).__name__
        if self.n_embd % self.n_head:
            raise ValueError(f"{name}: n_embd ({self.n_embd}) must be a multiple of n_head "
                             f"({self.n_head})")
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"{name}: padded_vocab_size ({self.padded_vocab_size}) must be "
                             f">= vocab_size ({self.vocab_size})")

    def check(self, *, ints=(), numbers=()):
        """ValueError unless the fields named in `ints` are positive ints and those in
        `numbers` positive finite numbers."""
        name = type(self).__name__
        for field in ints:
            v = getattr(self, field)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}.{field} must be a positive int, got {v!r}")
        for field in numbers:
            v = getattr(self, field)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 \
                    or not math.isfinite(v):
                raise ValueError(f"{name}.{field} must be a positive number, got {v!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


def num_params(params) -> int:
    return sum(x.size for x in jax.tree.leaves(params))
