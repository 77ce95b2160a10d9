"""The seam between a model family and everything that trains, shards, samples or converts it.

A family is a folder, `blujax/model/<family>/`: its model (model.py: the config, presets,
parameters, one block) and beside it its converters (Hugging Face, llm.c, earlier checkpoint
layouts). The folder's `__init__.py` is the family's face: the names of `Family` below, which
the train step, the sharding, the loop, sampling, evaluation, interop and the CLI reach through
`blujax.model.family_of(config)`; a new family plugs in by being registered in
`blujax.model.FAMILIES`. What every family shares (the block runner, the forward, prefill and
decode with a KV cache, the conversion checks) is written once, in `blujax.model.stack` and
`blujax.model.convert`.

Parameters declare their logical axes where they are created: a family's `declare(config,
key)` returns its params pytree with every leaf a `Param(value, axes)`, one axis name per
dimension ("vocab", "embed", "heads", ...). `init` and `logical_axes` are that tree's values
and axes (`split`); `blujax.sharding.layout.RULES`, the one table, maps the names to mesh axes
(an optional `whole_axes(config, sizes)` keeps some of them whole on a given mesh).

Inside a step the model calls the device's *hooks* where a parallel run communicates:
`ONE_DEVICE` below on one device, `blujax.sharding.Parallel` inside `shard_map`.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Callable, NamedTuple, Protocol

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from blujax.kernels.attention import CHECKPOINT_NAME


@dataclasses.dataclass(frozen=True)
class Param:
    """A parameter as its family creates it: the value (an array, or a shape under
    jax.eval_shape) and the logical name of each of its axes (a pytree leaf: the names are
    static)."""

    value: Any
    axes: tuple[str, ...]


jax.tree_util.register_dataclass(Param, data_fields=["value"], meta_fields=["axes"])


def is_param(x) -> bool:
    return isinstance(x, Param)


def split(declared):
    """(values, axes) of a tree of Params: two trees of the same structure. TypeError for a
    leaf that is not a Param, or whose axes do not name each of its dimensions."""
    def check(path, x):
        where = jax.tree_util.keystr(path)
        if not is_param(x):
            raise TypeError(f"parameter {where} is not declared with its logical axes (wrap it "
                            f"in blujax.model.family.Param(value, axes))")
        if len(x.axes) != len(x.value.shape) or not all(isinstance(a, str) for a in x.axes):
            raise TypeError(f"parameter {where} of shape {tuple(x.value.shape)} declares the "
                            f"axes {x.axes}: one name per dimension")
        return x

    jax.tree_util.tree_map_with_path(check, declared, is_leaf=is_param)
    return (jax.tree.map(lambda p: p.value, declared, is_leaf=is_param),
            jax.tree.map(lambda p: p.axes, declared, is_leaf=is_param))


def axes_of(declare, config) -> Any:
    """The logical axes of `declare(config, key)`'s params, without computing them."""
    return split(jax.eval_shape(lambda k: declare(config, k), jax.random.key(0)))[1]


def init_and_axes(declare):
    """A family's init(config, key) (the values of declare's params, jitted; the config is
    static) and logical_axes(config) (their axes), both from its declare."""
    @partial(jax.jit, static_argnums=0)
    def init(config, key):
        return split(declare(config, key))[0]

    def logical_axes(config):
        return axes_of(declare, config)

    return init, logical_axes


class Family(Protocol):
    """What a model family's face (`blujax/model/<family>/__init__.py`) defines.

    NAME: its name ("gpt2"), the key of blujax.model.FAMILIES, config.json's "family" and
      Hugging Face's model_type; TITLE: how messages name it ("GPT-2").
    Config: its frozen config dataclass, derived from blujax.model.stack.Config (n_layer,
      n_head, n_embd, block_size, vocab_size, padded_vocab_size); PRESETS: {name: Config}.
    declare(config, key): the params pytree of Params (values float32); init(config, key):
      its values; logical_axes(config): its axes.
    forward(params, tokens, *, config, ops, dtype, remat=False, parallel=None,
      scan_layers=None): logits [B, T, padded_vocab] (this device's block inside shard_map,
      where `parallel` is the device's hooks).
    hidden(params, tokens, *, config, ops, dtype): the final normalized hidden states
      [B, T, C]; head(params, h, *, dtype): their logits (forward = head(hidden)).
    prefill(params, prompt, *, config, ops, dtype, length) -> (logits of the last position,
      cache of `length` positions); decode(params, tokens [B], at, cache, *, config, ops,
      dtype) -> (logits [B, V], cache): sampling with a KV cache. (forward to decode are one
      `blujax.model.stack.Decoder`'s.)
    check_tokens(tokens, config); check_mesh(config, sizes): ValueError for a mesh
      ({"data", "fsdp", "tensor", "context"} sizes) the model does not split over.
    decay_mask(params): True for the leaves AdamW decays.
    flops_per_token(config, seq_len): training FLOPs per token (for MFU).
    config_from_hf, hf_config, to_hf, from_hf: its Hugging Face converter (blujax.interop
      reads and writes the files); HF_ARCHITECTURE: the transformers class it matches
      ("GPT2LMHeadModel"). to_llmc, from_llmc, llmc_shapes where the family has an llm.c
      format.
    Optional: legacy_params(params) / upgrade_params(params), to and from the parameter layout
      of checkpoints an earlier blujax wrote, which restoring converts.
    Optional: whole_axes(config, sizes): the logical axes that RULES splits over "tensor" but
      this config keeps whole (replicated) on a mesh of these sizes (Llama's "kv_heads" where
      n_kv_head does not divide by "tensor"); the layout (sharding.Layout.of's `whole`) and the
      hooks (sharding.Parallel's) follow it. Without it, none.
    """

    NAME: str
    TITLE: str
    Config: type
    PRESETS: dict


