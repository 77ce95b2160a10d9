"""GPT-2 to and from Hugging Face's GPT2LMHeadModel: its config.json and its tensors.

transformers keeps one tensor per layer ("h.{i}.attn.c_attn.weight") and its Conv1D weights are
(in, out), as ours; its QKV projection is one [C, 3C] tensor (q, k, v side by side), ours
[C, 3, C]. It keeps the vocabulary unpadded.
"""

from __future__ import annotations

import numpy as np

from blujax import vocab
from blujax.model import convert
from blujax.model.gpt2.layouts import fused_qkv, fused_shapes, split_qkv
from blujax.model.gpt2.model import GPT2Config, init

HF_ARCHITECTURE = "GPT2LMHeadModel"
# Our GELU is the tanh approximation; transformers has it under these two names.
HF_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
# The eps every LayerNorm of the model uses (the kernels' default).
LAYER_NORM_EPS = 1e-5

# Our (sublayer, leaf) -> transformers' name inside "h.{i}.".
_LAYER = {
    ("ln1", "w"): "ln_1.weight", ("ln1", "b"): "ln_1.bias",
    ("attn", "w"): "attn.c_attn.weight", ("attn", "b"): "attn.c_attn.bias",
    ("attn_proj", "w"): "attn.c_proj.weight", ("attn_proj", "b"): "attn.c_proj.bias",
    ("ln2", "w"): "ln_2.weight", ("ln2", "b"): "ln_2.bias",
    ("mlp_fc", "w"): "mlp.c_fc.weight", ("mlp_fc", "b"): "mlp.c_fc.bias",
    ("mlp_proj", "w"): "mlp.c_proj.weight", ("mlp_proj", "b"): "mlp.c_proj.bias",
}


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
                      padded_vocab_size=vocab.padded(hf["vocab_size"]))


def hf_config(config: GPT2Config) -> dict:
    """config.json for transformers' GPT2LMHeadModel holding our model (the vocabulary
    unpadded)."""
    return {
        "architectures": [HF_ARCHITECTURE],
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
        **vocab.special_tokens(config.vocab_size),
        "torch_dtype": "float32",
    }


def hf_tensor_names(config: GPT2Config) -> list[str]:
    """GPT2LMHeadModel's parameter names (without the "transformer." prefix), ours all."""
    layer = [f"h.{i}.{name}" for i in range(config.n_layer) for name in _LAYER.values()]
    return ["wte.weight", "wpe.weight", *layer, "ln_f.weight", "ln_f.bias"]


def to_hf(params, config: GPT2Config) -> dict:
    """Our params as GPT2LMHeadModel's state dict, float32 numpy, keyed as save_pretrained
    keys them ("transformer.h.0.ln_1.weight"; the tied lm_head.weight left out, as it does)."""
    p = fused_qkv(convert.to_numpy(params, convert.shapes(init, config), what="GPT-2's"))
    out = {"wte.weight": p["wte"][:config.vocab_size], "wpe.weight": p["wpe"],
           "ln_f.weight": p["ln_f"]["w"], "ln_f.bias": p["ln_f"]["b"]}
    for (sub, leaf), name in _LAYER.items():
        out.update(convert.unstack(p["blocks"][sub][leaf], "h.{}." + name))
    return {f"transformer.{k}": np.ascontiguousarray(v) for k, v in out.items()}


def _buffer(name: str) -> bool:
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
        if not _buffer(name):
            t[name] = value
    head = t.pop("lm_head.weight", None)
    want = fused_shapes(config)
    expected = {"wte.weight": (config.vocab_size, config.n_embd),
                "wpe.weight": (config.block_size, config.n_embd)}
    for (sub, leaf), name in _LAYER.items():
        for i in range(config.n_layer):
            expected[f"h.{i}.{name}"] = want["blocks"][sub][leaf][1:]
    expected["ln_f.weight"] = expected["ln_f.bias"] = (config.n_embd,)
    t = convert.expect(t, expected, arch=HF_ARCHITECTURE)
    convert.check_tied(head, t["wte.weight"], "lm_head.weight differs from wte.weight (an "
                       "untied LM head): blujax ties the head to the token embedding")
    blocks = {sub: {} for sub, _ in _LAYER}
    for (sub, leaf), name in _LAYER.items():
        blocks[sub][leaf] = convert.stack(t, "h.{}." + name, config.n_layer)
    return split_qkv({"wte": convert.vocab_rows(t["wte.weight"], config.padded_vocab_size),
                      "wpe": t["wpe.weight"], "blocks": blocks,
                      "ln_f": {"w": t["ln_f.weight"], "b": t["ln_f.bias"]}})
