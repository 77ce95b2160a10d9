"""Llama as pure functions over a parameter pytree, on whichever kernels `ops` names.

    config = get_config("llama-d12")                  # or LlamaConfig(n_layer=..., ...)
    params = init(config, jax.random.key(0))          # float32 master weights
    logits = forward(params, tokens, config=config, ops=blujax.kernels, dtype=jnp.bfloat16)

Pre-RMSNorm blocks without biases; grouped-query attention (n_kv_head key/value heads, each
shared by n_head / n_kv_head consecutive query heads, as Hugging Face's repeat_kv has it) with
rotary position embeddings (Hugging Face's rotate_half convention, a configurable theta and
Llama 3's frequency scaling); a SwiGLU MLP whose gate and up projections are one [C, 2, F]
weight; the token embedding tied to the LM head or not. The vocabulary is padded to a multiple
of 128 as GPT-2's is; trained from scratch the model takes GPT-2's tokenizer.

As in gpt2.py, the layers' parameters are stacked along a leading axis and run under lax.scan
(or a Python loop on a GPU), and each residual add is fused into the RMSNorm after it
(`add_rms_norm`): the carry is (residual stream, the sublayer output not yet added). This
module is a model family (blujax/model/family.py).
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from blujax.model import family
from blujax.model.family import ONE_DEVICE, Param

NAME = "llama"
TITLE = "Llama"


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    ffn_hidden: int
    block_size: int = 1024
    vocab_size: int = 50257
    padded_vocab_size: int = 50304
    rope_theta: float = 10000.0
    # Llama 3's frequency scaling (Hugging Face's rope_scaling of rope_type "llama3"):
    # (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings), or None.
    rope_scaling: tuple | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_kv_head", "n_embd", "ffn_hidden", "block_size",
                     "vocab_size", "padded_vocab_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {v!r}")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"LlamaConfig: n_embd ({self.n_embd}) must be n_head "
                             f"({self.n_head}) heads of an even size")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"LlamaConfig: n_kv_head ({self.n_kv_head}) must divide n_head "
                             f"({self.n_head})")
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"LlamaConfig: padded_vocab_size ({self.padded_vocab_size}) must "
                             f"be >= vocab_size ({self.vocab_size})")
        for name in ("rope_theta", "norm_eps"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 \
                    or not math.isfinite(v):
                raise ValueError(f"LlamaConfig.{name} must be a positive number, got {v!r}")
        if self.rope_scaling is not None:
            # config.json gives a list back: keep the config hashable (jit takes it statically).
            object.__setattr__(self, "rope_scaling", tuple(self.rope_scaling))
            if len(self.rope_scaling) != 4:
                raise ValueError("LlamaConfig.rope_scaling must be (factor, low_freq_factor, "
                                 "high_freq_factor, original_max_position_embeddings)")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

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
}


def get_config(name: str) -> LlamaConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; the presets are: {', '.join(PRESETS)}")
    return PRESETS[name]


def declare(config: LlamaConfig, key) -> dict:
    """Llama's parameters with their logical axes (family.Param): normal(0.02) weights, the
    output projections normal(0.02 / sqrt(2 n_layer)), unit RMSNorm scales, all float32; the
    padded vocabulary rows zero. The query projection's output axis is "heads" (n_head x
    head_dim), the key and value projections' "kv_heads" (n_kv_head x head_dim): split over
    devices, each gets whole heads, its query heads' own key/value heads among them; where
    n_kv_head does not divide by "tensor", the key/value heads stay whole (whole_axes)."""
    L, C, F, std = config.n_layer, config.n_embd, config.ffn_hidden, 0.02
    D = config.head_dim
    proj_std = std / math.sqrt(2 * L)
    k = jax.random.split(key, 8)

    def normal(key, shape, scale, axes):
        return Param(scale * jax.random.normal(key, shape, jnp.float32), axes)

    def norm(shape, axes):
        return Param(jnp.ones(shape, jnp.float32), axes)

    def vocab_rows(key):
        p = normal(key, (config.padded_vocab_size, C), std, ("vocab", "embed"))
        return Param(p.value.at[config.vocab_size:].set(0.0), p.axes)

    params = {
        "wte": vocab_rows(k[0]),
        "blocks": {
            "attn_norm": norm((L, C), ("layers", "embed")),
            "wq": normal(k[1], (L, C, config.n_head * D), std, ("layers", "embed", "heads")),
            "wk": normal(k[2], (L, C, config.n_kv_head * D), std,
                         ("layers", "embed", "kv_heads")),
            "wv": normal(k[3], (L, C, config.n_kv_head * D), std,
                         ("layers", "embed", "kv_heads")),
            "wo": normal(k[4], (L, config.n_head * D, C), proj_std, ("layers", "heads", "embed")),
            "mlp_norm": norm((L, C), ("layers", "embed")),
            "w_gate_up": normal(k[5], (L, C, 2, F), std, ("layers", "embed", "gate_up", "mlp")),
            "w_down": normal(k[6], (L, F, C), proj_std, ("layers", "mlp", "embed")),
        },
        "norm_f": norm((C,), ("embed",)),
    }
    if not config.tie_embeddings:
        params["lm_head"] = vocab_rows(k[7])
    return params


# init(config, key): the values of declare's params (float32); logical_axes(config): their axes.
init, logical_axes = family.init_and_axes(declare)


def decay_mask(params) -> dict:
    """True for the leaves AdamW decays: matrices and embeddings, not the RMSNorm scales."""
    def decays(path, _):
        return getattr(path[-1], "key", None) not in ("attn_norm", "mlp_norm", "norm_f")

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
    all the key/value heads, and its attention (sharding.Parallel.attend_heads) uses those of
    its query heads; their gradients are summed over "tensor"."""
    return ("kv_heads",) if config.n_kv_head % sizes["tensor"] else ()


