"""Llama: pre-RMSNorm blocks without biases, grouped-query attention with rotary position
embeddings, a SwiGLU MLP, the token embedding tied to the LM head or not.

    config = PRESETS["llama-d12"]                     # or LlamaConfig(n_layer=..., ...)
    params = init(config, jax.random.key(0))          # float32 master weights
    logits = forward(params, tokens, config=config, ops=blujax.kernels, dtype=jnp.bfloat16)

n_kv_head key/value heads, each shared by n_head / n_kv_head consecutive query heads (as
Hugging Face's repeat_kv has it); rotary embeddings in Hugging Face's rotate_half convention,
with a configurable theta and Llama 3's frequency scaling; the MLP's gate and up projections
one [C, 2, F] weight. The vocabulary is padded to a multiple of 128 as GPT-2's is; trained
from scratch the model takes GPT-2's tokenizer. Each residual add is fused into the RMSNorm
after it (`add_rms_norm`): the carry between blocks is (the residual stream, the sublayer
output not yet added to it). The stack around the block is `blujax.model.stack`'s.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from blujax import vocab
from blujax.model import family, stack
from blujax.model.family import Param

NAME = "llama"
TITLE = "Llama"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(stack.Config):
    """The stack's fields, and: n_kv_head key/value heads, the MLP's hidden width ffn_hidden,
    RoPE's theta and scaling, the RMSNorm eps, whether the LM head is the embedding."""

    n_kv_head: int
    ffn_hidden: int
    rope_theta: float = 10000.0
    # Llama 3's frequency scaling (Hugging Face's rope_scaling of rope_type "llama3"):
    # (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings), or None.
    rope_scaling: tuple | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    def __post_init__(self):
        super().__post_init__()
        self.check(ints=("n_kv_head", "ffn_hidden"), numbers=("rope_theta", "norm_eps"))
        name = type(self).__name__
        if self.head_dim % 2:
            raise ValueError(f"{name}: n_embd ({self.n_embd}) must be n_head ({self.n_head}) "
                             f"heads of an even size")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"{name}: n_kv_head ({self.n_kv_head}) must divide n_head "
                             f"({self.n_head})")
        if self.rope_scaling is not None:
            # config.json gives a list back: keep the config hashable (jit takes it statically).
            object.__setattr__(self, "rope_scaling", tuple(self.rope_scaling))
            if len(self.rope_scaling) != 4:
                raise ValueError(f"{name}.rope_scaling must be (factor, low_freq_factor, "
                                 f"high_freq_factor, original_max_position_embeddings)")

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.n_head // self.n_kv_head


Config = LlamaConfig

PRESETS = {
    # CPU tests: heads of 64 (the GPU attention kernels' size), two query heads per KV head.
    "llama-tiny": LlamaConfig(n_layer=2, n_head=2, n_kv_head=1, n_embd=128, ffn_hidden=384,
                              block_size=128),
    # GPT-2 124M's size: 12 layers, 768 wide, 12 heads, 4 KV heads.
    "llama-d12": LlamaConfig(n_layer=12, n_head=12, n_kv_head=4, n_embd=768, ffn_hidden=2048),
    # Llama 3.2 1B's shape (on GPT-2's vocabulary unless imported).
    "llama-1b": LlamaConfig(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, ffn_hidden=8192,
                            block_size=2048, rope_theta=500000.0),
    # Llama 3 8B's shape (8,030,261,248 parameters): Meta's vocabulary (128256, a multiple of
    # 128 already), so that its weights import and the count is the 8B's; trained from scratch
    # it speaks GPT-2's tokenizer all the same (its ids fit; the rows above are never a
    # target). Llama 3's 8192-token context and theta, Llama 3.1's frequency scaling
    # (wavelengths past 8192 tokens slowed 8x, those under 2048 kept); an LM head of its own,
    # as Meta's 8B has (the small Llamas tie theirs). norm_eps: the default, Meta's 1e-5.
    "llama-8b": LlamaConfig(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, ffn_hidden=14336,
                            vocab_size=128256, padded_vocab_size=vocab.padded(128256),
                            block_size=8192, rope_theta=500000.0,
                            rope_scaling=(8.0, 1.0, 4.0, 8192), tie_embeddings=False),
}


