"""Models as pure functions over parameter pytrees; each takes its kernels as an `ops` namespace.

A model family is a folder (`gpt2/`, `llama/`, `qwen2/`) whose package is its face, the names
of `family.Family`; FAMILIES registers them, and everything above the model layer finds a
config's family with `family_of(config)`. What the families share is written once:
`stack.py` (the block runner, forward, prefill and decode with a KV cache), `convert.py` (the
checks of conversion), `blujax.vocab` (GPT-2's vocabulary and the padding).
"""

from __future__ import annotations

import dataclasses

import jax

from blujax.model import gpt2, llama, qwen2
from blujax.model.family import Family
from blujax.model.stack import num_params

FAMILIES: dict[str, Family] = {f.NAME: f for f in (gpt2, llama, qwen2)}


def family_of(config) -> Family:
    """The family whose Config `config` is (exactly: Qwen2's config derives from Llama's)."""
    for family in FAMILIES.values():
        if type(config) is family.Config:
            return family
    raise TypeError(f"{type(config).__name__} is not the config of a registered model family "
                    f"({', '.join(FAMILIES)})")


# Models of at least this many parameters train with "selective" recomputation unless told
# otherwise: Llama 3 8B's step at its 8192 tokens keeps 57 GB of activations a device without
# it (fsdp8, one sequence a device), 35 GB with it (benchmarks.memory; benchmarks/RESULTS.md).
SELECTIVE_FROM_PARAMS = 4e9


def default_remat(config) -> str:
    """The recomputation (blujax.model.stack.REMAT) a model of `config` trains with unless
    told: "selective" from SELECTIVE_FROM_PARAMS parameters, else "none" (the fastest)."""
    family = family_of(config)
    params = jax.eval_shape(lambda k: family.init(config, k), jax.random.key(0))
    return "selective" if num_params(params) >= SELECTIVE_FROM_PARAMS else "none"


def presets() -> dict:
    """Every family's presets by name: {name: config}."""
    return {name: config for family in FAMILIES.values()
            for name, config in family.PRESETS.items()}


def get_config(name: str):
    """The preset config called `name`, of whichever family."""
    every = presets()
    if name not in every:
        raise ValueError(f"unknown model {name!r}; the presets are: {', '.join(every)}")
    return every[name]


def config_to_dict(config) -> dict:
    """A config as config.json keeps it: its fields and its family's name."""
    return {"family": family_of(config).NAME, **dataclasses.asdict(config)}


def config_from_dict(d: dict):
    """The config config_to_dict wrote (a dict without "family" is GPT-2's: runs written before
    there were families); extra keys (a name, a parameter count) are ignored."""
    name = d.get("family", gpt2.NAME)
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r} (blujax has {', '.join(FAMILIES)})")
    cls = FAMILIES[name].Config
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in d]
    if missing:
        raise ValueError(f"the model config lacks {', '.join(missing)}")
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})
