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

The casts fused into our kernels: where the products are in FP8 and delayed scaling knows
every scale before the step (`fuses`), a product runs as one piece with the kernels beside it,
which write the FP8 copy of what they make (and its transpose, for the weight gradient's
product) and its amax in the pass that computes it:
- `norm_swiglu_mlp`: add_rms_norm, the up product, SwiGLU, the down product. The norm's FP8
  form writes the up product's input; SwiGLU's forms write the down product's input and the
  gradient the up product's backward takes (`swiglu_mlp` is the same piece without the norm,
  where a sequence gather comes between the two).
- `norm_matmul`: add_rms_norm and the attention's input product.
No bfloat16 copy of those tensors is written, nor read again by a cast. Each piece computes
the norm and products' results to the bit (tests/test_fp8.py). Dynamic scaling, delayed
scaling's first step and collective matmul run product by product.

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
# Pieces: the products with the kernels beside them


def fuses(recipe: Recipe) -> bool:
    """Whether the pieces can run under `recipe`: their kernels write the FP8 copies in the
    pass that makes the tensor, so each scale must be known before it: delayed scaling's, from
    the history, after its calibrating first step."""
    return recipe.fuse and recipe.delayed and not recipe.calibrating


def _check_fuses(piece, recipe):
    if not fuses(recipe):
        raise ValueError(f"fp8.{piece} needs delayed scaling's scales (a calibrated history)")


def _check_mlp(piece, c, w_up, w_down):
    F = w_down.shape[0]
    if w_up.shape != (c, 2 * F) or w_down.ndim != 2:
        raise ValueError(f"fp8.{piece}: x [..., {c}], w_up {w_up.shape} and w_down "
                         f"{w_down.shape} do not make a gated MLP (w_up must be [C, 2F] for "
                         f"w_down [F, N])")


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
    _check_fuses("swiglu_mlp", recipe)
    _check_mlp("swiglu_mlp", x.shape[-1], w_up, w_down)
    return _swiglu_mlp(x, w_up, w_down, h_up, h_down, recipe, ops, amax_reduce)


def norm_matmul(x, residual, gamma, w, history, *, eps: float, recipe: Recipe, ops,
                amax_reduce: Callable = _no_reduce):
    """(rms_norm(s) @ w, s) with s = x + residual (ops.add_rms_norm's), the product in FP8:
    as `matmul` on add_rms_norm's output computes it, in fewer passes: add_rms_norm's FP8 form
    (ops.add_rms_norm_fwd_fp8) writes the normalised rows' FP8 copy at their delayed scale,
    transposed too, and their amax, where the product would cast them in a pass of their own;
    the bfloat16 normalised rows are never written. Its backward is add_rms_norm's
    (ops.add_rms_norm_bwd) on the product's.

    x, residual [..., C]; gamma [C]; w [C, N]; history: the product's, as `matmul` takes it.
    Delayed scaling after calibration only (`fuses`)."""
    _check_fuses("norm_matmul", recipe)
    if x.shape[-1] != w.shape[0] or w.ndim != 2:
        raise ValueError(f"fp8.norm_matmul: x {x.shape} @ w {w.shape} do not multiply")
    return _norm_matmul(x, residual, gamma, w, history, float(eps), recipe, ops, amax_reduce)


def norm_swiglu_mlp(x, residual, gamma, w_up, w_down, h_up, h_down, *, eps: float,
                    recipe: Recipe, ops, amax_reduce: Callable = _no_reduce):
    """(swiglu_mlp(rms_norm(s)), s) with s = x + residual: `norm_matmul`'s norm in front of
    `swiglu_mlp`, so that the up product too takes an FP8 copy its kernel wrote."""
    _check_fuses("norm_swiglu_mlp", recipe)
    _check_mlp("norm_swiglu_mlp", x.shape[-1], w_up, w_down)
    return _norm_swiglu_mlp(x, residual, gamma, w_up, w_down, h_up, h_down, float(eps),
                            recipe, ops, amax_reduce)