def declare(config: LlamaConfig, key) -> dict:
    """Llama's parameters with their logical axes (family.Param): normal(0.02) weights, the
    output projections normal(0.02 / sqrt(2 n_layer)), unit RMSNorm scales, all float32; the
    padded vocabulary rows zero. The query projection's output axis is "heads" (n_head x
    head_dim), the key and value projections' "kv_heads" (n_kv_head x head_dim): split over
    devices, each gets whole heads, its query heads' own key/value heads among them; where
    n_kv_head does not divide by "tensor", the key/value heads stay whole (whole_axes)."""
    L, C, F, std = config.n_layer, config.n_embd, config.ffn_hidden, 0.02
    H, KV = config.n_head * config.head_dim, config.n_kv_head * config.head_dim
    proj_std = std / math.sqrt(2 * L)
    k = jax.random.split(key, 8)

    def normal(key, shape, scale, axes):
        return Param(scale * jax.random.normal(key, shape, jnp.float32), axes)

    def ones(shape, axes):
        return Param(jnp.ones(shape, jnp.float32), axes)

    def vocab_rows(key):
        p = normal(key, (config.padded_vocab_size, C), std, ("vocab", "embed"))
        return Param(p.value.at[config.vocab_size:].set(0.0), p.axes)

    params = {
        "wte": vocab_rows(k[0]),
        "blocks": {
            "attn_norm": ones((L, C), ("layers", "embed")),
            "wq": normal(k[1], (L, C, H), std, ("layers", "embed", "heads")),
            "wk": normal(k[2], (L, C, KV), std, ("layers", "embed", "kv_heads")),
            "wv": normal(k[3], (L, C, KV), std, ("layers", "embed", "kv_heads")),
            "wo": normal(k[4], (L, H, C), proj_std, ("layers", "heads", "embed")),
            "mlp_norm": ones((L, C), ("layers", "embed")),
            "w_gate_up": normal(k[5], (L, C, 2, F), std, ("layers", "embed", "gate_up", "mlp")),
            "w_down": normal(k[6], (L, F, C), proj_std, ("layers", "mlp", "embed")),
        },
        "norm_f": ones((C,), ("embed",)),
    }
    if not config.tie_embeddings:
        params["lm_head"] = vocab_rows(k[7])
    return params


# init(config, key): the values of declare's params (float32); logical_axes(config): their axes.
init, logical_axes = family.init_and_axes(declare)


def inv_freq(config: LlamaConfig) -> np.ndarray:
    """float64 [head_dim / 2]: the rotation frequency of each pair of a head's dimensions,
    theta^(-2i / D), with Llama 3's scaling where the config has it (as transformers'
    _compute_llama3_parameters: long wavelengths slowed by `factor`, short ones kept, a
    smooth blend between)."""
    D = config.head_dim
    freq = 1.0 / config.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D)
    if config.rope_scaling is None:
        return freq
    factor, low, high, original = config.rope_scaling
    wavelen = 2 * math.pi / freq
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * freq / factor + smooth * freq
    return np.where(wavelen > original / low, freq / factor,
                    np.where(wavelen < original / high, freq, blended))


def rope_tables(config: LlamaConfig):
    """(cos, sin) float32 [block_size, head_dim / 2] of every position's angles."""
    angles = np.outer(np.arange(config.block_size, dtype=np.float64), inv_freq(config))
    return jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)


def embed(p, tokens, *, config, par, start=0):
    """The first carry: an empty residual stream, the token embeddings still to be added (the
    first block's add_rms_norm adds them). Positions enter each block's rotary embedding."""
    tok = par.embed_tokens(p["wte"], tokens)
    return jnp.zeros_like(tok), tok


