"""Optimizers as optax transformations, stepping on our fused kernels.

`adamw` is a drop-in for `optax.adamw` (e.g. inside
`optax.chain(optax.clip_by_global_norm(1.0), adamw(...))`): the same arithmetic in the same
order, so float32 steps track optax's to the last bit or two, but each step is one pass over
(param, grad, m, v) per group of leaves instead of XLA's fusions, and the moments are updated in
place. `adamw_apply` is the same step with a clipping factor and the update applied inside
that pass (the train step's form). Moments are float32 for float32 and bfloat16 parameters (optax would keep bfloat16
moments for bfloat16 parameters), float64 for float64.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from blujax import kernels
from blujax.kernels.adamw import check_hyperparameters, moment_dtype


class AdamWState(NamedTuple):
    """count: int32 [], steps taken; mu, nu: the first and second moments, like the params."""

    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates


def adamw(
    learning_rate: Union[float, optax.Schedule],
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    mask: Union[Any, Callable[[optax.Params], Any], None] = None,
    *,
    ops=None,
) -> optax.GradientTransformation:
    """AdamW with decoupled weight decay, as optax.adamw(..., eps_root=0) computes it.

    update = -lr(count) * (m_hat / (sqrt(v_hat) + eps) + weight_decay * param), with bias-
    corrected moments m_hat, v_hat of step count + 1. The schedule sees the count before the
    step, as optax's does (0 at the first step).

    learning_rate: a number or an optax schedule (count -> lr).
    mask: which leaves decay: a pytree of bools like the params (or a prefix of them), or a
      function params -> such a pytree; True decays. Use it to exempt biases and LayerNorm
      parameters. The function is called on the updates, as optax does; the bools must be
      static (Python bools).
    ops: the namespace whose `adamw_update_many` does the arithmetic: `blujax.kernels` (the
      default, our kernels) or `blujax.kernels.xla` (the jnp specification).
    """
    step = _adamw_step(learning_rate, b1, b2, eps, weight_decay, mask, ops)

    def update_fn(updates, state, params=None):
        return step(updates, state, params, grad_scale=None, apply=False)

    return optax.GradientTransformation(_adamw_init, update_fn)


def adamw_apply(
    learning_rate: Union[float, optax.Schedule],
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    mask: Union[Any, Callable[[optax.Params], Any], None] = None,
    *,
    ops=None,
):
    """`adamw`'s step with the update applied: apply(grads, state, params, grad_scale=None) ->
    (new_params, new_state), what `update` then `optax.apply_updates` give for the gradients
    times grad_scale (a float32 scalar: a global-norm clipping factor), in one pass over the
    parameters, gradients and moments per group of leaves instead of three. The state is
    `adamw(...).init`'s. Arguments as `adamw`'s."""
    step = _adamw_step(learning_rate, b1, b2, eps, weight_decay, mask, ops)

    def apply(grads, state, params, grad_scale=None):
        return step(grads, state, params, grad_scale=grad_scale, apply=True)

    return apply


def _adamw_init(params):
    def zeros(p):
        return jnp.zeros(jnp.shape(p), moment_dtype(jnp.asarray(p).dtype))

    return AdamWState(count=jnp.zeros([], jnp.int32), mu=jax.tree.map(zeros, params),
                      nu=jax.tree.map(zeros, params))


def _adamw_step(learning_rate, b1, b2, eps, weight_decay, mask, ops):
    """The hyper-parameters checked; step(grads, state, params, grad_scale, apply) ->
    (updates, or with apply the new params; the new state)."""
    op = "blujax.optim.adamw"
    check_hyperparameters(op, b1, b2, eps)
    if not callable(learning_rate) and not isinstance(learning_rate, jax.Array):
        if not _finite_number(learning_rate):
            raise ValueError(f"{op}: learning_rate must be a finite number or a schedule, "
                             f"got {learning_rate!r}")
    if not _finite_number(weight_decay):
        raise ValueError(f"{op}: weight_decay must be a finite number, got {weight_decay!r}")
    ops = kernels if ops is None else ops

    def step(updates, state, params, *, grad_scale, apply):
        grads, treedef = jax.tree.flatten(updates)
        mu = treedef.flatten_up_to(state.mu)
        nu = treedef.flatten_up_to(state.nu)
        decays = _decay_flags(mask, updates, treedef, weight_decay)
        if (any(decays) or apply) and params is None:
            raise ValueError(f"{op}: weight decay needs the params: call update(grads, state, "
                             "params)")
        # Params are only read where they decay or take the update; elsewhere any buffer of
        # the right type will do.
        ps = treedef.flatten_up_to(params) if params is not None else grads

        count_inc = optax.safe_increment(state.count)
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate

        # One kernel call per (dtype, decays) group: all leaves of a group share hparams.
        # Inside shard_map also per set of varying mesh axes: one call's results all get the
        # union of its operands' axes, and a replicated leaf must stay replicated.
        groups: dict[tuple, list[int]] = {}
        for i, (g, d) in enumerate(zip(grads, decays)):
            varying = tuple(sorted(jax.typeof(g).manual_axis_type.varying))
            groups.setdefault((jnp.dtype(g.dtype), d, varying), []).append(i)
        new_u, new_mu, new_nu = [None] * len(grads), list(mu), list(nu)
        for (dtype, decays_here, _), idx in groups.items():
            mdt = moment_dtype(dtype)
            hparams = _hparams(lr, weight_decay if decays_here else 0.0, count_inc, b1, b2, mdt)
            scale = None if grad_scale is None else jnp.asarray(grad_scale).astype(mdt)
            u, m, v = ops.adamw_update_many(
                [ps[i] for i in idx], [grads[i] for i in idx], [mu[i] for i in idx],
                [nu[i] for i in idx], hparams, b1=b1, b2=b2, eps=eps, grad_scale=scale,
                apply=apply)
            for j, i in enumerate(idx):
                new_u[i], new_mu[i], new_nu[i] = u[j], m[j], v[j]
        return (treedef.unflatten(new_u),
                AdamWState(count=count_inc, mu=treedef.unflatten(new_mu),
                           nu=treedef.unflatten(new_nu)))

    return step


def _hparams(lr, weight_decay, count_inc, b1, b2, dtype):
    """[lr, weight_decay, bias_correction1, bias_correction2], computed as optax computes them."""
    bc1 = 1 - b1**count_inc
    bc2 = 1 - b2**count_inc
    return jnp.stack([jnp.asarray(x).astype(dtype) for x in (lr, weight_decay, bc1, bc2)])


def _decay_flags(mask, updates, treedef, weight_decay) -> list[bool]:
    """One static bool per leaf: does it decay?"""
    n = treedef.num_leaves
    if weight_decay == 0:
        return [False] * n
    if mask is None:
        return [True] * n
    # Called on the updates, as optax.masked does (they have the params' structure and shapes).
    mask_tree = mask(updates) if callable(mask) else mask
    # A mask leaf covers its whole subtree of the params, as in optax.masked.
    full = jax.tree.map(lambda m, sub: jax.tree.map(lambda _: m, sub), mask_tree, updates)
    try:
        return [bool(f) for f in treedef.flatten_up_to(full)]
    except jax.errors.ConcretizationTypeError as e:
        raise TypeError("blujax.optim.adamw: mask values must be static Python bools, not "
                        "traced arrays") from e


def _finite_number(x) -> bool:
    return (isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)
            and math.isfinite(x))
