"""GPT-2 as pure functions over a parameter pytree, on whichever kernels `ops` names.

    config = get_config("gpt2")                       # or GPT2Config(n_layer=..., ...)
    params = init(config, jax.random.key(0))          # float32 master weights
    logits = forward(params, tokens, config=config, ops=blujax.kernels, dtype=jnp.bfloat16)

`ops` is `blujax.kernels` (our FFI kernels) or `blujax.model.ops.XLA` (plain JAX); both have
layer_norm, add_layer_norm, gelu, attention and softmax_cross_entropy with one signature, so
the same model runs on either. Pre-LayerNorm blocks with a fused QKV projection, the token
embedding tied to the LM head, the vocabulary padded to a multiple of 128 (50304) so the head's
matrix product tiles evenly; the padded rows start at zero and no loss reaches them.

The layers' parameters are stacked along a leading axis; the blocks run under `lax.scan`, so
compile time does not grow with depth, or as a Python loop on a GPU (see `forward`). Each
residual add is fused into the LayerNorm after it (`add_layer_norm`): the carry is (residual
stream, the sublayer output not yet added).
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp

from blujax.kernels._util import match_vma


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int = 1024
    vocab_size: int = 50257
    padded_vocab_size: int = 50304

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"GPT2Config.{f.name} must be a positive int, got {v!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPT2Config: n_embd ({self.n_embd}) must be a multiple of n_head "
                             f"({self.n_head})")
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"GPT2Config: padded_vocab_size ({self.padded_vocab_size}) must be "
                             f">= vocab_size ({self.vocab_size})")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


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


def get_config(name: str) -> GPT2Config:
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; the presets are: {', '.join(PRESETS)}")
    return PRESETS[name]


def init(config: GPT2Config, key) -> dict:
    """GPT-2's initialization: normal(0.02) weights, residual projections normal(0.02 /
    sqrt(2 n_layer)), zero biases, unit LayerNorm scales. All float32."""
    return _init(config, key)


@partial(jax.jit, static_argnums=0)
def _init(config: GPT2Config, key) -> dict:
    L, C, std = config.n_layer, config.n_embd, 0.02
    proj_std = std / math.sqrt(2 * config.n_layer)
    k = jax.random.split(key, 6)

    def normal(key, shape, scale):
        return scale * jax.random.normal(key, shape, jnp.float32)

    def linear(key, n_in, n_out, scale):
        return {"w": normal(key, (L, n_in, n_out), scale), "b": jnp.zeros((L, n_out))}

    def norm():
        return {"w": jnp.ones((L, C)), "b": jnp.zeros((L, C))}

    wte = normal(k[0], (config.padded_vocab_size, C), std)
    wte = wte.at[config.vocab_size:].set(0.0)
    return {
        "wte": wte,
        "wpe": normal(k[1], (config.block_size, C), std),
        "blocks": {
            "ln1": norm(),
            "attn": linear(k[2], C, 3 * C, std),
            "attn_proj": linear(k[3], C, C, proj_std),
            "ln2": norm(),
            "mlp_fc": linear(k[4], C, 4 * C, std),
            "mlp_proj": linear(k[5], 4 * C, C, proj_std),
        },
        "ln_f": {"w": jnp.ones((C,)), "b": jnp.zeros((C,))},
    }


def decay_mask(params) -> dict:
    """True for the leaves AdamW decays: matrices and embeddings, not biases or LayerNorm."""
    def decays(path, _):
        names = [getattr(p, "key", None) for p in path]
        return names[-1] in ("wte", "wpe") or (names[-1] == "w" and "ln" not in names[-2])

    return jax.tree_util.tree_map_with_path(decays, params)


def num_params(params) -> int:
    return sum(x.size for x in jax.tree.leaves(params))


def flops_per_token(config: GPT2Config, seq_len: int) -> float:
    """Training FLOPs per token: 6 per weight of every matrix product (forward 2, backward 4;
    the LM head counted at the padded vocabulary), plus attention's two products in full
    (no halving for the causal mask): 12 * n_layer * seq_len * n_embd."""
    L, C = config.n_layer, config.n_embd
    matmul_weights = L * 12 * C * C + config.padded_vocab_size * C
    return 6.0 * matmul_weights + 12.0 * L * seq_len * C


def cast(params, dtype):
    return jax.tree.map(lambda x: x.astype(dtype), params)


def forward(params, tokens, *, config: GPT2Config, ops, dtype=jnp.float32, remat: bool = False,
            parallel=None, scan_layers: bool | None = None):
    """Logits [B, T, padded_vocab_size] in `dtype` for int tokens [B, T], T <= block_size.

    The float32 params are cast to `dtype` (bfloat16: mixed precision; the kernels keep their
    statistics in float32). remat=True recomputes each block's activations in the backward
    (`jax.checkpoint`) instead of keeping them.

    scan_layers: run the blocks under `lax.scan` (compile time independent of depth) or as a
    Python loop. None picks the loop on a GPU, where a scan costs copies around our custom
    calls (their operands and results are copied out of and into slices of the scan's stacked
    activations: 7% of a GPT-2 124M step), and the scan elsewhere. Both compute the same values.

    parallel: None on one device. Inside `shard_map`, a `blujax.sharding.Parallel`: the
    params and tokens are then this device's shards and the logits its block
    [B, T_local, padded_vocab_size / tensor] (see blujax/sharding/parallel.py).
    """
    check_tokens(tokens, config)
    par = ONE_DEVICE if parallel is None else parallel
    # Each layer's params are cast where the layer runs, after `par.share`: a parallel run may
    # hook its gradient reduction there, in float32, one layer at a time.
    p = cast(par.share({k: v for k, v in params.items() if k != "blocks"}), dtype)
    attend = par.attend(ops)
    block = partial(_block, n_head=config.n_head, ops=ops, attend=attend, par=par)

    def step(carry, layer):
        *carry, _ = block(cast(par.share(layer), dtype), *carry)
        return tuple(carry), None

    if remat:
        step = jax.checkpoint(step)
    if scan_layers is None:
        scan_layers = jax.default_backend() != "gpu"
    carry = start(*par.embed(p, tokens))
    if scan_layers:
        carry, _ = jax.lax.scan(step, carry, params["blocks"])
    else:
        for i in range(config.n_layer):
            carry, _ = step(carry, jax.tree.map(lambda x: x[i], params["blocks"]))
    return _head(p, *carry, ops, par)


def check_tokens(tokens, config: GPT2Config):
    if not hasattr(tokens, "ndim") or tokens.ndim != 2:
        raise ValueError(f"gpt2: tokens must be [batch, time], got shape "
                         f"{getattr(tokens, 'shape', type(tokens).__name__)}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"gpt2: tokens must be integers, got {tokens.dtype}")
    if not 1 <= tokens.shape[1] <= config.block_size:
        raise ValueError(f"gpt2: sequence length {tokens.shape[1]} is outside [1, "
                         f"{config.block_size}] (the model's block_size)")


def _embed(p, tokens, start=0):
    tok = jnp.take(p["wte"], tokens, axis=0)
    pos = jax.lax.dynamic_slice_in_dim(p["wpe"], start, tokens.shape[1])
    return tok, jnp.broadcast_to(pos, tok.shape)


class _OneDevice:
    """The hooks `forward` calls where a parallel run communicates; on one device, nothing.

    share: parameters (float32) as a layer takes them; embed: (token, position) embeddings;
    gather_matmul: a LayerNorm output times a column-parallel weight; matmul_reduce: a
    row-parallel product, its partial sums reduced; attend: the attention function, of the
    fused projection's qkv [B, T, 3, H, D].
    """

    @staticmethod
    def share(params):
        return params

    @staticmethod
    def embed(p, tokens):
        return _embed(p, tokens)

    @staticmethod
    def gather_matmul(x, w):
        return x @ w

    @staticmethod
    def matmul_reduce(x, w):
        return x @ w

    @staticmethod
    def attend(ops):
        return partial(_attend, ops)


ONE_DEVICE = _OneDevice()


def start(s, d):
    """The carry of the blocks from the embeddings: (s, d, d_bias) as `_block` takes it, with a
    zero bias for d (a fixed structure, as lax.scan needs; inside shard_map typed as varying
    like d, as the biases the blocks pass on are)."""
    return s, d, match_vma(jnp.zeros(d.shape[-1], d.dtype), d)[0]


def _head(p, s, d, d_bias, ops, par=ONE_DEVICE):
    h, _ = ops.add_layer_norm(d, s, p["ln_f"]["w"], p["ln_f"]["b"], x_bias=d_bias)
    return par.gather_matmul(h, p["wte"].T)


def _attend(ops, qkv):
    """Causal attention over qkv [B, T, 3, H, D]: (output, the layer's (k, v))."""
    return ops.attention_qkv(qkv, causal=True), (qkv[:, :, 1], qkv[:, :, 2])


def _block(layer, s, d, d_bias, *, n_head, ops, attend, par=ONE_DEVICE):
    """One transformer block. s: the residual stream so far; d + d_bias: the previous sublayer's
    output, still to be added to it (each output projection's bias is added in the LayerNorm
    after it, which saves a pass over the activations). Returns the new (s, d, d_bias) and what
    `attend` returned beside the attention output (the layer's k, v for a KV cache). Under
    tensor parallelism `par` gathers the sequence into each column-parallel product and reduces
    out of each row-parallel one; this device then holds n_head / tensor of the heads."""
    C = s.shape[-1]
    h, s = ops.add_layer_norm(d, s, layer["ln1"]["w"], layer["ln1"]["b"], x_bias=d_bias)
    qkv = par.gather_matmul(h, layer["attn"]["w"]) + layer["attn"]["b"]
    B, T, _ = qkv.shape
    qkv = qkv.reshape(B, T, 3, -1, C // n_head)
    a, kv = attend(qkv)
    a = par.matmul_reduce(a.reshape(B, T, -1), layer["attn_proj"]["w"])
    h, s = ops.add_layer_norm(a, s, layer["ln2"]["w"], layer["ln2"]["b"],
                              x_bias=layer["attn_proj"]["b"])
    f = ops.gelu(par.gather_matmul(h, layer["mlp_fc"]["w"]), layer["mlp_fc"]["b"])
    m = par.matmul_reduce(f, layer["mlp_proj"]["w"])
    return s, m, match_vma(layer["mlp_proj"]["b"], m)[0], kv
