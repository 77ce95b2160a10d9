"""GPT-2, a model family: its model (model.py) and beside it its converters (hf.py:
transformers' GPT2LMHeadModel; llmc.py: llm.c's model file; layouts.py: the layout of earlier
blujax checkpoints). The names here are the family's face (blujax/model/family.py), what the
rest of the package uses."""

from blujax.model.gpt2.hf import (HF_ARCHITECTURE, config_from_hf, from_hf, hf_config,
                                  hf_tensor_names, to_hf)
from blujax.model.gpt2.layouts import legacy_params, upgrade_params
from blujax.model.gpt2.llmc import from_llmc, llmc_shapes, to_llmc
from blujax.model.gpt2.model import (NAME, PRESETS, TITLE, Config, GPT2Config, check_mesh,
                                     check_tokens, decay_mask, declare, decode, flops_per_token,
                                     forward, head, hidden, init, logical_axes, prefill)
from blujax.model.stack import num_params

__all__ = [
    "NAME", "TITLE", "HF_ARCHITECTURE", "Config", "GPT2Config", "PRESETS", "declare", "init",
    "logical_axes", "forward", "hidden", "head", "prefill", "decode", "check_tokens",
    "check_mesh", "decay_mask", "flops_per_token", "num_params", "config_from_hf", "hf_config",
    "hf_tensor_names", "to_hf", "from_hf", "llmc_shapes", "to_llmc", "from_llmc",
    "legacy_params", "upgrade_params",
]
