"""FP8 matrix products for the blocks' linear layers, with per-tensor scales.

    recipe = fp8.Recipe(scaling="dynamic")           # or "delayed"; grad="e5m2" or "e4m3"
    y = fp8.matmul(x, w, recipe=recipe)              # x [..., K] @ w [K, N], bfloat16 out

Each product quantizes its two operands to float8_e4m3fn and multiplies them with float32
accumulation (XLA rewrites `scaled_dot` into one cuBLASLt FP8 call on a Hopper GPU, and
emulates it elsewhere); its backward quantizes the incoming gradient to `recipe.grad` (e5m2 by
default: two more exponent bits for the gradients' wide range, as Transformer Engine's hybrid
recipe) and runs both backward products (dx = g w^T, dw = x^T g) in FP8 too. What the backward
keeps of the forward is the FP8 copies (one byte an element, half of bfloat16's).

A per-tensor scale, a power of two, maps the tensor's absolute maximum (amax) into the format's
top binade: x ~ q * scale, q = clip(x / scale). Two ways to know the amax:

- "dynamic" (current): each tensor's own, taken just before it is cast (one more read of it).
- "delayed": the largest of the last `history` steps' amaxes, kept in the train state
  (`History`, checkpointed), so the cast needs no pass of its own first. A fresh state
  (`History.calibrated` False, a static field: the first step is its own program) scales its
  first step dynamically and records those amaxes. The current amaxes of every product ride
  back out of the backward as the history's "gradient" (the new history), and the train step
  takes them as the new state, reduced by max over micro-batches and devices (`merge`).

On a mesh each amax is reduced (max) over every device (`Hooks.amax_reduce`): the devices
holding parts of one tensor scale it alike, and a mesh computes what one device does.

Which products: the four of every block (PRODUCTS: the attention's input and output
projections, the MLP's two), where FP8 pays (`pays`: the measured rule; recipe.every puts all
four in FP8 whatever it says). The LM head and the embedding stay in the compute dtype.

The casts fused into our kernels: where a gated MLP's two products are both in FP8 and delayed
scaling knows every scale before the step (`fuses`), the MLP runs as one piece
(`swiglu_mlp`): SwiGLU's kernel writes the FP8 copy of its output (and its transpose, for the
weight gradient's product) and its amax in the pass that computes it, and its backward does
the same for the gradient the up product's backward takes. Neither bfloat16 tensor is written,
nor read again by a cast. The result is the products' to the bit (tests/test_fp8.py). Dynamic
scaling, delayed scaling's first step and collective matmul run product by product.

Compiling: on a GPU XLA autotunes Triton GEMM candidates for every FP8 product, which makes a
step compile for minutes (llama-1b: 89 s a program on an H200, and delayed scaling compiles two,
the first step being its own). `XLA_FLAGS=--xla_gpu_enable_triton_gemm=false` compiles it in
seconds and runs about 3% slower (benchmarks/LOG.md).

FP8 is a way to train: evaluation (train.make_eval_step) and sampling multiply in the compute
dtype, from the same float32 weights.
"""

from __future__ import annotations

import dataclasses
import itertools
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}
SCALINGS = ("dynamic", "delayed")
# The default (TrainConfig's and the command line's; benchmarks/RESULTS.md: delayed scaling's
# step is the faster, as its casts need no amax pass of their own first, at the same loss).
DEFAULT_SCALING = "delayed"
MODES = ("off", "on", "all")  # TrainConfig.fp8: none, where it pays, every block product

# A block's products, by the names the families' blocks give them.
PRODUCTS = ("qkv", "out", "up", "down")

