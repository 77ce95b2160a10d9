"""Llama, a model family: its model (model.py) and beside it its converter (hf.py:
transformers' LlamaForCausalLM). The names here are the family's face
(blujax/model/family.py), what the rest of the package uses."""

from blujax.model.llama.hf import (HF_ARCHITECTURE, config_from_hf, from_hf, hf_config,
                                   hf_tensor_names, to_hf)
from blujax.model.llama.model import (NAME, PRESETS, TITLE, Config, LlamaConfig, check_mesh,
                                      check_tokens, decay_mask, declare, decode,
                                      flops_per_token, forward, head, hidden, init, inv_freq,
                                      logical_axes, prefill, rope_tables, whole_axes)

__all__ = [
    "NAME", "TITLE", "HF_ARCHITECTURE", "Config", "LlamaConfig", "PRESETS", "declare", "init",
    "logical_axes", "forward", "hidden", "head", "prefill", "decode", "check_tokens",
    "check_mesh", "whole_axes", "decay_mask", "flops_per_token", "inv_freq", "rope_tables",
    "config_from_hf", "hf_config", "hf_tensor_names", "to_hf", "from_hf",
]
