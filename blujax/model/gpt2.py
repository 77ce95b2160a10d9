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

This module is a model family (blujax/model/family.py): the train step, sharding, sampling,
evaluation and interop reach GPT-2 through the names that file lists.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from blujax.kernels._util import match_vma
from blujax.model import family
from blujax.model.family import ONE_DEVICE, Param

NAME = "gpt2"
TITLE = "GPT-2"  # how messages name the family


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


def get_config(name: str) -> GPT2Config:
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; the presets are: {', '.join(PRESETS)}")
    return PRESETS[name]


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


def check_mesh(config, sizes: dict[str, int]) -> None:
    """The model splits over the mesh: whole heads and equal vocabulary slices per device."""
    family.check_split(config, sizes, ("n_head",))


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
    activations), and the scan elsewhere. Both compute the same values.

    parallel: None on one device. Inside `shard_map`, a `blujax.sharding.Parallel`: the
    params and tokens are then this device's shards and the logits its block
    [B, T_local, padded_vocab_size / tensor] (see blujax/sharding/parallel.py).
    """
    par = ONE_DEVICE if parallel is None else parallel
    p, carry = _blocks(params, tokens, config=config, ops=ops, dtype=dtype, remat=remat,
                       par=par, scan_layers=scan_layers)
    return _head(p, *carry, ops, par)


def hidden(params, tokens, *, config: GPT2Config, ops, dtype=jnp.float32,
           scan_layers: bool | None = None):
    """The final LayerNorm's output [B, T, C] in `dtype` (one device): `forward` without the
    LM head, for work that needs logits at some positions only (`head`)."""
    p, (s, d, d_bias) = _blocks(params, tokens, config=config, ops=ops, dtype=dtype,
                                remat=False, par=ONE_DEVICE, scan_layers=scan_layers)
    return ops.add_layer_norm(d, s, p["ln_f"]["w"], p["ln_f"]["b"], x_bias=d_bias)[0]


def head(params, h, *, dtype=jnp.float32):
    """Logits [..., padded_vocab_size] of hidden states h [..., C] (the tied embedding)."""
    return h.astype(dtype) @ params["wte"].astype(dtype).T


def _blocks(params, tokens, *, config, ops, dtype, remat, par, scan_layers):
    """(the non-block params in dtype, the carry (s, d, d_bias) after the last block)."""
    check_tokens(tokens, config)
    # Each layer's params are cast where the layer runs, after `par.share`: a parallel run may
    # hook its gradient reduction there, in float32, one layer at a time.
    p = cast(par.share({k: v for k, v in params.items() if k != "blocks"}), dtype)
    block = partial(_block, head_dim=config.head_dim, ops=ops, attend=par.attend(ops), par=par)

    def step(carry, layer):
        *carry, _ = block(cast(par.share(layer), dtype), *carry)
        return tuple(carry), None

    if remat:
        step = jax.checkpoint(step)
    if scan_layers is None:
        scan_layers = jax.default_backend() != "gpu"
    carry = start(*_embed(p, tokens, par))
    if scan_layers:
        carry, _ = jax.lax.scan(step, carry, params["blocks"])
    else:
        for i in range(config.n_layer):
            carry, _ = step(carry, jax.tree.map(lambda x: x[i], params["blocks"]))
    return p, carry


def check_tokens(tokens, config):
    family.check_tokens("gpt2", tokens, config.block_size)


def _embed(p, tokens, par, start=0):
    """(token, position) embeddings [B, T, C] of this device's tokens."""
    tok = par.embed_tokens(p["wte"], tokens)
    pos = par.at_positions(p["wpe"], tokens.shape[1], start)
    return tok, jnp.broadcast_to(pos, tok.shape)


def start(s, d):
    """The carry of the blocks from the embeddings: (s, d, d_bias) as `_block` takes it, with a
    zero bias for d (a fixed structure, as lax.scan needs; inside shard_map typed as varying
    like d, as the biases the blocks pass on are)."""
    return s, d, match_vma(jnp.zeros(d.shape[-1], d.dtype), d)[0]


def _head(p, s, d, d_bias, ops, par=ONE_DEVICE):
    h, _ = ops.add_layer_norm(d, s, p["ln_f"]["w"], p["ln_f"]["b"], x_bias=d_bias)
    return par.gather_matmul(h, p["wte"].T)