# The measured rule (benchmarks/RESULTS.md, "FP8 products"): on an H200 an FP8 product with
# its casts beats bfloat16 once both the contracted and the output width reach this; below
# it the casts cost more than the faster product saves.
MIN_WIDTH = 1024


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How the FP8 products scale: "dynamic" or "delayed" (see the module's docstring); the
    gradients' format ("e5m2" or "e4m3"); the delayed amax history's length; every: all of a
    block's products in FP8, whether or not they pay (--fp8 all); calibrating: delayed scaling's
    first step (scale by the current amaxes, record them); fuse: run a gated MLP whose two
    products are in FP8 as one piece (`swiglu_mlp`) where it can (False: product by product,
    for comparison)."""

    scaling: str = "dynamic"
    grad: str = "e5m2"
    history: int = 16
    every: bool = False
    calibrating: bool = False
    fuse: bool = True

    def __post_init__(self):
        if self.scaling not in SCALINGS:
            raise ValueError(f"fp8 scaling must be one of {', '.join(SCALINGS)}, got "
                             f"{self.scaling!r}")
        if self.grad not in FORMATS:
            raise ValueError(f"fp8 gradient format must be one of {', '.join(FORMATS)}, got "
                             f"{self.grad!r}")
        if not isinstance(self.history, int) or self.history < 1:
            raise ValueError(f"fp8 history must be a positive int, got {self.history!r}")

    @property
    def delayed(self) -> bool:
        return self.scaling == "delayed"


def pays(k: int, n: int) -> bool:
    """Whether a product of a [M, k] by a [k, n] matrix runs faster in FP8, casts included
    (the measured rule; M, the tokens, is large in training)."""
    return k >= MIN_WIDTH and n >= MIN_WIDTH


# --------------------------------------------------------------------------------------------
# Scales and casts


def amax(x):
    """The absolute maximum of x, float32 []."""
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def scale_of(a, fmt):
    """The dequantizing scale for amax `a` in format `fmt`: the least power of two s with
    a / s at most fmt's largest finite value; 1 where a is 0 or not finite (nothing to scale,
    or nothing sensible). A power of two scales exactly (quantizing rounds only where the
    format does), and the product of two is exact in bfloat16, the type in which the FP8
    product's output scale rides into cuBLASLt (scaled_dot); the price is at most one binade
    of the format's range left unused at the top."""
    top = float(jnp.finfo(fmt).max)
    a = jnp.asarray(a, jnp.float32)
    ok = jnp.isfinite(a) & (a > 0)
    m, e = jnp.frexp(jnp.where(ok, a / top, 1.0))  # a / top = m 2^e, m in [0.5, 1)
    s = jnp.ldexp(jnp.float32(1.0), jnp.where(m == 0.5, e - 1, e))
    return jnp.where(ok & (s > 0), s, 1.0).astype(jnp.float32)


def quantize(x, scale, fmt):
    """x / scale, saturated to fmt's finite range and rounded to fmt (nearest even)."""
    top = float(jnp.finfo(fmt).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(fmt)


def scaled_dot(a, sa, b, sb, dims, dtype):
    """dot_general of FP8 a, b (contracting `dims`) times their scales sa sb (powers of two),
    in `dtype`: written as XLA's GEMM rewriter matches it. The FP8 operands go straight into
    a dot whose output type is `dtype`, and the output's scale is a `dtype` scalar: one
    cuBLASLt FP8 call that accumulates in float32, scales by sa sb and writes `dtype`. (A
    float32 dot cast after is a second pass over a float32 matrix; a scale in float32 on a
    bfloat16 dot is not matched; dequantizing the operands before the dot lets XLA fold the
    FP8 round trip away into a bfloat16 product.)"""
    out = jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=dtype)
    return out * (sa * sb).astype(dtype)


# --------------------------------------------------------------------------------------------
# The product


def _no_reduce(a):
    return a


def matmul(x, w, history=None, *, recipe: Recipe, amax_reduce: Callable = _no_reduce,
           whole_amax=None):
    """x [..., K] @ w [K, N] in FP8 (x's dtype out). history: this product's float32
    [3, recipe.history] amaxes of (x, w, the gradient) over the last steps, newest first, for
    delayed scaling (None for dynamic). amax_reduce: the max over the devices of a mesh.

    Its gradient with respect to `history` is the new history (the current amaxes shifted
    in), not a derivative: the train step takes it as the next state's (see `merge`).

    A product run slice by slice (collective matmul: one sequence slice of x a product)
    passes whole_amax, the amax of the whole x (reduced over the mesh): every slice then scales
    x, and records its amax, as the whole would (Hooks gives each slice its own copy of the
    history, `fan_out`)."""
    if history is None:
        if recipe.delayed:
            raise ValueError("fp8: delayed scaling needs the product's amax history")
        history = jnp.zeros((3, 0), jnp.float32)
    if x.shape[-1] != w.shape[0] or w.ndim != 2:
        raise ValueError(f"fp8.matmul: x {x.shape} @ w {w.shape} do not multiply")
    if whole_amax is not None:
        whole_amax = jax.lax.stop_gradient(jnp.asarray(whole_amax, jnp.float32))
    return _matmul(x, w, history, whole_amax, recipe, amax_reduce)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _matmul(x, w, history, whole_amax, recipe, amax_reduce):
    return _matmul_fwd(x, w, history, whole_amax, recipe, amax_reduce)[0]


