"""The hot operations as XLA FFI custom calls (our CPU and CUDA kernels), each differentiable.

`blujax.kernels.xla` holds the same ops written in jnp: the specification, the test oracle and
the plain-XLA side of every benchmark. A model takes either namespace as its `ops`.
"""

from blujax.kernels.adamw import adamw_update, adamw_update_many
from blujax.kernels.attention import attention, attention_qkv, attention_with_lse
from blujax.kernels.cross_entropy import (
    cross_entropy_grad,
    cross_entropy_stats,
    softmax_cross_entropy,
    softmax_cross_entropy_mean,
    vocab_parallel_softmax_cross_entropy,
)
from blujax.kernels.gelu import gelu
from blujax.kernels.layernorm import add_layer_norm, layer_norm
from blujax.kernels.rms_norm import (add_rms_norm, add_rms_norm_bwd, add_rms_norm_fwd_fp8,
                                      rms_norm)
from blujax.kernels.rope import rope, rope_qkv
from blujax.kernels.swiglu import swiglu, swiglu_bwd_fp8, swiglu_fwd_fp8

__all__ = [
    "adamw_update",
    "adamw_update_many",
    "add_layer_norm",
    "add_rms_norm",
    "add_rms_norm_bwd",
    "add_rms_norm_fwd_fp8",
    "attention",
    "attention_qkv",
    "attention_with_lse",
    "cross_entropy_grad",
    "cross_entropy_stats",
    "gelu",
    "layer_norm",
    "rms_norm",
    "rope",
    "rope_qkv",
    "softmax_cross_entropy",
    "softmax_cross_entropy_mean",
    "swiglu",
    "swiglu_bwd_fp8",
    "swiglu_fwd_fp8",
    "vocab_parallel_softmax_cross_entropy",
]