def _block(layer, s, d, d_bias, *, head_dim, ops, attend, par=ONE_DEVICE):
    """One transformer block. s: the residual stream so far; d + d_bias: the previous sublayer's
    output, still to be added to it (each output projection's bias is added in the LayerNorm
    after it, which saves a pass over the activations). Returns the new (s, d, d_bias) and what
    `attend` returned beside the attention output (the layer's k, v for a KV cache). Under
    tensor parallelism `par` gathers the sequence into each column-parallel product and reduces
    out of each row-parallel one; this device then holds its share of the heads."""
    h, s = ops.add_layer_norm(d, s, layer["ln1"]["w"], layer["ln1"]["b"], x_bias=d_bias)
    w, b = layer["attn"]["w"], layer["attn"]["b"]  # [C, 3, H * D] (this device's heads)
    qkv = par.gather_matmul(h, w.reshape(w.shape[0], -1)) + b.reshape(-1)
    B, T, _ = qkv.shape
    qkv = qkv.reshape(B, T, 3, -1, head_dim)
    a, kv = attend(qkv)
    a = par.matmul_reduce(a.reshape(B, T, -1), layer["attn_proj"]["w"])
    h, s = ops.add_layer_norm(a, s, layer["ln2"]["w"], layer["ln2"]["b"],
                              x_bias=layer["attn_proj"]["b"])
    f = ops.gelu(par.gather_matmul(h, layer["mlp_fc"]["w"]), layer["mlp_fc"]["b"])
    m = par.matmul_reduce(f, layer["mlp_proj"]["w"])
    return s, m, match_vma(layer["mlp_proj"]["b"], m)[0], kv


# --------------------------------------------------------------------------------------------
# Sampling with a KV cache: the prompt runs through the model once and leaves each layer's keys
# and values in a cache of the final length; every new token then costs one position's work.


def prefill(params, prompt, *, config: GPT2Config, ops, dtype, length: int):
    """(logits [B, padded_vocab] of the prompt's last position, the cache: each layer's k and
    v [L, B, length, H, D], the prompt's positions filled)."""
    check_tokens(prompt, config)
    p = cast(params, dtype)
    P = prompt.shape[1]

    def layer_step(carry, layer):
        *carry, (k, v) = _block(layer, *carry, head_dim=config.head_dim, ops=ops,
                                 attend=ONE_DEVICE.attend(ops))
        pad = ((0, 0), (0, length - P), (0, 0), (0, 0))
        return tuple(carry), (jnp.pad(k, pad), jnp.pad(v, pad))

    (s, d, d_bias), cache = jax.lax.scan(layer_step, start(*_embed(p, prompt, ONE_DEVICE)),
                                         p["blocks"])
    return _head(p, s[:, -1:], d[:, -1:], d_bias, ops)[:, 0], cache


def decode(params, tokens, at, cache, *, config: GPT2Config, ops, dtype):
    """(logits [B, padded_vocab] after tokens [B] at position `at`, the cache with their k, v
    stored)."""
    p = cast(params, dtype)
    x, pos = _embed(p, tokens[:, None], ONE_DEVICE, start=at)

    def layer_step(carry, xs):
        layer, ck, cv = xs
        *carry, kv = _block(layer, *carry, head_dim=config.head_dim, ops=ops,
                            attend=partial(_attend_cached, ck, cv, at))
        return tuple(carry), kv

    carry, cache = jax.lax.scan(layer_step, start(pos, x), (p["blocks"], *cache))
    return _head(p, *carry, ops)[:, 0], cache


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


# --------------------------------------------------------------------------------------------
# Other tools' layouts: Hugging Face's GPT2LMHeadModel and llm.c's model file. Pure functions
# between our params and named numpy arrays; the files are read and written by blujax.interop.
# They raise ValueError with a one-line message for what our model cannot represent.
#
# transformers keeps one tensor per layer ("h.{i}.attn.c_attn.weight") and its Conv1D weights
# are (in, out), as ours. llm.c stacks each kind over the layers, as we do, in torch Linear's
# (out, in). Both keep the vocabulary unpadded in their config; llm.c pads the file's rows.

# Our GELU is the tanh approximation; transformers has it under these two names.
HF_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
# The eps every LayerNorm of `forward` uses (the kernels' default).
LAYER_NORM_EPS = 1e-5
GPT2_VOCAB_SIZE = 50257
GPT2_EOT = 50256

