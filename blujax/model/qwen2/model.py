"""Qwen2 (and Qwen2.5): Llama's block with biases on the query, key and value projections.

    config = PRESETS["qwen2-0.5b"]                    # or Qwen2Config(n_layer=..., ...)
    params = init(config, jax.random.key(0))          # float32 master weights
    logits = forward(params, tokens, config=config, ops=blujax.kernels, dtype=jnp.bfloat16)

Pre-RMSNorm blocks, grouped-query attention with rotary embeddings (theta 1e6 by default), a
SwiGLU MLP, no other biases; small Qwen2s tie the embedding to the LM head. The biases join
the one fused q/k/v product of Llama's block (blujax.model.llama.model.block adds them where a
layer has them), so the block, the stack around it, the splits over a mesh and the decay rule
are Llama's; what is Qwen2's own is its parameters and its converter (hf.py). Trained from
scratch it takes GPT-2's tokenizer, as Llama does.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from blujax.model import family
from blujax.model.family import Param
from blujax.model.llama import model as llama

NAME = "qwen2"
TITLE = "Qwen2"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen2Config(llama.LlamaConfig):
    """Llama's fields, with Qwen2's defaults for RoPE's theta and the RMSNorm eps."""

    rope_theta: float = 1000000.0
    norm_eps: float = 1e-6


Config = Qwen2Config

PRESETS = {
    # CPU tests: heads of 64 (the GPU attention kernels' size), two query heads per KV head.
    "qwen2-tiny": Qwen2Config(n_layer=2, n_head=2, n_kv_head=1, n_embd=128, ffn_hidden=320,
                              block_size=128),
    # Qwen2.5-0.5B's shape (on GPT-2's vocabulary unless imported): 14 heads of 64, 2 KV heads.
    "qwen2-0.5b": Qwen2Config(n_layer=24, n_head=14, n_kv_head=2, n_embd=896, ffn_hidden=4864,
                              block_size=2048),
}


def declare(config: Qwen2Config, key) -> dict:
    """Llama's parameters and the q, k and v biases, zero: bq [L, n_head x head_dim] on the
    "heads" axis, bk and bv [L, n_kv_head x head_dim] on "kv_heads", so that each device holds
    the biases of its heads."""
    params = llama.declare(config, key)
    L, D = config.n_layer, config.head_dim

    def zeros(heads, axis):
        return Param(jnp.zeros((L, heads * D), jnp.float32), ("layers", axis))

    params["blocks"].update(bq=zeros(config.n_head, "heads"), bk=zeros(config.n_kv_head,
                                                                         "kv_heads"),
                            bv=zeros(config.n_kv_head, "kv_heads"))
    return params


# init(config, key): the values of declare's params (float32); logical_axes(config): their axes.
init, logical_axes = family.init_and_axes(declare)

DECODER = dataclasses.replace(llama.DECODER, name=NAME)
forward, hidden, head = DECODER.forward, DECODER.hidden, DECODER.head
prefill, decode, check_tokens = DECODER.prefill, DECODER.decode, DECODER.check_tokens
# The biases are vectors (llama.NO_DECAY names them); each device's share of them follows its
# heads; FLOPs per token are the products' (the bias additions are not counted).
decay_mask, check_mesh, whole_axes = llama.decay_mask, llama.check_mesh, llama.whole_axes
flops_per_token = llama.flops_per_token
