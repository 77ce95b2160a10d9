"""GPT-2: pre-LayerNorm blocks with a fused QKV projection and a GELU MLP, learned position
embeddings, the token embedding tied to the LM head.

    config = PRESETS["gpt2"]                          # or GPT2Config(n_layer=..., ...)
    params = init(config, jax.random.key(0))          # float32 master weights
    logits = forward(params, tokens, config=config, ops=blujax.kernels, dtype=jnp.bfloat16)

`ops` is `blujax.kernels` (our FFI kernels) or `blujax.model.ops.XLA` (plain JAX): the same
model runs on either. Each residual add is fused into the LayerNorm after it
(`add_layer_norm`), so the carry between blocks is (the residual stream, the sublayer output
not yet added to it, that output's bias). The stack around the block (the layer runner, the
forward, prefill and decode) is `blujax.model.stack`'s.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from blujax.kernels._util import match_vma
from blujax.model import family, stack
from blujax.model.family import Param

NAME = "gpt2"
TITLE = "GPT-2"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPT2Config(stack.Config):
    """The stack's fields are all of GPT-2's shape: n_layer blocks of n_head heads, n_embd wide
    (the MLP 4 n_embd), block_size learned positions."""


Config = GPT2Config

PRESETS = {
    "gpt2": GPT2Config(n_layer=12, n_head=12, n_embd=768),             # 124M
    "gpt2-medium": GPT2Config(n_layer=24, n_head=16, n_embd=1024),     # 350M
    "gpt2-large": GPT2Config(n_layer=36, n_head=20, n_embd=1280),      # 774M
    "gpt2-xl": GPT2Config(n_layer=48, n_head=25, n_embd=1600),         # 1558M
    # Small enough to train on a laptop CPU in minutes (most of their parameters are the
    # 50304-row embedding). Heads of 64, as GPT-2's, which the GPU attention kernel takes.
    "small": GPT2Config(n_layer=4, n_head=2, n_embd=128, block_size=256),
    "tiny": GPT2Config(n_layer=2, n_head=1, n_embd=64, block_size=128),
}


def declare(config: GPT2Config, key) -> dict:
    """GPT-2's parameters with their logical axes (family.Param), initialized as GPT-2 is:
    normal(0.02) weights, residual projections normal(0.02 / sqrt(2 n_layer)), zero biases,
    unit LayerNorm scales, all float32; the padded vocabulary rows zero.

    The fused QKV projection is [L, C, 3, C] (bias [L, 3, C]): q, k and v side by side, each
    of n_head heads of head_dim, so that a split of its last axis over devices gives each
    whole heads of all three. "heads" is such an axis (n_head x head_dim); "layers" stacks the
    blocks (the scan's axis)."""
    L, C, std = config.n_layer, config.n_embd, 0.02
    proj_std = std / math.sqrt(2 * config.n_layer)
    k = jax.random.split(key, 6)

    def normal(key, shape, scale, axes):
        return Param(scale * jax.random.normal(key, shape, jnp.float32), axes)

    def zeros(shape, axes):
        return Param(jnp.zeros(shape, jnp.float32), axes)

    def norm():
        return {"w": Param(jnp.ones((L, C)), ("layers", "embed")),
                "b": zeros((L, C), ("layers", "embed"))}

    wte = normal(k[0], (config.padded_vocab_size, C), std, ("vocab", "embed"))
    wte = Param(wte.value.at[config.vocab_size:].set(0.0), wte.axes)
    return {
        "wte": wte,
        "wpe": normal(k[1], (config.block_size, C), std, ("positions", "embed")),
        "blocks": {
            "ln1": norm(),
            "attn": {"w": normal(k[2], (L, C, 3, C), std, ("layers", "embed", "qkv", "heads")),
                     "b": zeros((L, 3, C), ("layers", "qkv", "heads"))},
            "attn_proj": {"w": normal(k[3], (L, C, C), proj_std, ("layers", "heads", "embed")),
                          "b": zeros((L, C), ("layers", "embed"))},
            "ln2": norm(),
            "mlp_fc": {"w": normal(k[4], (L, C, 4 * C), std, ("layers", "embed", "mlp")),
                       "b": zeros((L, 4 * C), ("layers", "mlp"))},
            "mlp_proj": {"w": normal(k[5], (L, 4 * C, C), proj_std, ("layers", "mlp", "embed")),
                         "b": zeros((L, C), ("layers", "embed"))},
        },
        "ln_f": {"w": Param(jnp.ones((C,)), ("embed",)), "b": zeros((C,), ("embed",))},
    }


# init(config, key): the values of declare's params (float32); logical_axes(config): their axes.
init, logical_axes = family.init_and_axes(declare)


def embed(p, tokens, *, config, par, start=0):
    """The first carry: (token, position) embeddings of this device's tokens, to be added by the
    first block's add_layer_norm, and a zero bias (a fixed structure, as lax.scan needs; inside
    shard_map typed as varying like the embeddings, as the biases the blocks pass on are)."""
    tok = par.embed_tokens(p["wte"], tokens)
    pos = jnp.broadcast_to(par.at_positions(p["wpe"], tokens.shape[1], start), tok.shape)
    return tok, pos, match_vma(jnp.zeros(pos.shape[-1], pos.dtype), pos)[0]


def block(layer, carry, *, config, ops, par, attend, rope=None):
    """One transformer block. The carry (s, d, d_bias): s the residual stream so far; d + d_bias
    the previous sublayer's output, still to be added to it (each output projection's bias is
    added in the LayerNorm after it, which saves a pass over the activations). Under tensor
    parallelism `par` gathers the sequence into each column-parallel product and reduces out of
    each row-parallel one; this device then holds its share of the heads."""
    s, d, d_bias = carry
    h, s = ops.add_layer_norm(d, s, layer["ln1"]["w"], layer["ln1"]["b"], x_bias=d_bias)
    w, b = layer["attn"]["w"], layer["attn"]["b"]  # [C, 3, H * D] (this device's heads)
    qkv = par.gather_matmul(h, w.reshape(w.shape[0], -1), "qkv") + b.reshape(-1)
    B, T, _ = qkv.shape
    a, kv = attend.fused(qkv.reshape(B, T, 3, -1, config.head_dim))
    a = par.matmul_reduce(a.reshape(B, T, -1), layer["attn_proj"]["w"], "out")
    h, s = ops.add_layer_norm(a, s, layer["ln2"]["w"], layer["ln2"]["b"],
                              x_bias=layer["attn_proj"]["b"])
    f = ops.gelu(par.gather_matmul(h, layer["mlp_fc"]["w"], "up"), layer["mlp_fc"]["b"])
    m = par.matmul_reduce(f, layer["mlp_proj"]["w"], "down")
    return (s, m, match_vma(layer["mlp_proj"]["b"], m)[0]), kv


def norm(p, carry, *, config, ops):
    s, d, d_bias = carry
    return ops.add_layer_norm(d, s, p["ln_f"]["w"], p["ln_f"]["b"], x_bias=d_bias)[0]


def head_weight(p):
    return p["wte"]


DECODER = stack.Decoder(NAME, embed=embed, block=block, norm=norm, head_weight=head_weight)
forward, hidden, head = DECODER.forward, DECODER.hidden, DECODER.head
prefill, decode, check_tokens = DECODER.prefill, DECODER.decode, DECODER.check_tokens


def decay_mask(params) -> dict:
    """True for the leaves AdamW decays: matrices and embeddings, not biases or LayerNorm."""
    def decays(path, _):
        names = [getattr(p, "key", None) for p in path]
        return names[-1] in ("wte", "wpe") or (names[-1] == "w" and "ln" not in names[-2])

    return jax.tree_util.tree_map_with_path(decays, params)


def flops_per_token(config: GPT2Config, seq_len: int) -> float:
    """Training FLOPs per token: 6 per weight of every matrix product (forward 2, backward 4;
    the LM head counted at the padded vocabulary), plus attention's two products in full
    (no halving for the causal mask): 12 * n_layer * seq_len * n_embd."""
    L, C = config.n_layer, config.n_embd
    matmul_weights = L * 12 * C * C + config.padded_vocab_size * C
    return 6.0 * matmul_weights + 12.0 * L * seq_len * C


def check_mesh(config, sizes: dict[str, int]) -> None:
    """The model splits over the mesh: whole heads and equal vocabulary slices per device."""
    family.check_split(config, sizes, ("n_head",))