# The names a Family module must define (tests check every registered family has them).
REQUIRED = ("NAME", "TITLE", "HF_ARCHITECTURE", "Config", "PRESETS", "declare", "init",
            "logical_axes", "forward", "hidden", "head", "prefill", "decode", "check_tokens",
            "check_mesh", "decay_mask", "flops_per_token", "config_from_hf", "hf_config",
            "to_hf", "from_hf")


class Attend(NamedTuple):
    """How a block attends, in the form its projection gives: `fused(qkv)` of a fused
    projection's [B, T, 3, H, D] (its gradient comes back as one tensor), or `heads(q, k, v)`
    of q [B, T, H, D] over k, v [B, T, KV, D] (grouped-query attention: KV divides H). Each
    returns (the output [B, T, H, D], the layer's (k, v) as a KV cache keeps them)."""

    fused: Callable
    heads: Callable


# Names (jax.ad_checkpoint.checkpoint_name) the layer runner's recomputation policies read
# (blujax.model.stack): a layer's weights gathered over "fsdp" (sharding.Parallel.take), and
# the outputs "selective" keeps: the matrix products' (the hooks name them) and attention's.
GATHERED, MATMUL = "fsdp_gathered", "matmul"
ATTENTION = CHECKPOINT_NAME  # the attention kernel names its output and lse too


def saved(x, name: str = MATMUL):
    """x named for the recomputation policy."""
    return checkpoint_name(x, name)


class Sublayers:
    """The pieces of a block that a device's hooks compose from their own products (the base of
    OneDevice and sharding.Parallel; blujax.fp8's hooks run them as FP8 pieces where they can,
    and call these, on themselves, where they cannot):

    swiglu_mlp: the gated MLP swiglu(x @ w_up) @ w_down, w_up [C, 2F] (gate and up, this
    device's F), w_down [F, C], as the two products gather_matmul ("up") and matmul_reduce
    ("down") run. norm_matmul: ops.add_rms_norm(x, residual, gamma), then the product `name`
    of its output (gather_matmul), with the sum: (product, sum). norm_swiglu_mlp: the same
    norm, then the gated MLP: (mlp, sum)."""

    def swiglu_mlp(self, ops, x, w_up, w_down):
        g = self.gather_matmul(x, w_up, "up")
        return self.matmul_reduce(ops.swiglu(g.reshape(*g.shape[:-1], 2, -1)), w_down, "down")

    def norm_matmul(self, ops, x, residual, gamma, w, name, *, eps):
        h, s = ops.add_rms_norm(x, residual, gamma, eps=eps)
        return self.gather_matmul(h, w, name), s

    def norm_swiglu_mlp(self, ops, x, residual, gamma, w_up, w_down, *, eps):
        h, s = ops.add_rms_norm(x, residual, gamma, eps=eps)
        return self.swiglu_mlp(ops, h, w_up, w_down), s