def check_tokens(tokens, config):
    family.check_tokens("llama", tokens, config.block_size)


def cast(params, dtype):
    return jax.tree.map(lambda x: x.astype(dtype), params)


# --------------------------------------------------------------------------------------------
# Rotary position embedding


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


# --------------------------------------------------------------------------------------------
# The forward


def forward(params, tokens, *, config: LlamaConfig, ops, dtype=jnp.float32, remat: bool = False,
            parallel=None, scan_layers: bool | None = None):
    """Logits [B, T, padded_vocab_size] in `dtype` for int tokens [B, T], T <= block_size.
    The arguments as gpt2.forward's (inside shard_map, `parallel` the device's hooks and the
    logits its block [B, T_local, padded_vocab_size / tensor])."""
    par = ONE_DEVICE if parallel is None else parallel
    p, (s, d) = _blocks(params, tokens, config=config, ops=ops, dtype=dtype, remat=remat,
                        par=par, scan_layers=scan_layers)
    h, _ = ops.add_rms_norm(d, s, p["norm_f"], eps=config.norm_eps)
    return par.gather_matmul(h, _head_weight(p).T)


def hidden(params, tokens, *, config: LlamaConfig, ops, dtype=jnp.float32,
           scan_layers: bool | None = None):
    """The final RMSNorm's output [B, T, C] in `dtype` (one device)."""
    p, (s, d) = _blocks(params, tokens, config=config, ops=ops, dtype=dtype, remat=False,
                        par=ONE_DEVICE, scan_layers=scan_layers)
    return ops.add_rms_norm(d, s, p["norm_f"], eps=config.norm_eps)[0]


def head(params, h, *, dtype=jnp.float32):
    """Logits [..., padded_vocab_size] of hidden states h [..., C]."""
    return h.astype(dtype) @ _head_weight(params).astype(dtype).T


def _head_weight(p):
    return p["lm_head"] if "lm_head" in p else p["wte"]


def _blocks(params, tokens, *, config, ops, dtype, remat, par, scan_layers):
    """(the non-block params in dtype, the carry (s, d) after the last block)."""
    check_tokens(tokens, config)
    p = cast(par.share({k: v for k, v in params.items() if k != "blocks"}), dtype)
    # q and k hold this device's whole (context) sequence, gathered over "tensor".
    cos, sin = (par.at_gathered_positions(t, tokens.shape[1]) for t in rope_tables(config))
    block = partial(_block, config=config, ops=ops, attend=par.attend_heads(ops), par=par,
                    cos=cos, sin=sin)

    def step(carry, layer):
        *carry, _ = block(cast(par.share(layer), dtype), *carry)
        return tuple(carry), None

    if remat:
        step = jax.checkpoint(step)
    if scan_layers is None:
        scan_layers = jax.default_backend() != "gpu"
    carry = _start(par.embed_tokens(p["wte"], tokens))
    if scan_layers:
        carry, _ = jax.lax.scan(step, carry, params["blocks"])
    else:
        for i in range(config.n_layer):
            carry, _ = step(carry, jax.tree.map(lambda x: x[i], params["blocks"]))
    return p, carry


def _start(tok):
    """The blocks' carry (s, d): an empty residual stream, the embeddings still to be added
    (the first block's add_rms_norm adds them)."""
    return jnp.zeros_like(tok), tok


