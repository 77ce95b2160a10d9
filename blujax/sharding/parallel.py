"""`gpt2.forward`'s hooks for per-device code inside the train step's shard_map.

On one device the hooks do nothing (gpt2.ONE_DEVICE). Here, on a ("data", "tensor",
"context") mesh, each device holds B / data sequences of T / context tokens (zig-zag chunks,
see ring.py), and:

- embed: the vocabulary-parallel token embedding (each device looks up the ids in its slice
  of wte, zeros elsewhere) summed over "tensor" and split along the sequence in the same
  reduce-scatter; the position embedding of the device's own positions.
- gather / reduce: the sequence-parallel LayerNorm regions. The residual stream and the
  LayerNorms hold T / context / tensor tokens per device; `gather` (all-gather over "tensor")
  brings back the device's whole sequence before a column-parallel product, `reduce`
  (reduce-scatter) sums a row-parallel product's partial results and splits the sequence
  again. Their transposes are each other, so the backward needs nothing more.
- attend: ring attention over "context" (plain causal attention when it has size 1).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from blujax.sharding.mesh import AXES, CONTEXT, TENSOR
from blujax.sharding.ring import ring_attention, zigzag_positions


def vary(x, axes=AXES):
    """x cast to varying over every one of `axes` (inside shard_map). Values that the model
    combines must agree in the axes they vary over, for instance a scan's carry."""
    def cast(leaf):
        missing = tuple(a for a in axes if a not in jax.typeof(leaf).manual_axis_type.varying)
        return jax.lax.pcast(leaf, missing, to="varying") if missing else leaf

    return jax.tree.map(cast, x)


@dataclasses.dataclass(frozen=True)
class Parallel:
    """The parallel hooks for a mesh whose "tensor" and "context" axes have these sizes."""

    tensor: int
    context: int

    def embed(self, p, tokens):
        wte = p["wte"]  # this device's rows of the vocabulary
        rows = wte.shape[0]
        ids = tokens - jax.lax.axis_index(TENSOR) * rows
        here = (ids >= 0) & (ids < rows)
        tok = jnp.where(here[..., None], jnp.take(wte, jnp.where(here, ids, 0), axis=0), 0)
        tok = self.reduce(tok)
        pos = jnp.take(p["wpe"], self.positions(tokens.shape[1]), axis=0)
        return vary(tok), vary(jnp.broadcast_to(pos, tok.shape))

    def positions(self, length):
        """Positions of this device's residual-stream tokens: its part of the zig-zag
        sequence, then its tensor slice of that."""
        pos = zigzag_positions(length, self.context, jax.lax.axis_index(CONTEXT))
        n = length // self.tensor
        return jax.lax.dynamic_slice_in_dim(pos, jax.lax.axis_index(TENSOR) * n, n)

    @staticmethod
    def gather(x):
        return jax.lax.all_gather(x, TENSOR, axis=1, tiled=True)

    @staticmethod
    def reduce(x):
        return jax.lax.psum_scatter(x, TENSOR, scatter_dimension=1, tiled=True)

    def attend(self, ops):
        if self.context == 1:
            return partial(_causal, ops)
        return partial(_ring, ops, self.context)


def _causal(ops, q, k, v):
    return ops.attention(q, k, v, causal=True), (k, v)


def _ring(ops, n, q, k, v):
    out = ring_attention(q, k, v, attention_with_lse=ops.attention_with_lse, axis_name=CONTEXT,
                         axis_size=n)
    return out, (k, v)
