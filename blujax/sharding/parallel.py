"""A model's hooks for per-device code inside the train step's shard_map.

On one device the hooks do nothing (blujax.model.family.ONE_DEVICE, which documents them).
Here, on a ("data", "fsdp", "tensor", "context") mesh, each device holds B / (data x fsdp)
sequences of T / context tokens (zig-zag chunks, see ring.py), and:

- embed_tokens: the vocabulary-parallel token embedding (each device looks up the ids in its
  slice of the table, zeros elsewhere) summed over "tensor" and split along the sequence in
  the same reduce-scatter; at_positions: a position table's rows for the device's own
  positions.
- gather_matmul / matmul_reduce: the sequence-parallel LayerNorm regions. The residual
  stream and the LayerNorms hold T / context / tensor tokens per device; a column-parallel
  product takes the device's whole sequence (all-gather over "tensor" first), a row-parallel
  product's partial results are summed and the sequence split again (reduce-scatter). Their
  transposes are each other, so the backward needs nothing more. With collective_matmul the
  collective is cut into "tensor" steps of `ppermute`, each overlapping one slice of the
  product (collective matmul), instead of one all-gather / reduce-scatter before / after it
  (FP8 products then scale each slice by its own amax, over all devices).
- take: parameters as a layer takes them, in the compute dtype. With reduce_in_backward the
  float32 parameters are first cast to varying over the devices that share them here, inside
  the differentiated function, so JAX's transpose of that cast (a psum) reduces each layer's
  gradient in the backward as soon as it exists, where it can overlap the backward of the
  layers below it. Without it the step reduces all gradients once, after the backward (and
  after the last micro-batch). Over "fsdp" (ZeRO-3), each leaf split there is cast to the
  compute dtype and then all-gathered (half the bytes of the float32 master in bfloat16),
  where the layer runs; its gradient comes back reduce-scattered in float32 (`_gather_cast`).
  The gathered weights are named GATHERED: with recomputation ("selective", "full") the layer
  runner frees them after the forward and gathers again in the backward unless keep_gathered
  (blujax.model.stack.checkpoint_policy); without, the backward keeps them. Every
  gather depends only on the parameters, not on the layer before, so the scheduler is free
  to issue the next layer's while this one computes.
- attention: ring attention over "context" (plain causal attention when it has size 1), of
  a fused projection or of grouped-query heads (q [B, T, H, D] over k, v [B, T, KV, D]);
  for the latter, where the layout keeps the key/value heads whole (`whole` holds
  "kv_heads": n_kv_head does not divide by "tensor", so wk and wv are replicated over it and
  every device computes all the KV heads), each device first picks the KV heads its own
  query heads use (`_local_kv`).
- loss: the vocabulary-parallel cross-entropy of the device's logits columns.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from blujax.model.family import (ATTENTION, GATHERED, Attend, Sublayers, causal_attention,
                                 heads_attention, saved)
from blujax.sharding.mesh import AXES, CONTEXT, FSDP, TENSOR
from blujax.sharding.ring import ring_attention, zigzag_positions


def vary(x, axes=AXES):
    """x cast to varying over every one of `axes` (inside shard_map). Values that the model
    combines must agree in the axes they vary over, for instance a scan's carry."""
    def cast(leaf):
        missing = tuple(a for a in axes if a not in jax.typeof(leaf).manual_axis_type.varying)
        return jax.lax.pcast(leaf, missing, to="varying") if missing else leaf

    return jax.tree.map(cast, x)


