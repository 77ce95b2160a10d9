"""GPT-2's parameters in the layout the other tools and earlier blujax checkpoints use: the QKV
projection's q, k and v fused in one axis, weight [L, C, 3C] and bias [L, 3C] (ours keep the
three apart: [L, C, 3, C], [L, 3, C], so that a split of the last axis over devices gives each
whole heads of all three).

Checkpoints written before 2026-11-26 hold the fused layout; restoring one converts it
(`upgrade_params`), recognised by its shapes.
"""

from __future__ import annotations

from blujax.model import convert
from blujax.model.gpt2.model import GPT2Config, init


def fused_qkv(p: dict) -> dict:
    """Params (numpy or jax) with the QKV weight and bias in the fused layout."""
    attn = p["blocks"]["attn"]
    fused = {k: v.reshape(*v.shape[:-2], -1) for k, v in attn.items()}
    return {**p, "blocks": {**p["blocks"], "attn": fused}}


def split_qkv(p: dict) -> dict:
    """The inverse of fused_qkv: our layout from the fused one."""
    attn = p["blocks"]["attn"]
    split3 = {k: v.reshape(*v.shape[:-1], 3, v.shape[-1] // 3) for k, v in attn.items()}
    return {**p, "blocks": {**p["blocks"], "attn": split3}}


def fused_shapes(config: GPT2Config) -> dict:
    """Our parameter shapes (a tree of tuples) in the fused layout."""
    shapes = convert.shapes(init, config)
    attn = shapes["blocks"]["attn"]
    fused = {"w": (*attn["w"][:-2], 3 * attn["w"][-1]), "b": (attn["b"][0], 3 * attn["b"][-1])}
    return {**shapes, "blocks": {**shapes["blocks"], "attn": fused}}


def legacy_params(params: dict) -> dict:
    """params in the layout of blujax checkpoints written before the QKV projection's q, k and
    v had an axis of their own (before 2026-11-26)."""
    return fused_qkv(params)


def upgrade_params(params: dict) -> dict:
    """The inverse of legacy_params: such a checkpoint's params in today's layout."""
    return split_qkv(params)