# What the pieces share. An input stage makes the first product's FP8 input: a cast (`_cast`)
# or add_rms_norm's FP8 form (`_norm`, which also writes the transpose the weight-gradient
# product takes); then one product (`_product_*`) or the gated MLP (`_mlp_*`); the backward
# gives the input stage the first product's bfloat16 input gradient.


def _cast_weight(w, history, recipe, reduce):
    a = reduce(amax(w))
    s = _scales(a, history, 1, E4M3, recipe)
    return quantize(w, s, E4M3), s, a


def _cast(x, history, recipe, reduce):
    """x as rows [M, C] cast at its scale: (xq, its wgrad operand (xq, contracted axis 0), sx,
    ax)."""
    xs = x.reshape(-1, x.shape[-1])
    ax = reduce(amax(xs))
    sx = _scales(ax, history, 0, E4M3, recipe)
    xq = quantize(xs, sx, E4M3)
    return xq, (xq, 0), sx, ax


def _norm(x, residual, gamma, history, eps, recipe, ops, reduce):
    """add_rms_norm's FP8 form: (xq, its wgrad operand (xqt, contracted axis 1), sx, ax, s,
    what the norm's backward needs)."""
    sx = _scales(None, history, 0, E4M3, recipe)
    xq, xqt, ax, s, rstd = ops.add_rms_norm_fwd_fp8(x, residual, gamma, sx, E4M3, eps=eps)
    return xq, (xqt, 1), sx, reduce(ax), s, (s, gamma, rstd)


def _norm_bwd(dn, ds, norm_res, eps, ops):
    s, gamma, rstd = norm_res
    dx, dgamma = ops.add_rms_norm_bwd(dn.reshape(s.shape), ds, s, gamma, rstd, eps=eps)
    return dx, dx, dgamma


def _wgrad(x_op, sx, gq, sg, dtype):
    """x^T g [C, N] from the input's wgrad operand (rows, or their transpose) and g [M, N]."""
    xm, axis = x_op
    return scaled_dot(xm, sx, gq, sg, ((axis,), (0,)), dtype)


def _grad_cast(g, history, fmt, recipe, reduce):
    gs = g.reshape(-1, g.shape[-1])
    ag = reduce(amax(gs))
    sg = _scales(ag, history, 2, fmt, recipe)
    return quantize(gs, sg, fmt), sg, ag


def _product_fwd(xq, sx, w, history, recipe, reduce, dtype):
    wq, sw, aw = _cast_weight(w, history, recipe, reduce)
    return scaled_dot(xq, sx, wq, sw, ((1,), (0,)), dtype), (wq, sw, aw)


def _product_bwd(g, x_op, sx, ax, res, history, recipe, reduce):
    """(dx [M, C], dw, the new history)."""
    wq, sw, aw = res
    gq, sg, ag = _grad_cast(g, history, FORMATS[recipe.grad], recipe, reduce)
    dx = scaled_dot(gq, sg, wq, sw, ((1,), (1,)), g.dtype)
    dw = _wgrad(x_op, sx, gq, sg, g.dtype)
    return dx, dw, _shifted(history, ax, aw, ag)


def _mlp_fwd(xq, sx, w_up, w_down, h_up, h_down, recipe, ops, reduce, dtype):
    F = w_down.shape[0]
    w1q, s1, a1 = _cast_weight(w_up, h_up, recipe, reduce)
    w2q, s2, a2 = _cast_weight(w_down, h_down, recipe, reduce)
    sa = _scales(None, h_down, 0, E4M3, recipe)
    h = scaled_dot(xq, sx, w1q, s1, ((1,), (0,)), dtype).reshape(-1, 2, F)
    aq, aqt, aa = ops.swiglu_fwd_fp8(h, sa, E4M3)
    y = scaled_dot(aq, sa, w2q, s2, ((1,), (0,)), dtype)
    return y, (w1q, s1, a1, h, aqt, sa, reduce(aa), w2q, s2, a2)


