"""Llama to and from Hugging Face's LlamaForCausalLM: its config.json and its tensors.

transformers keeps one tensor per layer in torch Linear's (out, in); we stack the layers and
keep (in, out), with the MLP's gate and up projections in one [C, 2, F] weight. Its q/k
projections are in the rotate_half order our rope applies, so no permutation is needed. The
layout (`LAYER`) and the functions take the per-layer table as an argument: Qwen2, whose layout
is Llama's with q/k/v biases, converts through them.
"""

from __future__ import annotations

import numpy as np

from blujax import vocab
from blujax.model import convert
from blujax.model.llama.model import LlamaConfig, init

HF_ARCHITECTURE = "LlamaForCausalLM"
PREFIX = "model.layers.{}."

# Our per-layer leaf -> (its name under "model.layers.{i}.", transposed: torch Linear's
# (out, in) against our (in, out)). The gate and up projections, one leaf of ours, are apart.
LAYER = {
    "wq": ("self_attn.q_proj.weight", True), "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True), "wo": ("self_attn.o_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
    "attn_norm": ("input_layernorm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
}
GATE_UP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")


def config_fields(hf: dict) -> dict:
    """Our Llama config's fields from the keys Llama-style transformers configs share (sizes,
    heads, activation, RoPE theta and scaling, eps, tying); ValueError for a value our model
    cannot honour."""
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "max_position_embeddings", "vocab_size"):
        if not isinstance(hf.get(key), int) or isinstance(hf.get(key), bool):
            raise ValueError(f"{key} must be an int, got {hf.get(key)!r}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported: blujax's MLP is SwiGLU (silu)")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if head_dim * heads != hf["hidden_size"]:
        raise ValueError(f"head_dim {head_dim} x {heads} heads is not hidden_size "
                         f"{hf['hidden_size']}: blujax needs them equal")
    theta, scaling = _rope_from_hf(hf)
    return dict(
        n_layer=hf["num_hidden_layers"], n_head=heads,
        n_kv_head=hf.get("num_key_value_heads") or heads, n_embd=hf["hidden_size"],
        ffn_hidden=hf["intermediate_size"], block_size=hf["max_position_embeddings"],
        vocab_size=hf["vocab_size"], padded_vocab_size=vocab.padded(hf["vocab_size"]),
        rope_theta=float(theta), rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def _rope_from_hf(hf: dict):
    """(theta, our rope_scaling or None). transformers 5 keeps both in rope_parameters; earlier
    versions in rope_theta and rope_scaling."""
    rope = hf.get("rope_parameters") or {}
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = rope if rope else hf.get("rope_scaling")
    if scaling is None:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"rope_scaling of type {kind!r} is not supported (blujax has "
                         f"'llama3' and none)")
    return theta, (float(scaling["factor"]), float(scaling["low_freq_factor"]),
                   float(scaling["high_freq_factor"]),
                   int(scaling["original_max_position_embeddings"]))


def config_from_hf(hf: dict) -> LlamaConfig:
    """Our config from a transformers LlamaConfig dict (config.json); ValueError for a field our
    model cannot honour."""
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key, False):
            raise ValueError(f"{key} = true is not supported: blujax's Llama has no biases")
    if hf.get("pretraining_tp", 1) != 1:
        raise ValueError(f"pretraining_tp {hf['pretraining_tp']!r} is not supported (1 only)")
    return LlamaConfig(**config_fields(hf))


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
        "architectures": [HF_ARCHITECTURE],
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
        **vocab.special_tokens(config.vocab_size),
        "torch_dtype": "float32",
    }


def hf_tensor_names(config: LlamaConfig, layer: dict = LAYER) -> list[str]:
    names = [n for n, _ in layer.values()] + list(GATE_UP)
    head = [] if config.tie_embeddings else ["lm_head.weight"]
    return ["model.embed_tokens.weight",
            *(PREFIX.format(i) + n for i in range(config.n_layer) for n in names),
            "model.norm.weight", *head]


def to_hf(params, config: LlamaConfig, *, layer: dict = LAYER, init=init) -> dict:
    """Our params as LlamaForCausalLM's state dict (float32 numpy, the vocabulary unpadded; a
    tied lm_head left out, as save_pretrained does). layer, init: the family's table and init
    (Qwen2's add its biases)."""
    p = convert.to_numpy(params, convert.shapes(init, config), what="this model's")
    b = p["blocks"]
    out = {"model.embed_tokens.weight": p["wte"][:config.vocab_size],
           "model.norm.weight": p["norm_f"]}
    for ours, (name, transpose) in layer.items():
        out.update(convert.unstack(b[ours], PREFIX + name, transpose=transpose))
    for j, name in enumerate(GATE_UP):
        out.update(convert.unstack(b["w_gate_up"][:, :, j], PREFIX + name, transpose=True))
    if not config.tie_embeddings:
        out["lm_head.weight"] = p["lm_head"][:config.vocab_size]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def from_hf(tensors: dict, config: LlamaConfig, *, layer: dict = LAYER, init=init,
            arch: str = HF_ARCHITECTURE) -> dict:
    """Our params (float32 numpy, padded rows zero) from LlamaForCausalLM's tensors (layer,
    init and arch: another family's, such as Qwen2's). The rotary inv_freq buffers some files
    carry are ignored; a tied model's lm_head.weight, if present, must equal the embedding."""
    t = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    C, F = config.n_embd, config.ffn_hidden
    ours = convert.shapes(init, config)["blocks"]
    expected = {"model.embed_tokens.weight": (config.vocab_size, C), "model.norm.weight": (C,)}
    for i in range(config.n_layer):
        for leaf, (name, transpose) in layer.items():
            shape = ours[leaf][1:]
            expected[PREFIX.format(i) + name] = shape[::-1] if transpose else shape
        for name in GATE_UP:
            expected[PREFIX.format(i) + name] = (F, C)
    head = t.pop("lm_head.weight", None)
    if not config.tie_embeddings:
        if head is None:
            raise ValueError("tensor lm_head.weight is missing (tie_word_embeddings is false)")
        expected["lm_head.weight"] = (config.vocab_size, C)
        t["lm_head.weight"] = head
    t = convert.expect(t, expected, arch=arch)
    if config.tie_embeddings:
        convert.check_tied(head, t["model.embed_tokens.weight"], "lm_head.weight differs from "
                           "embed_tokens.weight, but tie_word_embeddings is true")
    blocks = {leaf: convert.stack(t, PREFIX + name, config.n_layer, transpose=transpose)
              for leaf, (name, transpose) in layer.items()}
    blocks["w_gate_up"] = np.stack([convert.stack(t, PREFIX + name, config.n_layer,
                                                  transpose=True) for name in GATE_UP], axis=2)
    params = {"wte": convert.vocab_rows(t["model.embed_tokens.weight"],
                                        config.padded_vocab_size),
              "blocks": blocks, "norm_f": t["model.norm.weight"]}
    if not config.tie_embeddings:
        params["lm_head"] = convert.vocab_rows(t["lm_head.weight"], config.padded_vocab_size)
    return params