class OneDevice(Sublayers):
    """The hooks a model calls where a parallel run communicates; on one device, nothing.
    `blujax.sharding.Parallel` is the same interface inside shard_map.

    share: parameters (float32) as a layer takes them; take: the same in a compute dtype (on a
    mesh with "fsdp", also gathered whole; `within="blocks"`: one layer of the stacked blocks),
    and `gathers`: whether take gathers anything. embed_tokens: rows of the token
    embedding for int tokens [B, T]. at_positions: the rows of a position-indexed table
    (a position embedding) for this device's residual-stream tokens of its T; at_gathered_
    positions: the same for the tokens a column-parallel product's output holds (all T, where
    a sequence-parallel run splits the residual stream further: rotary tables). gather_matmul: a
    normalized activation times a column-parallel weight; matmul_reduce: a row-parallel
    product, its partial sums reduced; gather_sequence and reduce_sequence: the communication
    alone of each (x whole along the sequence; partial sums reduced and split along it), and
    splits_sequence: whether they communicate (the residual stream split along the sequence);
    the Sublayers built on these. attention(ops): the causal
    attention of a block, an `Attend` (on a mesh, of this device's query heads, and its
    key/value heads or all of them where the layout keeps "kv_heads" whole). loss: this
    device's share (sum / n_tokens) of the mean cross-entropy of logits [N, V] against [N].
    """

    gathers = False
    splits_sequence = False

    @staticmethod
    def share(params):
        return params

    @staticmethod
    def take(params, dtype, within=None):
        return jax.tree.map(lambda x: x.astype(dtype), params)

    @staticmethod
    def embed_tokens(wte, tokens):
        return jnp.take(wte, tokens, axis=0)

    @staticmethod
    def at_positions(table, length, start=0):
        return jax.lax.dynamic_slice_in_dim(table, start, length)

    @staticmethod
    def at_gathered_positions(table, length):
        return jax.lax.dynamic_slice_in_dim(table, 0, length)

    @staticmethod
    def gather_matmul(x, w, name=None, dot=jnp.matmul):
        return saved(dot(x, w))

    @staticmethod
    def matmul_reduce(x, w, name=None, dot=jnp.matmul):
        return saved(dot(x, w))

    @staticmethod
    def gather_sequence(x):
        return x

    @staticmethod
    def reduce_sequence(y):
        return y

    @staticmethod
    def amax_reduce(a):
        return a

    @staticmethod
    def attention(ops):
        return Attend(partial(causal_attention, ops), partial(heads_attention, ops))

    @staticmethod
    def loss(ops, logits, targets, *, num_classes, n_tokens):
        # All n_tokens are here: the mean kernel, whose gradient comes out of its own pass.
        assert logits.shape[0] == n_tokens
        return ops.softmax_cross_entropy_mean(logits, targets, num_classes=num_classes)


ONE_DEVICE = OneDevice()


def causal_attention(ops, qkv):
    """Causal attention over qkv [B, T, 3, H, D]: (output, the layer's (k, v))."""
    return saved(ops.attention_qkv(qkv, causal=True), ATTENTION), (qkv[:, :, 1], qkv[:, :, 2])


def heads_attention(ops, q, k, v):
    """Causal attention of q [B, T, H, D] over k, v [B, T, KV, D]: (output, (k, v))."""
    return saved(ops.attention(q, k, v, causal=True), ATTENTION), (k, v)


def check_tokens(family: str, tokens, block_size: int):
    """Int tokens [batch, time] with 1 <= time <= block_size; a clear error otherwise (`family`
    names the model in it)."""
    if not hasattr(tokens, "ndim") or tokens.ndim != 2:
        raise ValueError(f"{family}: tokens must be [batch, time], got shape "
                         f"{getattr(tokens, 'shape', type(tokens).__name__)}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"{family}: tokens must be integers, got {tokens.dtype}")
    if not 1 <= tokens.shape[1] <= block_size:
        raise ValueError(f"{family}: sequence length {tokens.shape[1]} is outside [1, "
                         f"{block_size}] (the model's block_size)")


def check_split(config, sizes: dict[str, int], heads: tuple[str, ...]):
    """The model splits over the mesh's "tensor" axis: whole heads (each config field named in
    `heads` divisible by it) and equal vocabulary slices per device; and over "fsdp": the
    width (n_embd) in equal pieces."""
    fsdp = sizes.get("fsdp", 1)
    if config.n_embd % fsdp:
        raise ValueError(f"blujax.sharding: n_embd ({config.n_embd}) must be divisible by the "
                         f"fsdp axis ({fsdp}): every weight is split over it along the width")
    tp = sizes["tensor"]
    for name in heads:
        if getattr(config, name) % tp:
            raise ValueError(f"blujax.sharding: {name} ({getattr(config, name)}) must be "
                             f"divisible by the tensor axis ({tp}): each device holds whole "
                             f"attention heads")
    if config.padded_vocab_size % tp:
        raise ValueError(f"blujax.sharding: padded_vocab_size ({config.padded_vocab_size}) must "
                         f"be divisible by the tensor axis ({tp}) for the vocabulary-parallel "
                         f"embedding and loss")
