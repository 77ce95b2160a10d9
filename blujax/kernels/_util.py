"""What every op wrapper needs around `jax.ffi.ffi_call`."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def result_type(like: jax.Array, shape=None, dtype=None) -> jax.ShapeDtypeStruct:
    """An ffi_call result type shaped like `like`, keeping its varying-manual-axes type.

    Inside `shard_map` a bare `ShapeDtypeStruct` would be typed as replicated, and gradients
    of the custom_vjp would fail the manual-axis type check.
    """
    aval = jax.typeof(like)
    return aval.update(
        shape=aval.shape if shape is None else tuple(shape),
        dtype=aval.dtype if dtype is None else jnp.dtype(dtype),
    )


def _varying(x) -> frozenset:
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def match_vma(*xs):
    """Casts every input to the union of their varying manual axes (a no-op outside shard_map).

    A replicated parameter (say a LayerNorm weight) that meets a sharded activation is then
    varying too; the transpose of that cast is a `psum`, so JAX sums its gradient over the
    devices for us.
    """
    union = frozenset().union(*(_varying(x) for x in xs))
    if not union:
        return xs
    return tuple(
        jax.lax.pcast(x, tuple(sorted(union - _varying(x))), to="varying")
        if union - _varying(x)
        else x
        for x in xs
    )


def check_dtype(op: str, name: str, x, allowed) -> None:
    if jnp.dtype(x.dtype) not in [jnp.dtype(a) for a in allowed]:
        names = ", ".join(jnp.dtype(a).name for a in allowed)
        raise TypeError(f"{op}: {name} has dtype {jnp.dtype(x.dtype).name}; supported: {names}")
