"""Qwen2 to and from Hugging Face's Qwen2ForCausalLM: Llama's layout (blujax.model.llama.hf)
with the q, k and v projections' biases, and Qwen2's config keys. Sliding-window attention is
refused: our attention sees every earlier position."""

from __future__ import annotations

from blujax.model.llama import hf as llama_hf
from blujax.model.qwen2.model import NAME, Qwen2Config, init

HF_ARCHITECTURE = "Qwen2ForCausalLM"
LAYER = {**llama_hf.LAYER, "bq": ("self_attn.q_proj.bias", False),
         "bk": ("self_attn.k_proj.bias", False), "bv": ("self_attn.v_proj.bias", False)}
# LlamaForCausalLM's keys that Qwen2's config does not have.
_LLAMA_ONLY = ("attention_bias", "mlp_bias", "head_dim")


def config_from_hf(hf: dict) -> Qwen2Config:
    """Our config from a transformers Qwen2Config dict (config.json); ValueError for a field our
    model cannot honour (sliding-window attention, a RoPE scaling we lack, ...)."""
    if hf.get("use_sliding_window", False):
        raise ValueError("use_sliding_window = true is not supported: blujax's attention sees "
                         "every earlier position (no sliding window)")
    other = sorted({t for t in hf.get("layer_types") or () if t != "full_attention"})
    if other:
        raise ValueError(f"layer_types {', '.join(other)} are not supported: blujax's Qwen2 "
                         f"has full attention in every layer")
    return Qwen2Config(**llama_hf.config_fields(hf))


def hf_config(config: Qwen2Config) -> dict:
    """config.json for transformers' Qwen2ForCausalLM holding our model."""
    hf = {k: v for k, v in llama_hf.hf_config(config).items() if k not in _LLAMA_ONLY}
    return {**hf, "architectures": [HF_ARCHITECTURE], "model_type": NAME,
            "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": config.n_layer,
            "layer_types": ["full_attention"] * config.n_layer}


def hf_tensor_names(config: Qwen2Config) -> list[str]:
    return llama_hf.hf_tensor_names(config, LAYER)


def to_hf(params, config: Qwen2Config) -> dict:
    """Our params as Qwen2ForCausalLM's state dict (float32 numpy, the vocabulary unpadded)."""
    return llama_hf.to_hf(params, config, layer=LAYER, init=init)


def from_hf(tensors: dict, config: Qwen2Config) -> dict:
    """Our params (float32 numpy, padded rows zero) from Qwen2ForCausalLM's tensors."""
    return llama_hf.from_hf(tensors, config, layer=LAYER, init=init, arch=HF_ARCHITECTURE)