def _mlp_bwd(g, x_op, sx, ax, res, h_up, h_down, recipe, ops, reduce):
    """(dx [M, C], dw_up, dw_down, the new h_up, h_down)."""
    w1q, s1, a1, h, aqt, sa, aa, w2q, s2, a2 = res
    dtype, fmt = g.dtype, FORMATS[recipe.grad]
    gq, sg, ag = _grad_cast(g, h_down, fmt, recipe, reduce)
    da = scaled_dot(gq, sg, w2q, s2, ((1,), (1,)), dtype)  # [M, F]
    dw2 = scaled_dot(aqt, sa, gq, sg, ((1,), (0,)), dtype)  # [F, N]
    sd = _scales(None, h_up, 2, fmt, recipe)
    dq, dqt, ad = ops.swiglu_bwd_fp8(da, h, sd, fmt)  # d(gate, up) [M, 2F] and [2F, M]
    dx = scaled_dot(dq, sd, w1q, s1, ((1,), (1,)), dtype)  # [M, C]
    xm, axis = x_op
    dw1 = scaled_dot(xm, sx, dqt, sd, ((axis,), (1,)), dtype)  # [C, 2F]
    return (dx, dw1, dw2, _shifted(h_up, ax, a1, reduce(ad)), _shifted(h_down, aa, a2, ag))


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _swiglu_mlp(x, w_up, w_down, h_up, h_down, recipe, ops, amax_reduce):
    return _swiglu_mlp_fwd(x, w_up, w_down, h_up, h_down, recipe, ops, amax_reduce)[0]


def _swiglu_mlp_fwd(x, w_up, w_down, h_up, h_down, recipe, ops, amax_reduce):
    xq, x_op, sx, ax = _cast(x, h_up, recipe, amax_reduce)
    y, res = _mlp_fwd(xq, sx, w_up, w_down, h_up, h_down, recipe, ops, amax_reduce, x.dtype)
    return y.reshape(*x.shape[:-1], -1), (x_op, sx, ax, res, h_up, h_down, x.shape)


def _swiglu_mlp_bwd(recipe, ops, amax_reduce, saved_, g):
    x_op, sx, ax, res, h_up, h_down, shape = saved_
    dx, *rest = _mlp_bwd(g, x_op, sx, ax, res, h_up, h_down, recipe, ops, amax_reduce)
    return (dx.reshape(shape), *rest)


