"""Qwen2, a model family: its model (model.py: Llama's block with q/k/v biases) and beside it
its converter (hf.py: transformers' Qwen2ForCausalLM). The names here are the family's face
(blujax/model/family.py), what the rest of the package uses."""

from blujax.model.qwen2.hf import (HF_ARCHITECTURE, config_from_hf, from_hf, hf_config,
                                   hf_tensor_names, to_hf)
from blujax.model.qwen2.model import (NAME, PRESETS, TITLE, Config, Qwen2Config, check_mesh,
                                      check_tokens, decay_mask, declare, decode,
                                      flops_per_token, forward, head, hidden, init,
                                      logical_axes, prefill, whole_axes)

__all__ = [
    "NAME", "TITLE", "HF_ARCHITECTURE", "Config", "Qwen2Config", "PRESETS", "declare", "init",
    "logical_axes", "forward", "hidden", "head", "prefill", "decode", "check_tokens",
    "check_mesh", "whole_axes", "decay_mask", "flops_per_token", "config_from_hf",
    "hf_config", "hf_tensor_names", "to_hf", "from_hf",
]