def _scales(current, history, row, fmt, recipe):
    """The scale of one operand: from its history (delayed, calibrated) or its current amax."""
    if recipe.delayed and not recipe.calibrating:
        return scale_of(jnp.max(history[row]), fmt)
    return scale_of(current, fmt)


def _matmul_fwd(x, w, history, whole_amax, recipe, amax_reduce):
    ax = amax_reduce(amax(x)) if whole_amax is None else whole_amax
    aw = amax_reduce(amax(w))
    sx, sw = _scales(ax, history, 0, E4M3, recipe), _scales(aw, history, 1, E4M3, recipe)
    xq, wq = quantize(x, sx, E4M3), quantize(w, sw, E4M3)
    y = scaled_dot(xq, sx, wq, sw, ((x.ndim - 1,), (0,)), x.dtype)
    return y, (xq, sx, wq, sw, ax, aw, history, whole_amax)


def _matmul_bwd(recipe, amax_reduce, res, g):
    xq, sx, wq, sw, ax, aw, history, whole_amax = res
    dtype = g.dtype
    fmt = FORMATS[recipe.grad]
    ag = amax_reduce(amax(g))
    sg = _scales(ag, history, 2, fmt, recipe)
    gq = quantize(g, sg, fmt)
    dx = scaled_dot(gq, sg, wq, sw, ((g.ndim - 1,), (1,)), dtype)
    K, N = wq.shape
    dw = scaled_dot(xq.reshape(-1, K), sx, gq.reshape(-1, N), sg, ((0,), (0,)), dtype)
    if history.shape[1]:
        history = _shifted(history, ax, aw, ag)
    no_amax = None if whole_amax is None else jnp.zeros_like(whole_amax)
    return dx, dw.astype(dtype), history, no_amax


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def fan_out(history, n):
    """n copies [n, ...] of a history for n products that share it (the slices of a collective
    matmul). Its gradient is the max of the copies' (their new histories differ only in the
    newest amaxes, each slice's of what it saw), where an input used n times would get their
    sum."""
    return jnp.broadcast_to(history, (n, *history.shape))


def _fan_out_fwd(history, n):
    return fan_out(history, n), None


def _fan_out_bwd(n, _, g):
    return (jnp.max(g, axis=0),)


fan_out.defvjp(_fan_out_fwd, _fan_out_bwd)


# --------------------------------------------------------------------------------------------
# The gated MLP as one piece


def fuses(recipe: Recipe) -> bool:
    """Whether swiglu_mlp can run under `recipe`: its kernels write the FP8 copies in the pass
    that makes the tensor, so each scale must be known before it: delayed scaling's, from the
    history, after its calibrating first step."""
    return recipe.fuse and recipe.delayed and not recipe.calibrating


def swiglu_mlp(x, w_up, w_down, h_up, h_down, *, recipe: Recipe, ops,
               amax_reduce: Callable = _no_reduce):
    """swiglu(x @ w_up) @ w_down with both products in FP8, as the two `matmul`s around
    ops.swiglu compute it, in fewer passes: swiglu's FP8 forms (ops.swiglu_fwd_fp8,
    swiglu_bwd_fp8) write the FP8 copy of their output at its delayed scale, transposed too,
    and its amax, where the products would cast it in a pass of their own; swiglu's bfloat16
    output and the up product's bfloat16 gradient are never written.

    x [..., C]; w_up [C, 2F] (gate, up); w_down [F, N]; h_up, h_down: the two products'
    histories as `matmul` takes them. Delayed scaling after calibration only (`fuses`); the
    gradients with respect to h_up, h_down are their new histories, as `matmul`'s."""
    if not fuses(recipe):
        raise ValueError("fp8.swiglu_mlp needs delayed scaling's scales (a calibrated history)")
    C, F = x.shape[-1], w_down.shape[0]
    if w_up.shape != (C, 2 * F) or w_down.ndim != 2:
        raise ValueError(f"fp8.swiglu_mlp: x {x.shape}, w_up {w_up.shape} and w_down "
                         f"{w_down.shape} do not make a gated MLP (w_up must be [C, 2F] for "
                         f"w_down [F, N])")
    return _swiglu_mlp(x, w_up, w_down, h_up, h_down, recipe, ops, amax_reduce)


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _swiglu_mlp(x, w_up, w_down, h_up, h_down, recipe, ops, amax_reduce):
    return _swiglu_mlp_fwd(x, w_up, w_down, h_up, h_down, recipe, ops, amax_reduce)[0]


