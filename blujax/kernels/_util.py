"""What every op wrapper needs around `jax.ffi.ffi_call`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from blujax._ffi import current_platform


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


def check_float64_platform(op: str, dtype) -> None:
    """float64 kernels exist on the CPU only."""
    if jnp.dtype(dtype) == jnp.float64 and current_platform() != "cpu":
        raise TypeError(f"{op}: float64 runs on the CPU kernels only; use float32 or bfloat16")


def check_feature_param(op: str, name: str, p, x) -> None:
    """A per-feature parameter (weight, bias) of x [..., C]: shape (C,) and x's dtype."""
    c = x.shape[-1]
    if p.shape != (c,):
        raise ValueError(
            f"{op}: {name} must have shape ({c},) to match the last axis of x "
            f"(shape {x.shape}), got {p.shape}"
        )
    if p.dtype != x.dtype:
        raise TypeError(f"{op}: {name} is {p.dtype} but x is {x.dtype}; use one dtype")


_FP8_INPUTS = (jnp.float32, jnp.bfloat16)
_FP8_FORMATS = (jnp.float8_e4m3fn, jnp.float8_e5m2)


def check_fp8(op: str, x, scale, dtype) -> None:
    """What an op's FP8 form (swiglu's, add_rms_norm's) takes beside the op's own operands: x
    float32 or bfloat16, dtype an FP8 format blujax.fp8 uses, scale a float32 scalar."""
    if hasattr(x, "dtype"):  # (else the op's own check says what x must be)
        check_dtype(op, "x", x, _FP8_INPUTS)
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in _FP8_FORMATS]:
        raise TypeError(f"{op}: dtype must be float8_e4m3fn or float8_e5m2, got "
                        f"{jnp.dtype(dtype).name}")
    if jnp.shape(scale) != () or jnp.result_type(scale) != jnp.float32:
        raise TypeError(f"{op}: scale must be a float32 scalar, got "
                        f"{jnp.result_type(scale).name} {jnp.shape(scale)}")