# Our (sublayer, leaf) -> transformers' name inside "h.{i}.".
_HF_LAYER = {
    ("ln1", "w"): "ln_1.weight", ("ln1", "b"): "ln_1.bias",
    ("attn", "w"): "attn.c_attn.weight", ("attn", "b"): "attn.c_attn.bias",
    ("attn_proj", "w"): "attn.c_proj.weight", ("attn_proj", "b"): "attn.c_proj.bias",
    ("ln2", "w"): "ln_2.weight", ("ln2", "b"): "ln_2.bias",
    ("mlp_fc", "w"): "mlp.c_fc.weight", ("mlp_fc", "b"): "mlp.c_fc.bias",
    ("mlp_proj", "w"): "mlp.c_proj.weight", ("mlp_proj", "b"): "mlp.c_proj.bias",
}
# llm.c's parameter order (train_gpt2.c: fill_in_parameter_sizes) as paths into our params;
# its matrices are transposed against ours.
_LLMC_ORDER = (
    ("wte",), ("wpe",),
    *(("blocks", sub, leaf) for sub, leaf in (
        ("ln1", "w"), ("ln1", "b"), ("attn", "w"), ("attn", "b"), ("attn_proj", "w"),
        ("attn_proj", "b"), ("ln2", "w"), ("ln2", "b"), ("mlp_fc", "w"), ("mlp_fc", "b"),
        ("mlp_proj", "w"), ("mlp_proj", "b"))),
    ("ln_f", "w"), ("ln_f", "b"),
)


def padded_vocab(vocab_size: int, multiple: int = 128) -> int:
    """The vocabulary rounded up to a multiple of 128, as ours and llm.c's (50257 -> 50304)."""
    return -(-vocab_size // multiple) * multiple


def config_from_hf(hf: dict) -> GPT2Config:
    """Our config from a transformers GPT2Config dict (config.json); ValueError for a field our
    model cannot honour."""
    act = hf.get("activation_function", "gelu_new")
    if act not in HF_ACTIVATIONS:
        raise ValueError(f"activation_function {act!r} is not supported: blujax's GELU is the "
                         f"tanh approximation ({' or '.join(HF_ACTIVATIONS)})")
    eps = hf.get("layer_norm_epsilon", LAYER_NORM_EPS)
    if eps != LAYER_NORM_EPS:
        raise ValueError(f"layer_norm_epsilon {eps!r} is not supported: blujax's LayerNorm "
                         f"uses {LAYER_NORM_EPS}")
    for key, ours in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("reorder_and_upcast_attn", False), ("add_cross_attention", False)):
        if bool(hf.get(key, ours)) != ours:
            raise ValueError(f"{key} = {hf.get(key)!r} is not supported (blujax's GPT-2 has "
                             f"{key} = {ours})")
    for key in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size"):
        if not isinstance(hf.get(key), int) or isinstance(hf.get(key), bool):
            raise ValueError(f"{key} must be an int, got {hf.get(key)!r}")
    inner = hf.get("n_inner")
    if inner is not None and inner != 4 * hf["n_embd"]:
        raise ValueError(f"n_inner {inner!r} is not supported: blujax's MLP is 4 * n_embd "
                         f"({4 * hf['n_embd']}) wide")
    if hf.get("tie_word_embeddings", True) is False:
        raise ValueError("tie_word_embeddings is false: blujax ties the LM head to the token "
                         "embedding")
    return GPT2Config(n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=hf["n_embd"],
                      block_size=hf["n_positions"], vocab_size=hf["vocab_size"],
                      padded_vocab_size=padded_vocab(hf["vocab_size"]))


def hf_config(config: GPT2Config) -> dict:
    """config.json for transformers' GPT2LMHeadModel holding our model (the vocabulary
    unpadded)."""
    gpt2_vocab = config.vocab_size == GPT2_VOCAB_SIZE
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_ctx": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": LAYER_NORM_EPS,
        # Ours trains without dropout; so does the exported model, unless a user sets these.
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": GPT2_EOT if gpt2_vocab else None,
        "eos_token_id": GPT2_EOT if gpt2_vocab else None,
        "torch_dtype": "float32",
    }


def hf_tensor_names(config: GPT2Config) -> list[str]:
    """GPT2LMHeadModel's parameter names (without the "transformer." prefix), ours all."""
    layer = [f"h.{i}.{name}" for i in range(config.n_layer) for name in _HF_LAYER.values()]
    return ["wte.weight", "wpe.weight", *layer, "ln_f.weight", "ln_f.bias"]