def _swiglu_mlp_fwd(x, w_up, w_down, h_up, h_down, recipe, ops, amax_reduce):
    dtype, F = x.dtype, w_down.shape[0]
    xs = x.reshape(-1, x.shape[-1])
    ax, a1, a2 = (amax_reduce(amax(t)) for t in (xs, w_up, w_down))
    sx, s1 = _scales(ax, h_up, 0, E4M3, recipe), _scales(a1, h_up, 1, E4M3, recipe)
    sa, s2 = _scales(None, h_down, 0, E4M3, recipe), _scales(a2, h_down, 1, E4M3, recipe)
    xq, w1q, w2q = quantize(xs, sx, E4M3), quantize(w_up, s1, E4M3), quantize(w_down, s2, E4M3)
    h = scaled_dot(xq, sx, w1q, s1, ((1,), (0,)), dtype).reshape(-1, 2, F)
    aq, aqt, aa = ops.swiglu_fwd_fp8(h, sa, E4M3)
    y = scaled_dot(aq, sa, w2q, s2, ((1,), (0,)), dtype)
    amaxes = (ax, a1, amax_reduce(aa), a2)
    res = (xq, sx, w1q, s1, h, aqt, sa, w2q, s2, amaxes, h_up, h_down, x.shape)
    return y.reshape(*x.shape[:-1], -1), res


def _swiglu_mlp_bwd(recipe, ops, amax_reduce, res, g):
    xq, sx, w1q, s1, h, aqt, sa, w2q, s2, (ax, a1, aa, a2), h_up, h_down, shape = res
    dtype, fmt, F = g.dtype, FORMATS[recipe.grad], w2q.shape[0]
    gs = g.reshape(-1, g.shape[-1])
    ag = amax_reduce(amax(gs))
    sg = _scales(ag, h_down, 2, fmt, recipe)
    gq = quantize(gs, sg, fmt)
    da = scaled_dot(gq, sg, w2q, s2, ((1,), (1,)), dtype)  # [M, F]
    dw2 = scaled_dot(aqt, sa, gq, sg, ((1,), (0,)), dtype)  # [F, N]
    sd = _scales(None, h_up, 2, fmt, recipe)
    dq, dqt, ad = ops.swiglu_bwd_fp8(da, h, sd, fmt)  # d(gate, up) [M, 2F] and [2F, M]
    dx = scaled_dot(dq, sd, w1q, s1, ((1,), (1,)), dtype)  # [M, C]
    dw1 = scaled_dot(xq, sx, dqt, sd, ((0,), (1,)), dtype)  # [C, 2F]
    return (dx.reshape(shape), dw1, dw2, _shifted(h_up, ax, a1, amax_reduce(ad)),
            _shifted(h_down, aa, a2, ag))


_swiglu_mlp.defvjp(_swiglu_mlp_fwd, _swiglu_mlp_bwd)


def _shifted(history, *now):
    """history [3, length] with the step's amaxes (input, weight, gradient) in front."""
    return jnp.concatenate([jnp.stack(now)[:, None], history[:, :-1]], axis=1)


# --------------------------------------------------------------------------------------------
# The state of delayed scaling


@dataclasses.dataclass(frozen=True)
class History:
    """Delayed scaling's state: for each block product (PRODUCTS) float32 [n_layer, 3,
    length] amaxes of (input, weight, gradient), newest first. calibrated (static: a pytree
    meta field, so the first step compiles on its own) is False for a fresh history."""

    amaxes: dict
    calibrated: bool = False