def _block(layer, s, d, *, config, ops, attend, par, cos, sin):
    """One block: (s, d) -> (s, d, the layer's (k, v) as `attend` returned them). s: the
    residual stream so far; d: the previous sublayer's output, still to be added to it."""
    D, eps = config.head_dim, config.norm_eps
    h, s = ops.add_rms_norm(d, s, layer["attn_norm"], eps=eps)
    # One product for this device's query, key and value heads (one wide matrix multiplies
    # faster than three narrow ones), split with q and k turned in one pass (rope_qkv).
    wq = layer["wq"]
    qkv = par.gather_matmul(h, jnp.concatenate([wq, layer["wk"], layer["wv"]], axis=-1))
    q, k, v = ops.rope_qkv(qkv.reshape(*qkv.shape[:2], -1, D), cos, sin,
                           heads=wq.shape[-1] // D)
    a, kv = attend(q, k, v)
    a = par.matmul_reduce(a.reshape(*a.shape[:2], -1), layer["wo"])
    h, s = ops.add_rms_norm(a, s, layer["mlp_norm"], eps=eps)
    w = layer["w_gate_up"]  # [C, 2, F] (this device's F)
    g = par.gather_matmul(h, w.reshape(w.shape[0], -1))
    m = par.matmul_reduce(ops.swiglu(g.reshape(*g.shape[:2], 2, -1)), layer["w_down"])
    return s, m, kv


# --------------------------------------------------------------------------------------------
# Sampling with a KV cache that stores only the key/value heads.


def prefill(params, prompt, *, config: LlamaConfig, ops, dtype, length: int):
    """(logits [B, padded_vocab] of the prompt's last position, the cache: each layer's k and
    v [L, B, length, n_kv_head, D], the prompt's positions filled)."""
    check_tokens(prompt, config)
    p = cast(params, dtype)
    P = prompt.shape[1]
    cos, sin = (t[:P] for t in rope_tables(config))

    def layer_step(carry, layer):
        *carry, (k, v) = _block(layer, *carry, config=config, ops=ops, cos=cos, sin=sin,
                                attend=ONE_DEVICE.attend_heads(ops), par=ONE_DEVICE)
        pad = ((0, 0), (0, length - P), (0, 0), (0, 0))
        return tuple(carry), (jnp.pad(k, pad), jnp.pad(v, pad))

    (s, d), cache = jax.lax.scan(layer_step, _start(jnp.take(p["wte"], prompt, axis=0)),
                                 p["blocks"])
    h, _ = ops.add_rms_norm(d[:, -1:], s[:, -1:], p["norm_f"], eps=config.norm_eps)
    return (h @ _head_weight(p).T)[:, 0], cache


def decode(params, tokens, at, cache, *, config: LlamaConfig, ops, dtype):
    """(logits [B, padded_vocab] after tokens [B] at position `at`, the cache with their k, v
    stored)."""
    p = cast(params, dtype)
    cos, sin = (jax.lax.dynamic_slice_in_dim(t, at, 1) for t in rope_tables(config))

    def layer_step(carry, xs):
        layer, ck, cv = xs
        *carry, kv = _block(layer, *carry, config=config, ops=ops, cos=cos, sin=sin,
                            attend=partial(_attend_cached, ck, cv, at), par=ONE_DEVICE)
        return tuple(carry), kv

    x = jnp.take(p["wte"], tokens[:, None], axis=0)
    (s, d), cache = jax.lax.scan(layer_step, _start(x), (p["blocks"], *cache))
    h, _ = ops.add_rms_norm(d, s, p["norm_f"], eps=config.norm_eps)
    return (h @ _head_weight(p).T)[:, 0], cache


def _attend_cached(cache_k, cache_v, at, q, k, v):
    """q [B, 1, H, D], k and v [B, 1, KV, D] at position `at`: store k, v there and attend to
    positions <= at, each query head to its group's key/value head (no repeated copies). One
    query against the cache is memory-bound work: plain jnp, in float32."""
    cache_k = jax.lax.dynamic_update_slice_in_dim(cache_k, k, at, axis=1)
    cache_v = jax.lax.dynamic_update_slice_in_dim(cache_v, v, at, axis=1)
    B, _, H, D = q.shape
    KV = k.shape[2]
    qg = q.reshape(B, 1, KV, H // KV, D).astype(jnp.float32)
    s = jnp.einsum("bqkgd,btkd->bkgqt", qg, cache_k.astype(jnp.float32)) / math.sqrt(D)
    s = jnp.where(jnp.arange(cache_k.shape[1]) <= at, s, -jnp.inf)
    w = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bkgqt,btkd->bqkgd", w, cache_v.astype(jnp.float32))
    return out.reshape(B, 1, H, D).astype(q.dtype), (cache_k, cache_v)


# --------------------------------------------------------------------------------------------
# Hugging Face's LlamaForCausalLM. transformers keeps one tensor per layer in torch Linear's
# (out, in); we stack the layers and keep (in, out). Its q/k projections are in the
# rotate_half order our rope applies, so no permutation is needed.

_HF_LINEAR = {"wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight",
              "wv": "self_attn.v_proj.weight", "wo": "self_attn.o_proj.weight",
              "w_down": "mlp.down_proj.weight"}
_HF_NORM = {"attn_norm": "input_layernorm.weight", "mlp_norm": "post_attention_layernorm.weight"}
_GPT2_VOCAB, _GPT2_EOT = 50257, 50256


def _padded(vocab_size: int, multiple: int = 128) -> int:
    return -(-vocab_size // multiple) * multiple


def config_from_hf(hf: dict) -> LlamaConfig:
    """Our config from a transformers LlamaConfig dict (config.json); ValueError for a field our
    model cannot honour."""
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "max_position_embeddings", "vocab_size"):
        if not isinstance(hf.get(key), int) or isinstance(hf.get(key), bool):
            raise ValueError(f"{key} must be an int, got {hf.get(key)!r}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported: blujax's Llama MLP is SwiGLU "
                         f"(silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key, False):
            raise ValueError(f"{key} = true is not supported: blujax's Llama has no biases")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if head_dim * heads != hf["hidden_size"]:
        raise ValueError(f"head_dim {head_dim} x {heads} heads is not hidden_size "
                         f"{hf['hidden_size']}: blujax's Llama needs them equal")
    if hf.get("pretraining_tp", 1) != 1:
        raise ValueError(f"pretraining_tp {hf['pretraining_tp']!r} is not supported (1 only)")
    # transformers 5 keeps theta and the scaling in rope_parameters; earlier versions in
    # rope_theta and rope_scaling.
    rope = hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = rope if rope else hf.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
        elif kind != "llama3":
            raise ValueError(f"rope_scaling of type {kind!r} is not supported (blujax has "
                             f"'llama3' and none)")
        else:
            scaling = (float(scaling["factor"]), float(scaling["low_freq_factor"]),
                       float(scaling["high_freq_factor"]),
                       int(scaling["original_max_position_embeddings"]))
    return LlamaConfig(
        n_layer=hf["num_hidden_layers"], n_head=heads,
        n_kv_head=hf.get("num_key_value_heads") or heads, n_embd=hf["hidden_size"],
        ffn_hidden=hf["intermediate_size"], block_size=hf["max_position_embeddings"],
        vocab_size=hf["vocab_size"], padded_vocab_size=_padded(hf["vocab_size"]),
        rope_theta=float(theta), rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def hf_config(config: LlamaConfig) -> dict:
    """config.json for transformers' LlamaForCausalLM holding our model."""
    scaling = None
    if config.rope_scaling is not None:
        factor, low, high, original = config.rope_scaling
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                   "high_freq_factor": high, "original_max_position_embeddings": original}
    # Both spellings: transformers 5 reads rope_parameters, earlier versions the other two.
    parameters = {"rope_type": "default", **(scaling or {}), "rope_theta": config.rope_theta}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_kv_head,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.block_size,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": scaling,
        "rope_parameters": parameters,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": config.tie_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
        # Trained here on GPT-2's tokenizer: its end-of-text is both.
        "bos_token_id": _GPT2_EOT if config.vocab_size == _GPT2_VOCAB else None,
        "eos_token_id": _GPT2_EOT if config.vocab_size == _GPT2_VOCAB else None,
        "torch_dtype": "float32",
    }


def hf_tensor_names(config: LlamaConfig) -> list[str]:
    layer = [f"model.layers.{i}.{name}" for i in range(config.n_layer)
             for name in (*_HF_LINEAR.values(), "mlp.gate_proj.weight", "mlp.up_proj.weight",
                          *_HF_NORM.values())]
    head = [] if config.tie_embeddings else ["lm_head.weight"]
    return ["model.embed_tokens.weight", *layer, "model.norm.weight", *head]


def to_hf(params, config: LlamaConfig) -> dict:
    """Our params as LlamaForCausalLM's state dict (float32 numpy, the vocabulary unpadded; a
    tied lm_head left out, as save_pretrained does)."""
    p = _numpy(params, config)
    b = p["blocks"]
    out = {"model.embed_tokens.weight": p["wte"][:config.vocab_size],
           "model.norm.weight": p["norm_f"]}
    for i in range(config.n_layer):
        pre = f"model.layers.{i}."
        for ours, name in _HF_LINEAR.items():
            out[pre + name] = b[ours][i].T
        out[pre + "mlp.gate_proj.weight"] = b["w_gate_up"][i][:, 0].T
        out[pre + "mlp.up_proj.weight"] = b["w_gate_up"][i][:, 1].T
        for ours, name in _HF_NORM.items():
            out[pre + name] = b[ours][i]
    if not config.tie_embeddings:
        out["lm_head.weight"] = p["lm_head"][:config.vocab_size]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def from_hf(tensors: dict, config: LlamaConfig) -> dict:
    """Our params (float32 numpy, padded rows zero) from LlamaForCausalLM's tensors. The
    rotary inv_freq buffers some files carry are ignored; a tied model's lm_head.weight, if
    present, must equal the embedding."""
    t = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    C, F, D = config.n_embd, config.ffn_hidden, config.head_dim
    H, KV = config.n_head * D, config.n_kv_head * D
    expected = {"model.embed_tokens.weight": (config.vocab_size, C), "model.norm.weight": (C,)}
    shapes = {"wq": (H, C), "wk": (KV, C), "wv": (KV, C), "wo": (C, H), "w_down": (C, F)}
    for i in range(config.n_layer):
        pre = f"model.layers.{i}."
        for ours, name in _HF_LINEAR.items():
            expected[pre + name] = shapes[ours]
        expected[pre + "mlp.gate_proj.weight"] = expected[pre + "mlp.up_proj.weight"] = (F, C)
        for name in _HF_NORM.values():
            expected[pre + name] = (C,)
    head = t.pop("lm_head.weight", None)
    if not config.tie_embeddings:
        if head is None:
            raise ValueError("tensor lm_head.weight is missing (tie_word_embeddings is false)")
        expected["lm_head.weight"] = (config.vocab_size, C)
        t["lm_head.weight"] = head
    for name in expected:
        if name not in t:
            raise ValueError(f"tensor {name} is missing")
    for name in t:
        if name not in expected:
            raise ValueError(f"unexpected tensor {name}: not part of LlamaForCausalLM as "
                             f"blujax reads it")
    for name, shape in expected.items():
        if tuple(t[name].shape) != shape:
            raise ValueError(f"tensor {name} has shape {tuple(t[name].shape)}, but the config "
                             f"implies {shape}")
    t = {k: np.asarray(v, dtype=np.float32) for k, v in t.items()}
    if config.tie_embeddings and head is not None and not np.array_equal(
            np.asarray(head, np.float32), t["model.embed_tokens.weight"]):
        raise ValueError("lm_head.weight differs from embed_tokens.weight, but "
                         "tie_word_embeddings is true")

    def rows(x):
        out = np.zeros((config.padded_vocab_size, C), np.float32)
        out[:config.vocab_size] = x
        return out

    def stack(name):
        return np.stack([t[f"model.layers.{i}.{name}"] for i in range(config.n_layer)])

    blocks = {ours: stack(name).transpose(0, 2, 1) for ours, name in _HF_LINEAR.items()}
    blocks.update({ours: stack(name) for ours, name in _HF_NORM.items()})
    blocks["w_gate_up"] = np.stack([stack("mlp.gate_proj.weight").transpose(0, 2, 1),
                                    stack("mlp.up_proj.weight").transpose(0, 2, 1)], axis=2)
    params = {"wte": rows(t["model.embed_tokens.weight"]), "blocks": blocks,
              "norm_f": t["model.norm.weight"]}
    if not config.tie_embeddings:
        params["lm_head"] = rows(t["lm_head.weight"])
    return params


def _numpy(params, config: LlamaConfig) -> dict:
    """params as float32 numpy, checked against config's shapes."""
    want = jax.eval_shape(lambda k: init(config, k), jax.random.key(0))
    want = jax.tree_util.tree_flatten_with_path(want)[0]
    got = jax.tree_util.tree_flatten_with_path(params)[0]
    if [k for k, _ in got] != [k for k, _ in want]:
        raise ValueError(f"the params are not this Llama's: their leaves are "
                         f"{[jax.tree_util.keystr(k) for k, _ in got]}")
    for (path, x), (_, w) in zip(got, want):
        if tuple(np.shape(x)) != tuple(w.shape):
            raise ValueError(f"params{jax.tree_util.keystr(path)} has shape {np.shape(x)}, "
                             f"but the config implies {tuple(w.shape)}")
    return jax.tree.map(lambda x: np.asarray(x, np.float32), params)