@dataclasses.dataclass(frozen=True)
class Parallel(Sublayers):
    """The parallel hooks for a mesh whose "tensor" and "context" axes have these sizes.
    `whole`: the logical axes the layout keeps whole though RULES splits them
    (blujax.sharding.layout.Layout.of's). `fsdp_dims`: (key path, dimension) of each
    parameter split over "fsdp" (`fsdp_dims`, from the layout); keep_gathered: keep each
    layer's gathered weights for the backward instead of gathering them again."""

    tensor: int
    context: int
    collective_matmul: bool = False
    reduce_in_backward: bool = False
    whole: tuple[str, ...] = ()
    fsdp_dims: tuple[tuple[str, int], ...] = ()
    keep_gathered: bool = False

    @property
    def gathers(self) -> bool:
        return bool(self.fsdp_dims)

    @property
    def splits_sequence(self) -> bool:
        """Whether the residual stream is split along the sequence over "tensor" (the products
        gather it and reduce-scatter their outputs)."""
        return self.tensor > 1

    @property
    def slices(self) -> int:
        """How many products gather_matmul and matmul_reduce run, one sequence slice each."""
        return self.tensor if self.collective_matmul else 1

    def share(self, params):
        return vary(params) if self.reduce_in_backward else params

    def take(self, params, dtype, within: str | None = None):
        """params (a subtree of the model's: its top level, or with within="blocks" one layer
        of the stacked blocks) as the layer uses them: shared, in `dtype`, whole over
        "fsdp"."""
        dims = dict(self.fsdp_dims)
        prefix, drop = (f"[{within!r}]", 1) if within else ("", 0)

        def one(path, x):
            dim = dims.get(prefix + jax.tree_util.keystr(path))
            if dim is None:
                return x.astype(dtype)
            return checkpoint_name(
                _gather_cast(x, dim - drop, jnp.dtype(dtype)), GATHERED)

        return jax.tree_util.tree_map_with_path(one, self.share(params))

    def embed_tokens(self, wte, tokens):
        rows = wte.shape[0]  # this device's rows of the vocabulary
        ids = tokens - jax.lax.axis_index(TENSOR) * rows
        here = (ids >= 0) & (ids < rows)
        tok = jnp.where(here[..., None], jnp.take(wte, jnp.where(here, ids, 0), axis=0), 0)
        return vary(jax.lax.psum_scatter(tok, TENSOR, scatter_dimension=1, tiled=True))

    def at_positions(self, table, length, start=0):
        """The rows of `table` for this device's residual-stream tokens of a sequence of
        `length` (its part of the zig-zag sequence, then its tensor slice of that)."""
        pos = zigzag_positions(length, self.context, jax.lax.axis_index(CONTEXT))
        n = length // self.tensor
        pos = jax.lax.dynamic_slice_in_dim(pos, jax.lax.axis_index(TENSOR) * n, n)
        return vary(jnp.take(table, start + pos, axis=0))

    def at_gathered_positions(self, table, length):
        """The rows of `table` for the tokens a column-parallel product's output holds: this
        device's part of the zig-zag sequence, whole (the "tensor" group gathered it)."""
        pos = zigzag_positions(length, self.context, jax.lax.axis_index(CONTEXT))
        return vary(jnp.take(table, pos, axis=0))

    def gather_matmul(self, x, w, name=None, dot=jnp.matmul):
        """dot(all_gather(x over "tensor", along the sequence), w)."""
        if self.collective_matmul and self.tensor > 1:
            return saved(_gather_matmul(x, w, self.tensor, dot))
        return saved(dot(self.gather_sequence(x), w))

    def matmul_reduce(self, x, w, name=None, dot=jnp.matmul):
        """psum_scatter(dot(x, w) over "tensor", along the sequence)."""
        if self.collective_matmul and self.tensor > 1:
            return saved(_matmul_reduce(x, w, self.tensor, dot))
        return saved(self.reduce_sequence(dot(x, w)))

    @staticmethod
    def gather_sequence(x):
        return jax.lax.all_gather(x, TENSOR, axis=1, tiled=True)

    @staticmethod
    def reduce_sequence(y):
        return jax.lax.psum_scatter(y, TENSOR, scatter_dimension=1, tiled=True)

    @staticmethod
    def amax_reduce(a):
        """The max over every device: wherever a tensor is split, its parts scale alike (and
        the batch's, so that a mesh computes what one device does)."""
        return jax.lax.pmax(a, AXES)

    def attention(self, ops) -> Attend:
        if self.context == 1:
            fused, heads = partial(causal_attention, ops), partial(heads_attention, ops)
        else:
            fused, heads = partial(_ring, ops, self.context), partial(_ring_heads, ops,
                                                                      self.context)
        if "kv_heads" in self.whole and self.tensor > 1:
            heads = partial(_attend_local_kv, heads, self.tensor)
        return Attend(fused, heads)

    @staticmethod
    def loss(ops, logits, targets, *, num_classes, n_tokens):
        # The padded vocabulary columns never enter the softmax.
        losses = ops.vocab_parallel_softmax_cross_entropy(logits, targets, axis_name=TENSOR,
                                                          num_classes=num_classes)
        return jnp.sum(losses) / n_tokens


def fsdp_dims(params, fsdp_axes) -> tuple[tuple[str, int], ...]:
    """(key path, dimension) of every leaf of params split over "fsdp" (fsdp_axes: per leaf,
    as Layout.fsdp_axes)."""
    paths = [jax.tree_util.keystr(path) for path, _ in
             jax.tree_util.tree_flatten_with_path(params)[0]]
    return tuple((p, f) for p, f in zip(paths, fsdp_axes) if f is not None)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather_cast(x, dim, dtype):
    """x (this device's float32 piece) in `dtype`, all-gathered over "fsdp" along `dim`: the
    cast first, so the gather moves the compute dtype's bytes. Its gradient: the whole
    gradient reduce-scattered back in float32 (a bfloat16 sum over devices would round every
    addition)."""
    return jax.lax.all_gather(x.astype(dtype), FSDP, axis=dim, tiled=True)