jax.tree_util.register_dataclass(History, data_fields=["amaxes"], meta_fields=["calibrated"])


def init_history(recipe: Recipe | None, n_layer: int) -> History | None:
    """A fresh History for a model of n_layer blocks (None unless the recipe is delayed)."""
    if recipe is None or not recipe.delayed:
        return None
    return History({name: jnp.zeros((n_layer, 3, recipe.history), jnp.float32)
                    for name in PRODUCTS})


def merge(a, b):
    """Two new histories of one step (micro-batches, devices) as one: their elementwise max
    (they differ only in the newest amaxes)."""
    return jax.tree.map(jnp.maximum, a, b)


def stepped(history: History, new_amaxes: dict, keep) -> History:
    """The state after a step: its new amaxes where `keep` (a finite step), else as it was;
    calibrated from now on."""
    amaxes = jax.tree.map(lambda n, o: jnp.where(keep, n, o), new_amaxes, history.amaxes)
    return History(amaxes, True)


# --------------------------------------------------------------------------------------------
# The hooks of one layer


@dataclasses.dataclass(frozen=True)
class Layer:
    """What one block's products need: the recipe and (delayed) this layer's histories
    {name: [3, length]}."""

    recipe: Recipe
    histories: Any = None


class Hooks:
    """A device's hooks (family.OneDevice, sharding.Parallel) for one layer, with the block's
    named products in FP8 where the recipe puts them: everything else is the device's."""

    def __init__(self, par, layer: Layer):
        self._par, self._layer = par, layer

    def __getattr__(self, name):
        return getattr(self._par, name)

    def _dot(self, name, x):
        """The product `name` as the device's hooks call it on x (this device's part, before
        any gather): in FP8 where the recipe puts it. Where the device runs it slice by slice
        (collective matmul), every slice scales x by the amax of the whole and has its own
        copy of the history (`fan_out`), taken in the order the slices run. (The gradient's
        scale under dynamic scaling, and on delayed scaling's first step, is still each
        slice's: the amax of the gradient rows the devices hold at that slice.)"""
        recipe = self._layer.recipe
        histories = self._layer.histories
        n = getattr(self._par, "slices", 1)
        reduce = self._par.amax_reduce
        calls = itertools.count()
        copies = {}

        def dot(x_part, w):
            if name not in PRODUCTS or not (recipe.every or pays(*w.shape)):
                return x_part @ w
            if n == 1:
                h = None if histories is None else histories[name]
                return matmul(x_part, w, h, recipe=recipe, amax_reduce=reduce)
            if not copies:  # the first slice: what every slice shares
                # (Not differentiated: an amax only picks a scale.)
                copies["whole"] = reduce(amax(jax.lax.stop_gradient(x)))
                copies["h"] = None if histories is None else fan_out(histories[name], n)
            h = None if copies["h"] is None else copies["h"][next(calls) % n]
            return matmul(x_part, w, h, recipe=recipe, amax_reduce=reduce,
                          whole_amax=copies["whole"])

        return dot

    def swiglu_mlp(self, ops, x, w_up, w_down):
        """The gated MLP (family.swiglu_mlp): as one FP8 piece (`swiglu_mlp`) where both its
        products are in FP8, the recipe `fuses` and the device runs each product whole;
        else product by product through these hooks."""
        # (blujax.model imports this module)
        from blujax.model.family import saved, swiglu_mlp as by_products

        recipe, histories = self._layer.recipe, self._layer.histories
        whole = getattr(self._par, "slices", 1) == 1
        in_fp8 = recipe.every or (pays(*w_up.shape) and pays(*w_down.shape))
        if not (in_fp8 and whole and fuses(recipe)):
            return by_products(self, ops, x, w_up, w_down)
        y = swiglu_mlp(self._par.gather_sequence(x), w_up, w_down, histories["up"],
                       histories["down"], recipe=recipe, ops=ops,
                       amax_reduce=self._par.amax_reduce)
        return saved(self._par.reduce_sequence(y))

    def gather_matmul(self, x, w, name=None):
        return self._par.gather_matmul(x, w, name, dot=self._dot(name, x))

    def matmul_reduce(self, x, w, name=None):
        return self._par.matmul_reduce(x, w, name, dot=self._dot(name, x))