def to_hf(params, config: GPT2Config) -> dict:
    """Our params as GPT2LMHeadModel's state dict, float32 numpy, keyed as save_pretrained
    keys them ("transformer.h.0.ln_1.weight"; the tied lm_head.weight left out, as it does)."""
    p = _fused_qkv(_numpy(params, config))
    out = {"wte.weight": p["wte"][:config.vocab_size], "wpe.weight": p["wpe"],
           "ln_f.weight": p["ln_f"]["w"], "ln_f.bias": p["ln_f"]["b"]}
    for (sub, leaf), name in _HF_LAYER.items():
        for i in range(config.n_layer):
            out[f"h.{i}.{name}"] = p["blocks"][sub][leaf][i]
    return {f"transformer.{k}": np.ascontiguousarray(v) for k, v in out.items()}


def _hf_buffer(name: str) -> bool:
    # The causal mask transformers once saved with the weights; not a parameter.
    parts = name.split(".")
    return (len(parts) == 4 and parts[0] == "h" and parts[2] == "attn"
            and parts[3] in ("bias", "masked_bias"))


def from_hf(tensors: dict, config: GPT2Config) -> dict:
    """Our params (float32 numpy, padded rows zero) from GPT2LMHeadModel's tensors, named with or
    without the "transformer." prefix. Buffers (attn.bias, attn.masked_bias) are ignored; a
    lm_head.weight must equal the embedding (ours is tied)."""
    t = {}
    for key, value in tensors.items():
        name = key.removeprefix("transformer.")
        if name in t:
            raise ValueError(f"tensor {name} appears both with and without 'transformer.'")
        if not _hf_buffer(name):
            t[name] = value
    expected = {"wte.weight": (config.vocab_size, config.n_embd),
                "wpe.weight": (config.block_size, config.n_embd)}
    want = _fused_shapes(config)
    for (sub, leaf), name in _HF_LAYER.items():
        for i in range(config.n_layer):
            expected[f"h.{i}.{name}"] = want["blocks"][sub][leaf][1:]
    expected["ln_f.weight"] = expected["ln_f.bias"] = (config.n_embd,)
    head = t.pop("lm_head.weight", None)
    for name in expected:
        if name not in t:
            raise ValueError(f"tensor {name} is missing")
    for name in t:
        if name not in expected:
            raise ValueError(f"unexpected tensor {name}: not part of GPT2LMHeadModel as "
                             f"blujax reads it")
    for name, shape in expected.items():
        if tuple(t[name].shape) != shape:
            raise ValueError(f"tensor {name} has shape {tuple(t[name].shape)}, but the config "
                             f"implies {shape}")
    t = {k: np.asarray(v, dtype=np.float32) for k, v in t.items()}
    if head is not None and not np.array_equal(np.asarray(head, np.float32), t["wte.weight"]):
        raise ValueError("lm_head.weight differs from wte.weight (an untied LM head): blujax "
                         "ties the head to the token embedding")
    wte = np.zeros((config.padded_vocab_size, config.n_embd), np.float32)
    wte[:config.vocab_size] = t["wte.weight"]
    blocks = {sub: {} for sub, _ in _HF_LAYER}
    for (sub, leaf), name in _HF_LAYER.items():
        blocks[sub][leaf] = np.stack([t[f"h.{i}.{name}"] for i in range(config.n_layer)])
    return _split_qkv({"wte": wte, "wpe": t["wpe.weight"], "blocks": blocks,
                       "ln_f": {"w": t["ln_f.weight"], "b": t["ln_f.bias"]}})


def llmc_shapes(config: GPT2Config) -> list[tuple[int, ...]]:
    """The shapes of llm.c's 16 parameter tensors, in its order (wte has padded_vocab_size
    rows)."""
    want = _fused_shapes(config)
    return [_llmc_layout(_at(want, path)) for path in _LLMC_ORDER]


def _llmc_layout(x):
    """A stacked matrix (L, in, out) as llm.c's (L, out, in) (its own inverse); others as are."""
    if isinstance(x, tuple):
        return (x[0], x[2], x[1]) if len(x) == 3 else x
    return np.ascontiguousarray(x.transpose(0, 2, 1)) if x.ndim == 3 else x