def block(layer, carry, *, config, ops, par, attend, rope):
    """One block on the carry (s, d): s the residual stream so far; d the previous sublayer's
    output, still to be added to it. rope: the (cos, sin) of the block's positions."""
    s, d = carry
    D, eps = config.head_dim, config.norm_eps
    # The norm, then one product for this device's query, key and value heads (one wide
    # matrix multiplies faster than three narrow ones), split with q and k turned in one pass
    # (rope_qkv).
    wq = layer["wq"]
    wqkv = jnp.concatenate([wq, layer["wk"], layer["wv"]], axis=-1)
    qkv, s = par.norm_matmul(ops, d, s, layer["attn_norm"], wqkv, "qkv", eps=eps)
    if "bq" in layer:  # biases on q, k and v where the family has them (Qwen2)
        qkv = qkv + jnp.concatenate([layer["bq"], layer["bk"], layer["bv"]], axis=-1)
    q, k, v = ops.rope_qkv(qkv.reshape(*qkv.shape[:2], -1, D), *rope, heads=wq.shape[-1] // D)
    a, kv = attend.heads(q, k, v)
    a = par.matmul_reduce(a.reshape(*a.shape[:2], -1), layer["wo"], "out")
    w = layer["w_gate_up"]  # [C, 2, F] (this device's F)
    m, s = par.norm_swiglu_mlp(ops, a, s, layer["mlp_norm"], w.reshape(w.shape[0], -1),
                               layer["w_down"], eps=eps)
    return (s, m), kv


def norm(p, carry, *, config, ops):
    s, d = carry
    return ops.add_rms_norm(d, s, p["norm_f"], eps=config.norm_eps)[0]


def head_weight(p):
    return p["lm_head"] if "lm_head" in p else p["wte"]


DECODER = stack.Decoder(NAME, embed=embed, block=block, norm=norm, head_weight=head_weight,
                        rope=rope_tables)
forward, hidden, head = DECODER.forward, DECODER.hidden, DECODER.head
prefill, decode, check_tokens = DECODER.prefill, DECODER.decode, DECODER.check_tokens

# The vectors AdamW leaves alone: the RMSNorm scales, and the q/k/v biases of a family that
# has them (Qwen2).
NO_DECAY = ("attn_norm", "mlp_norm", "norm_f", "bq", "bk", "bv")


def decay_mask(params) -> dict:
    """True for the leaves AdamW decays: matrices and embeddings, not norm scales or biases."""
    def decays(path, _):
        return getattr(path[-1], "key", None) not in NO_DECAY

    return jax.tree_util.tree_map_with_path(decays, params)


def flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 per weight of every matrix product (the tied embedding
    counted once, as the LM head, at the padded vocabulary), plus attention's two products in
    full: 12 * n_layer * seq_len * n_embd."""
    L, C, F, D = config.n_layer, config.n_embd, config.ffn_hidden, config.head_dim
    per_layer = C * (config.n_head + 2 * config.n_kv_head) * D + config.n_head * D * C + 3 * C * F
    head = config.padded_vocab_size * C
    return 6.0 * (L * per_layer + head) + 12.0 * L * seq_len * C


def check_mesh(config, sizes: dict[str, int]) -> None:
    """The model splits over the mesh: whole query heads per device (n_head divisible by
    "tensor"; the key/value heads split with them where n_kv_head divides too, else replicated:
    whole_axes), equal vocabulary slices."""
    family.check_split(config, sizes, ("n_head",))


def whole_axes(config, sizes: dict[str, int]) -> tuple[str, ...]:
    """The logical axes kept whole on a mesh of these sizes: "kv_heads" where n_kv_head does
    not divide by "tensor". Then wk and wv are replicated over "tensor", every device computes
    all the key/value heads, and its attention (sharding.Parallel.attention) uses those of its
    query heads; their gradients are summed over "tensor"."""
    return ("kv_heads",) if config.n_kv_head % sizes["tensor"] else ()
