"""One fused AdamW step (new moments and the update, or the updated parameters, in one pass) on
our FFI kernels.

Kernels: xla_ext/cpu/adamw.cc (float32, bfloat16, float64 parameters) and xla_ext/cuda/adamw.cu
(float32, bfloat16); moments are float32 (float64 for float64 parameters). `adamw_update_many`
updates a list of tensors in one custom call, which the CUDA kernel turns into a few launches
for the whole list. Everything is updated in place: the update overwrites the gradient (with
apply=True the new parameters overwrite the old ones) and the new moments the old ones
(input_output_aliases). A train step passes its clipping factor as grad_scale and apply=True:
clipping, AdamW and optax.apply_updates in one pass over the parameters, gradients and
moments. Inside a jitted train step that donates its
optimizer state (the gradients being intermediates) no buffer is copied or added; where an
input is still needed afterwards, XLA copies it first, which is still correct.

The optimizer built on this is `blujax.optim.adamw`; the jnp specification is
`blujax.kernels.xla.adamw_update`. An optimizer step is not differentiable.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from blujax._ffi import require_kernels
from blujax.kernels._util import check_dtype, check_float64_platform, match_vma, result_type

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float64)
# The hparams a caller passes, and the kernel's (xla_ext/common/adamw.h): the same, then the
# factor the gradients are scaled by (global-norm clipping; 1 for none), which
# adamw_update_many appends from its grad_scale argument.
HPARAMS = ("lr", "weight_decay", "bias_correction1", "bias_correction2")
KERNEL_HPARAMS = (*HPARAMS, "grad_scale")


def moment_dtype(param_dtype):
    """The dtype AdamW keeps its moments (and hparams) in for parameters of `param_dtype`."""
    return jnp.float64 if jnp.dtype(param_dtype) == jnp.float64 else jnp.float32


def adamw_update(param, grad, m, v, hparams, *, b1: float = 0.9, b2: float = 0.95,
                 eps: float = 1e-8, grad_scale=None, apply: bool = False):
    """One AdamW step for one tensor; returns (update, new_m, new_v).

    update = -lr * ((m' / bc1) / (sqrt(v' / bc2) + eps) + weight_decay * param), with
    m' = (1 - b1) g + b1 m and v' = (1 - b2) g^2 + b2 v, in optax.adamw's order, where
    g = grad * grad_scale (grad as it is without grad_scale).
    param, grad: any shape, float32, bfloat16 or float64 (CPU only); m, v: param's shape in
    moment_dtype(param.dtype); hparams: [lr, weight_decay, bias_correction1,
    bias_correction2] in that dtype; grad_scale: None or a scalar of that dtype (a global-norm
    clipping factor, say). The update has param's dtype. apply=True returns param + update
    (as optax.apply_updates adds it) in place of the update.
    """
    (u,), (m,), (v,) = adamw_update_many([param], [grad], [m], [v], hparams, b1=b1, b2=b2,
                                          eps=eps, grad_scale=grad_scale, apply=apply)
    return u, m, v


def adamw_update_many(params, grads, ms, vs, hparams, *, b1: float = 0.9, b2: float = 0.95,
                      eps: float = 1e-8, grad_scale=None, apply: bool = False):
    """adamw_update for lists of tensors of one dtype sharing hparams (and grad_scale), in one
    kernel call.

    Returns (updates, new_ms, new_vs) as lists; with apply=True (new_params, new_ms, new_vs).
    """
    op = "adamw_update"
    params, grads, ms, vs = (list(x) for x in (params, grads, ms, vs))
    _check(op, params, grads, ms, vs, hparams, b1, b2, eps)
    if not isinstance(apply, bool):
        raise TypeError(f"{op}: apply must be a bool, got {apply!r}")
    mdt = jnp.dtype(moment_dtype(params[0].dtype))
    if grad_scale is None:
        grad_scale = jnp.ones([], mdt)
    elif (not hasattr(grad_scale, "shape") or tuple(grad_scale.shape) != ()
          or jnp.dtype(grad_scale.dtype) != mdt):
        raise ValueError(f"{op}: grad_scale must be a {mdt.name} scalar, got "
                         f"{getattr(grad_scale, 'dtype', type(grad_scale).__name__)}"
                         f"{list(getattr(grad_scale, 'shape', ()))}")
    require_kernels(op)
    n = len(params)
    hparams = jnp.concatenate([hparams, grad_scale[None]])  # KERNEL_HPARAMS
    hparams, *flat = match_vma(hparams, *params, *grads, *ms, *vs)
    params, grads, ms, vs = (flat[i * n:(i + 1) * n] for i in range(4))
    # Operands: hparams, p[n], g[n], m[n], v[n]; results: u[n] (or p + u[n]), m[n], v[n], each
    # written over the operand it replaces (g -> u, or p -> p + u; m -> m, v -> v).
    first = 1 if apply else 1 + n
    aliases = {first + i: i for i in range(n)}
    aliases.update({1 + (k + 1) * n + i: k * n + i for k in (1, 2) for i in range(n)})
    outs = jax.ffi.ffi_call(
        "blujax_adamw",
        [result_type(p) for p in params] + [result_type(m) for m in ms]
        + [result_type(v) for v in vs],
        input_output_aliases=aliases,
        vmap_method="sequential",  # hparams may be batched too; a vmapped step is rare
    )(hparams, *params, *grads, *ms, *vs, b1=float(b1), b2=float(b2), eps=float(eps),
      apply=apply)
    return list(outs[:n]), list(outs[n:2 * n]), list(outs[2 * n:])


def check_hyperparameters(op: str, b1, b2, eps) -> None:
    """The static hyper-parameters: b1, b2 in [0, 1), eps finite and >= 0."""
    for name, b in (("b1", b1), ("b2", b2)):
        if not (_is_number(b) and 0.0 <= b < 1.0):
            raise ValueError(f"{op}: {name} must be a number in [0, 1), got {b!r}")
    if not (_is_number(eps) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps!r}")


def _is_number(x) -> bool:
    # Static numbers only: these become compile-time attributes of the kernel call.
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _check(op, params, grads, ms, vs, hparams, b1, b2, eps):
    check_hyperparameters(op, b1, b2, eps)
    n = len(params)
    if n == 0:
        raise ValueError(f"{op}: no tensors to update")
    if not (len(grads) == len(ms) == len(vs) == n):
        raise ValueError(f"{op}: got {n} params, {len(grads)} grads, {len(ms)} m and "
                         f"{len(vs)} v; one of each per tensor")
    dtype = jnp.dtype(params[0].dtype)
    check_dtype(op, "param", params[0], _DTYPES)
    mdt = jnp.dtype(moment_dtype(dtype))
    for i, (p, g, m, v) in enumerate(zip(params, grads, ms, vs)):
        where = f" (tensor {i})" if n > 1 else ""
        if jnp.dtype(p.dtype) != dtype:
            raise TypeError(f"{op}: all params of one call must share a dtype; tensor 0 is "
                            f"{dtype.name}, tensor {i} is {jnp.dtype(p.dtype).name}")
        if g.shape != p.shape or g.dtype != p.dtype:
            raise ValueError(f"{op}: grad{where} must match param ({dtype.name}{list(p.shape)}), "
                             f"got {jnp.dtype(g.dtype).name}{list(g.shape)}")
        for name, s in (("m", m), ("v", v)):
            if s.shape != p.shape or jnp.dtype(s.dtype) != mdt:
                raise ValueError(
                    f"{op}: {name}{where} must be {mdt.name}{list(p.shape)} for "
                    f"{dtype.name} params of shape {list(p.shape)}, got "
                    f"{jnp.dtype(s.dtype).name}{list(s.shape)}")
    if tuple(hparams.shape) != (len(HPARAMS),) or jnp.dtype(hparams.dtype) != mdt:
        raise ValueError(f"{op}: hparams must be {mdt.name}[{len(HPARAMS)}] "
                         f"({', '.join(HPARAMS)}), got "
                         f"{jnp.dtype(hparams.dtype).name}{list(hparams.shape)}")
    check_float64_platform(op, dtype)