def _at(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def to_llmc(params, config: GPT2Config) -> list:
    """Our params as llm.c's 16 tensors in its order: float32 numpy, matrices (out, in), the
    embedding with its padded_vocab_size rows."""
    p = _fused_qkv(_numpy(params, config))
    return [np.ascontiguousarray(_llmc_layout(_at(p, path))) for path in _LLMC_ORDER]


def from_llmc(arrays, config: GPT2Config) -> dict:
    """Our params from llm.c's 16 tensors in its order (see `llmc_shapes`; its embedding may be
    padded to any number of rows >= vocab_size: the rows past vocab_size are dropped and ours
    padded with zeros)."""
    arrays = list(arrays)
    shapes = llmc_shapes(config)
    if len(arrays) != len(shapes):
        raise ValueError(f"llm.c's GPT-2 has {len(shapes)} tensors, got {len(arrays)}")
    params = {}
    for path, x, shape in zip(_LLMC_ORDER, arrays, shapes):
        x = np.asarray(x, np.float32)
        if path == ("wte",):
            if x.ndim != 2 or x.shape[0] < config.vocab_size or x.shape[1] != config.n_embd:
                raise ValueError(f"wte has shape {x.shape}, expected (>= {config.vocab_size}, "
                                 f"{config.n_embd})")
            x, rows = np.zeros(shape, np.float32), x
            x[:config.vocab_size] = rows[:config.vocab_size]
        elif x.shape != shape:
            raise ValueError(f"{'.'.join(path)} has shape {x.shape}, expected {shape}")
        node = params
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = _llmc_layout(x)
    return _split_qkv(params)


def _shapes(config: GPT2Config) -> dict:
    """Our parameter shapes, as `init` makes them."""
    return jax.tree.map(lambda x: tuple(x.shape),
                        jax.eval_shape(lambda k: init(config, k), jax.random.key(0)))


def _fused_shapes(config: GPT2Config) -> dict:
    """The shapes in the layout both other tools use: q, k and v fused in one axis, the QKV
    weight [L, C, 3C] and bias [L, 3C] (ours keep the 3 apart: [L, C, 3, C], [L, 3, C])."""
    shapes = _shapes(config)
    attn = shapes["blocks"]["attn"]
    fused = {"w": (*attn["w"][:-2], 3 * attn["w"][-1]), "b": (attn["b"][0], 3 * attn["b"][-1])}
    return {**shapes, "blocks": {**shapes["blocks"], "attn": fused}}


def legacy_params(params: dict) -> dict:
    """params in the layout of blujax checkpoints written before the QKV projection's q, k and
    v had an axis of their own (before 2026-11-26): weight [L, C, 3C], bias [L, 3C]."""
    return _fused_qkv(params)


def upgrade_params(params: dict) -> dict:
    """The inverse of legacy_params: such a checkpoint's params in today's layout."""
    return _split_qkv(params)


def _fused_qkv(p: dict) -> dict:
    """Params (numpy or jax) with the QKV weight and bias in the fused layout (_fused_shapes)."""
    attn = p["blocks"]["attn"]
    fused = {k: v.reshape(*v.shape[:-2], -1) for k, v in attn.items()}
    return {**p, "blocks": {**p["blocks"], "attn": fused}}


def _split_qkv(p: dict) -> dict:
    """The inverse of _fused_qkv: our layout from the fused one."""
    attn = p["blocks"]["attn"]
    split3 = {k: v.reshape(*v.shape[:-1], 3, v.shape[-1] // 3) for k, v in attn.items()}
    return {**p, "blocks": {**p["blocks"], "attn": split3}}


def _numpy(params, config: GPT2Config) -> dict:
    """params as float32 numpy, checked against config's shapes."""
    want = jax.tree_util.tree_flatten_with_path(_shapes(config), is_leaf=_is_shape)[0]
    got = jax.tree_util.tree_flatten_with_path(params)[0]
    if [k for k, _ in got] != [k for k, _ in want]:
        raise ValueError(f"the params are not GPT-2's: their leaves are "
                         f"{[jax.tree_util.keystr(k) for k, _ in got]}")
    for (path, x), (_, shape) in zip(got, want):
        if tuple(np.shape(x)) != shape:
            raise ValueError(f"params{jax.tree_util.keystr(path)} has shape {np.shape(x)}, "
                             f"but the config implies {shape}")
    return jax.tree.map(lambda x: np.asarray(x, np.float32), params)


def _is_shape(x):
    return isinstance(x, tuple)