def _gather_cast_fwd(x, dim, dtype):
    return _gather_cast(x, dim, dtype), jnp.zeros((0,), x.dtype)


def _gather_cast_bwd(dim, dtype, empty, g):
    summed = jax.lax.psum_scatter(g.astype(jnp.float32), FSDP, scatter_dimension=dim, tiled=True)
    return (summed.astype(empty.dtype),)


_gather_cast.defvjp(_gather_cast_fwd, _gather_cast_bwd)


def _ring(ops, n, qkv):
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    out = ring_attention(q, k, v, attention_with_lse=ops.attention_with_lse, axis_name=CONTEXT,
                         axis_size=n)
    return saved(out, ATTENTION), (k, v)


def _ring_heads(ops, n, q, k, v):
    out = ring_attention(q, k, v, attention_with_lse=ops.attention_with_lse, axis_name=CONTEXT,
                         axis_size=n)
    return saved(out, ATTENTION), (k, v)


def _attend_local_kv(attend, tp, q, k, v):
    """attend(q, k, v) for this device's query heads q [B, T, Hl, D] over the KV heads they use
    of k, v [B, T, KV, D] (all of them, replicated over "tensor"); returns (output, (k, v))
    with all the KV heads, as the layer computed them."""
    out, _ = attend(q, *_local_kv(q.shape[2], k.shape[2], tp, k, v))
    return out, (k, v)


def _local_kv(hl, kv, tp, *xs):
    """The KV heads (of kv in all) that device r of "tensor", holding the query heads
    [r hl, (r + 1) hl) of hl tp, uses, cut from each of xs [B, T, kv, D]: query head h reads KV
    head h // G, G = hl tp / kv. Where hl divides G, all hl query heads read one KV head
    (r hl // G: local GQA of group hl); otherwise each query head gets its own copy (G = 1
    here), e.g. 6 heads over 3 devices with 2 KV heads: device 1's heads 2, 3 read KV heads 0,
    1. (hl / G = kv / tp: a whole number of KV heads per device is the case where they split
    over "tensor" instead; the copies are right there too.)"""
    g = hl * tp // kv
    r = jax.lax.axis_index(TENSOR)
    if g % hl == 0:
        return tuple(jax.lax.dynamic_slice_in_dim(x, r * hl // g, 1, axis=2) for x in xs)
    index = (r * hl + jnp.arange(hl)) // g
    return tuple(jnp.take(x, index, axis=2) for x in xs)


def _gather_matmul(x, w, n, dot=jnp.matmul):
    """all_gather(x, TENSOR, axis=1, tiled=True) @ w as n products of one sequence slice each:
    while device i multiplies the slice in hand, it passes that slice on to device i - 1, so
    at step j it holds (and writes the rows of) device i + j's slice."""
    i = jax.lax.axis_index(TENSOR)
    t = x.shape[1]
    to_previous = [(j, (j - 1) % n) for j in range(n)]
    out = None
    for step in range(n):
        # The next slice's transfer is issued first: it does not wait for this product.
        incoming = jax.lax.ppermute(x, TENSOR, to_previous) if step < n - 1 else None
        y = dot(x, w)
        if out is None:
            out = jnp.zeros((y.shape[0], n * t, *y.shape[2:]), y.dtype)
        out = jax.lax.dynamic_update_slice_in_dim(out, y, ((i + step) % n) * t, axis=1)
        x = incoming
    return out


def _matmul_reduce(x, w, n, dot=jnp.matmul):
    """psum_scatter(x @ w, TENSOR, scatter_dimension=1, tiled=True) as n products of one
    sequence slice each: a running sum travels to device i + 1 while device i multiplies the
    next slice; at step j device i adds slice (i - 1 - j) mod n, ending with its own."""
    i = jax.lax.axis_index(TENSOR)
    t = x.shape[1] // n
    to_next = [(j, (j + 1) % n) for j in range(n)]
    acc = None
    for step in range(n):
        part = dot(jax.lax.dynamic_slice_in_dim(x, ((i - 1 - step) % n) * t, t, axis=1), w)
        acc = part if acc is None else jax.lax.ppermute(acc, TENSOR, to_next) + part
    return acc
