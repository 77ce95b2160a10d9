"""The two kernel namespaces a model runs on, by name.

"ffi" is `blujax.kernels`: our CPU/CUDA kernels as XLA custom calls. "xla" is the plain-JAX
way of writing the same model, the baseline our kernels are measured against: the jnp ops of
`blujax.kernels.xla`, which XLA fuses itself, except attention, which is
`jax.nn.dot_product_attention` (cuDNN's fused kernel on a GPU for bfloat16, XLA's otherwise
and in XLA's deterministic mode) — what a JAX user would reach for, rather than the
float32-exact oracle of the spec.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from blujax import kernels
from blujax.kernels import xla

NAMES = ("ffi", "xla")


def _dot_product_attention(q, k, v, *, causal: bool = True, scale: float | None = None):
    impl = None  # JAX's choice: cuDNN where it can, which the deterministic mode must avoid
    if jax.default_backend() == "gpu":
        if _deterministic():
            impl = "xla"
        elif q.dtype in (jnp.bfloat16, jnp.float16):
            impl = "cudnn"
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=causal,
                                        implementation=impl)


def _deterministic() -> bool:
    """Whether XLA runs in its deterministic mode (--xla_gpu_deterministic_ops=true), where
    cuDNN's fused attention does not compile (jax 0.11.2: "IndexError: raw_hash_map<>::at" in
    the train step) and XLA's own attention, which is deterministic, stands in."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return any(f in ("--xla_gpu_deterministic_ops", "--xla_gpu_deterministic_ops=true")
               for f in flags)


def _add_layer_norm(x, residual, weight, bias, *, x_bias=None, eps: float = 1e-5):
    # As plain JAX writes a block: the projection's bias added to its output, then the
    # residual, each in x's dtype (the spec instead rounds the three-way sum once).
    if x_bias is not None:
        x = x + x_bias
    return xla.add_layer_norm(x, residual, weight, bias, eps=eps)


def _add_rms_norm(x, residual, weight, *, eps: float = 1e-5):
    # As plain JAX writes a Llama block: the residual added in x's dtype, then the norm.
    s = x + residual
    return xla.rms_norm(s, weight, eps=eps), s


def _dot_product_attention_qkv(qkv, *, causal: bool = True, scale: float | None = None):
    return _dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=causal,
                                  scale=scale)


def _swiglu(x):
    # As plain JAX writes a Llama MLP: in x's dtype, on x [..., 2, F] = (gate, up).
    return jax.nn.silu(x[..., 0, :]) * x[..., 1, :]


# blujax.fp8's fused MLP: the cast of this namespace's swiglu (and of its gradient), which
# XLA fuses into the pass that computes it.
def _swiglu_fwd_fp8(x, scale, dtype=jnp.float8_e4m3fn):
    return xla.fp8_copy(_swiglu(x).reshape(-1, x.shape[-1]), scale, dtype)


def _swiglu_bwd_fp8(dy, x, scale, dtype=jnp.float8_e5m2):
    dx = jax.vjp(_swiglu, x)[1](dy)[0]
    return xla.fp8_copy(dx.reshape(-1, 2 * x.shape[-1]), scale, dtype)


def _rope(x, cos, sin):
    # As Hugging Face Llama writes it: full-width tables [T, D] cast to x's dtype, then
    # x * cos + rotate_half(x) * sin, broadcast over the heads of x [..., T, N, D].
    cos = jnp.concatenate([cos, cos], axis=-1)[:, None, :].astype(x.dtype)
    sin = jnp.concatenate([sin, sin], axis=-1)[:, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def _rope_qkv(qkv, cos, sin, *, heads: int):
    kv = (qkv.shape[-2] - heads) // 2
    q, k, v = jnp.split(qkv, (heads, heads + kv), axis=-2)
    return _rope(q, cos, sin), _rope(k, cos, sin), v


class Namespace:
    """Ops as read-only attributes, as the module `blujax.kernels` holds them; hashed by
    identity as a module is, since jitted functions take the namespace as a static argument
    (a SimpleNamespace does not hash)."""

    def __init__(self, **ops):
        self.__dict__.update(ops)

    def __setattr__(self, name, value):
        raise AttributeError(f"an ops namespace is read-only (setting {name!r})")

    def __repr__(self):
        return f"Namespace({', '.join(self.__dict__)})"


XLA = Namespace(
    layer_norm=xla.layer_norm,
    add_layer_norm=_add_layer_norm,
    rms_norm=xla.rms_norm,
    add_rms_norm=_add_rms_norm,
    # blujax.fp8's pieces that begin with the norm: the spec's are this namespace's norm.
    add_rms_norm_fwd_fp8=xla.add_rms_norm_fwd_fp8,
    add_rms_norm_bwd=xla.add_rms_norm_bwd,
    gelu=xla.gelu,
    swiglu=_swiglu,
    swiglu_fwd_fp8=_swiglu_fwd_fp8,
    swiglu_bwd_fp8=_swiglu_bwd_fp8,
    rope=_rope,
    rope_qkv=_rope_qkv,
    softmax_cross_entropy=xla.softmax_cross_entropy,
    softmax_cross_entropy_mean=xla.softmax_cross_entropy_mean,
    attention=_dot_product_attention,
    attention_qkv=_dot_product_attention_qkv,
    # The parallel forms (blujax.sharding): ring attention merges partial results through
    # the log-sum-exp; tensor parallelism splits the vocabulary.
    attention_with_lse=xla.attention_with_lse,
    vocab_parallel_softmax_cross_entropy=xla.vocab_parallel_softmax_cross_entropy,
)


def get(name: str):
    """The ops namespace called `name` ("ffi" or "xla")."""
    if name == "ffi":
        return kernels
    if name == "xla":
        return XLA
    raise ValueError(f"unknown ops {name!r}: choose one of {', '.join(NAMES)}")