_swiglu_mlp.defvjp(_swiglu_mlp_fwd, _swiglu_mlp_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _norm_matmul(x, residual, gamma, w, history, eps, recipe, ops, amax_reduce):
    return _norm_matmul_fwd(x, residual, gamma, w, history, eps, recipe, ops, amax_reduce)[0]


def _norm_matmul_fwd(x, residual, gamma, w, history, eps, recipe, ops, amax_reduce):
    xq, x_op, sx, ax, s, norm_res = _norm(x, residual, gamma, history, eps, recipe, ops,
                                          amax_reduce)
    y, res = _product_fwd(xq, sx, w, history, recipe, amax_reduce, x.dtype)
    return (y.reshape(*x.shape[:-1], -1), s), (x_op, sx, ax, res, history, norm_res)


def _norm_matmul_bwd(eps, recipe, ops, amax_reduce, saved_, cts):
    x_op, sx, ax, res, history, norm_res = saved_
    dy, ds = cts
    dn, dw, new = _product_bwd(dy, x_op, sx, ax, res, history, recipe, amax_reduce)
    return (*_norm_bwd(dn, ds, norm_res, eps, ops), dw, new)


_norm_matmul.defvjp(_norm_matmul_fwd, _norm_matmul_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _norm_swiglu_mlp(x, residual, gamma, w_up, w_down, h_up, h_down, eps, recipe, ops,
                     amax_reduce):
    return _norm_swiglu_mlp_fwd(x, residual, gamma, w_up, w_down, h_up, h_down, eps, recipe,
                                ops, amax_reduce)[0]


def _norm_swiglu_mlp_fwd(x, residual, gamma, w_up, w_down, h_up, h_down, eps, recipe, ops,
                         amax_reduce):
    xq, x_op, sx, ax, s, norm_res = _norm(x, residual, gamma, h_up, eps, recipe, ops,
                                          amax_reduce)
    y, res = _mlp_fwd(xq, sx, w_up, w_down, h_up, h_down, recipe, ops, amax_reduce, x.dtype)
    return (y.reshape(*x.shape[:-1], -1), s), (x_op, sx, ax, res, h_up, h_down, norm_res)


def _norm_swiglu_mlp_bwd(eps, recipe, ops, amax_reduce, saved_, cts):
    x_op, sx, ax, res, h_up, h_down, norm_res = saved_
    dy, ds = cts
    dn, *rest = _mlp_bwd(dy, x_op, sx, ax, res, h_up, h_down, recipe, ops, amax_reduce)
    return (*_norm_bwd(dn, ds, norm_res, eps, ops), *rest)


_norm_swiglu_mlp.defvjp(_norm_swiglu_mlp_fwd, _norm_swiglu_mlp_bwd)


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


def _saved(y):
    """y named for the recomputation policy, as the hooks name a product's output."""
    from blujax.model.family import saved  # (blujax.model imports this module)
    return saved(y)


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

    @staticmethod
    def _sublayers():
        from blujax.model.family import Sublayers  # (blujax.model imports this module)
        return Sublayers

    def _in_fp8(self, *weights):
        return self._layer.recipe.every or all(pays(*w.shape) for w in weights)

    def _fuses(self, *weights):
        """Whether a piece over these products' weights runs fused: all in FP8, the recipe
        `fuses`, and the device runs each product whole (not slice by slice)."""
        return (self._in_fp8(*weights) and fuses(self._layer.recipe)
                and getattr(self._par, "slices", 1) == 1)

    def _norm_fuses(self, *weights):
        """The same for a piece that begins with the norm: also the sequence is whole here
        (no gather between the norm and the product)."""
        return self._fuses(*weights) and not self._par.splits_sequence

    def swiglu_mlp(self, ops, x, w_up, w_down):
        """The gated MLP (family.Sublayers.swiglu_mlp): as one FP8 piece (`swiglu_mlp`) where
        it `_fuses`, else product by product through these hooks."""
        if not self._fuses(w_up, w_down):
            return self._sublayers().swiglu_mlp(self, ops, x, w_up, w_down)
        h = self._layer.histories
        y = swiglu_mlp(self._par.gather_sequence(x), w_up, w_down, h["up"], h["down"],
                       recipe=self._layer.recipe, ops=ops, amax_reduce=self._par.amax_reduce)
        return _saved(self._par.reduce_sequence(y))

    def norm_matmul(self, ops, x, residual, gamma, w, name, *, eps):
        """add_rms_norm, then the product `name` (family.Sublayers.norm_matmul): as one FP8
        piece (`norm_matmul`) where it `_norm_fuses`, else the norm and then the product."""
        if name not in PRODUCTS or not self._norm_fuses(w):
            return self._sublayers().norm_matmul(self, ops, x, residual, gamma, w, name,
                                                  eps=eps)
        y, s = norm_matmul(x, residual, gamma, w, self._layer.histories[name], eps=eps,
                           recipe=self._layer.recipe, ops=ops,
                           amax_reduce=self._par.amax_reduce)
        return _saved(y), s

    def norm_swiglu_mlp(self, ops, x, residual, gamma, w_up, w_down, *, eps):
        """add_rms_norm, then the gated MLP (family.Sublayers.norm_swiglu_mlp): as one FP8
        piece (`norm_swiglu_mlp`) where it `_norm_fuses`, else the norm and then the MLP."""
        if not self._norm_fuses(w_up, w_down):
            return self._sublayers().norm_swiglu_mlp(self, ops, x, residual, gamma, w_up, w_down,
                                             eps=eps)
        h = self._layer.histories
        y, s = norm_swiglu_mlp(x, residual, gamma, w_up, w_down, h["up"], h["down"], eps=eps,
                               recipe=self._layer.recipe, ops=ops,
                               amax_reduce=self._par.amax_reduce)
        return _saved(y), s

    def gather_matmul(self, x, w, name=None):
        return self._par.gather_matmul(x, w, name, dot=self._dot(name, x))

    def matmul_reduce(self, x, w, name=None):
        return self._par.matmul_reduce(x, w, name, dot=self._dot(name, x))
