"""Softmax cross-entropy over the last axis of the logits, on our FFI kernels.

Kernels: xla_ext/cpu/cross_entropy.cc (float32, float64, bfloat16) and
xla_ext/cuda/cross_entropy.cu (float32, bfloat16); arithmetic is float32 (float64 for float64
logits). The forward reads the logits once and saves the per-row log-sum-exp; the backward
reads them once more and writes dlogits in the same pass, into the logits' own buffer (see
`softmax_cross_entropy`). The jnp specification is `blujax.kernels.xla.softmax_cross_entropy`.

`softmax_cross_entropy_mean` is the mean of those losses, the usual training loss. Its gradient
per row is softmax - onehot times the cotangent over the row count, and the cotangent of the
loss itself is known before any backward (1 under `jax.grad`), so when it is differentiated
its forward is one kernel that reads each row once and writes dlogits from it while the row is
on chip: fwd+bwd is one read and one write of the logits instead of two reads and a write.

For logits split over devices along the vocabulary (tensor parallelism), the same kernels are
exposed per row: `cross_entropy_stats` gives each device's partial (max, sum of exps, target
logit), the caller combines them with `pmax`/`psum`, and `cross_entropy_grad` writes each
device's slice of dlogits from the global log-sum-exp. `vocab_parallel_softmax_cross_entropy`
is that recipe, written out, for use inside `shard_map`.
"""

from __future__ import annotations

import operator
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from blujax._ffi import require_kernels
from blujax.kernels._util import check_dtype, check_float64_platform, match_vma, result_type

_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float64)
_INT32 = np.iinfo(np.int32)


def softmax_cross_entropy(logits, targets, *, ignore_index: int = -1,
                          num_classes: int | None = None):
    """Per-row loss logsumexp(logits[n, :num_classes]) - logits[n, targets[n]].

    logits: [N, V] float32, bfloat16 or float64 (float64 on the CPU only). targets: [N] int32
    (int64 is accepted and narrowed without changing any row's outcome). Returns float32 [N]
    (float64 for float64 logits).

    Rows whose target equals ignore_index give 0 and no gradient. A target outside [0, V)
    that is not ignore_index gives NaN for its row, and a NaN gradient row; it is never used
    to index the logits.

    num_classes (default V): only the first num_classes columns are classes. The rest (a
    vocabulary padded to a multiple of 128 for the matrix units, say) are not read and get a
    zero gradient, and a target >= num_classes is outside the vocabulary. This is the loss of
    logits[:, :num_classes] without the copy that slice would make.

    The gradient is written into the logits' buffer (an XLA input/output alias): inside a jitted
    training step, where the logits are an intermediate that nothing reads after the backward,
    that saves a second [N, V] buffer. Where the logits are still needed (returned, read by a
    later op, or a non-donated argument of the jitted function) XLA copies them first, so the
    results are always correct; the copy costs one extra read and write of the logits.
    """
    op = "softmax_cross_entropy"
    targets, ignore_index = _prepare(op, logits, targets, ignore_index)
    classes = _num_classes(op, num_classes, logits.shape[-1])
    return _softmax_cross_entropy(logits, targets, ignore_index, classes, True)


def softmax_cross_entropy_mean(logits, targets, *, ignore_index: int = -1,
                               num_classes: int | None = None):
    """The mean of `softmax_cross_entropy` over the rows whose target is not ignore_index.

    A float32 scalar (float64 for float64 logits); 0.0 when every row is ignored. Arguments,
    checks and rules are those of `softmax_cross_entropy`: a row whose target is outside the
    vocabulary makes the mean NaN (and its gradient row NaN).

    Differentiated, the forward computes the gradient too: one kernel reads each row of the
    logits once and writes its row of dlogits = (softmax - onehot) / count, into the logits'
    buffer as `softmax_cross_entropy` describes; the backward only multiplies by the cotangent,
    which XLA removes where that is the 1 of `jax.grad`. Not differentiated (an eval step), it
    runs the loss-only forward kernel.
    """
    op = "softmax_cross_entropy_mean"
    targets, ignore_index = _prepare(op, logits, targets, ignore_index)
    classes = _num_classes(op, num_classes, logits.shape[-1])
    return _softmax_cross_entropy_mean(logits, targets, ignore_index, classes, True)


def _softmax_cross_entropy_mean_unaliased(logits, targets, *, ignore_index: int = -1,
                                          num_classes: int | None = None):
    """softmax_cross_entropy_mean whose gradient gets a buffer of its own (for the benchmarks),
    as `_softmax_cross_entropy_unaliased`."""
    op = "softmax_cross_entropy_mean"
    targets, ignore_index = _prepare(op, logits, targets, ignore_index)
    classes = _num_classes(op, num_classes, logits.shape[-1])
    return _softmax_cross_entropy_mean(logits, targets, ignore_index, classes, False)


def _softmax_cross_entropy_unaliased(logits, targets, *, ignore_index: int = -1,
                                     num_classes: int | None = None):
    """softmax_cross_entropy whose gradient gets a buffer of its own (for the benchmarks).

    Same kernels and bytes; it only avoids the copy XLA inserts when the logits are a live,
    non-donated input of the jitted program, as they are in a benchmark but not in training.
    """
    op = "softmax_cross_entropy"
    targets, ignore_index = _prepare(op, logits, targets, ignore_index)
    classes = _num_classes(op, num_classes, logits.shape[-1])
    return _softmax_cross_entropy(logits, targets, ignore_index, classes, False)


def cross_entropy_stats(logits, targets, *, vocab_start=0, num_classes: int | None = None):
    """Per-row partial statistics of a slice of the vocabulary: (row_max, sum_exp, target_logit).

    logits: [N, V] holds classes [vocab_start, vocab_start + V) of a larger vocabulary;
    targets: [N] global class ids; vocab_start: a Python int or an integer scalar array (inside
    `shard_map`, e.g. `lax.axis_index("tensor") * V`). For each row, in float32 (float64 for
    float64 logits):

        row_max      = max(logits[n])  (at least the most negative finite value)
        sum_exp      = sum(exp(logits[n] - row_max))
        target_logit = logits[n, targets[n] - vocab_start] if that class is in this slice, else 0

    Over devices that each hold one slice (axis name "tensor"):

        m = lax.pmax(row_max, "tensor")
        lse = m + log(lax.psum(sum_exp * exp(row_max - m), "tensor"))
        loss = lse - lax.psum(target_logit, "tensor")

    then set the loss of ignored rows to 0, and lse (hence the loss) of rows whose target is
    outside the whole vocabulary to NaN. num_classes (default: no limit) is the size of the
    whole vocabulary: global columns from it on (padding) are left out of every statistic. Each
    device's slice of the gradient is then
    `cross_entropy_grad(logits, targets, lse, dloss, vocab_start=..., ignore_index=...)`.
    Not differentiable itself; `vocab_parallel_softmax_cross_entropy` is this recipe inside a
    custom_vjp.
    """
    op = "cross_entropy_stats"
    targets, _ = _prepare(op, logits, targets, ignore_index=-1)
    start = _vocab_start(op, vocab_start)
    return _stats_call(logits, targets, start, _num_classes(op, num_classes, None))


def cross_entropy_grad(logits, targets, lse, g, *, vocab_start=0, ignore_index: int = -1,
                       num_classes: int | None = None):
    """dlogits = (exp(logits - lse) - onehot(targets - vocab_start)) * g[:, None], in one pass.

    logits: [N, V], classes [vocab_start, vocab_start + V) of the vocabulary; targets: [N]
    global class ids; lse: [N] the log-sum-exp over the whole vocabulary (a NaN row gives a
    NaN gradient row); g: [N] the loss cotangent; lse and g are float32 (float64 for float64
    logits). Rows whose target equals ignore_index are zeros, as are the columns of global
    index num_classes and beyond (default: no limit). Returns dlogits like logits,
    written into the logits' buffer as `softmax_cross_entropy` describes.
    """
    op = "cross_entropy_grad"
    targets, ignore_index = _prepare(op, logits, targets, ignore_index)
    want = jax.ShapeDtypeStruct(logits.shape[:1], _stat_dtype(logits.dtype))
    for name, v in (("lse", lse), ("g", g)):
        if v.shape != want.shape or v.dtype != want.dtype:
            raise TypeError(f"{op}: {name} must be {want.dtype.name}{list(want.shape)} for "
                            f"{logits.dtype.name} logits, got {v.dtype.name}{list(v.shape)}")
    start = _vocab_start(op, vocab_start)
    return _grad_call(logits, targets, lse, g, start, ignore_index,
                      _num_classes(op, num_classes, None))


def vocab_parallel_softmax_cross_entropy(logits, targets, *, axis_name, ignore_index: int = -1,
                                         num_classes: int | None = None):
    """`softmax_cross_entropy` of logits split along the vocabulary over `axis_name`.

    Call inside `shard_map`: device i of the axis holds logits[:, i * V : (i + 1) * V] as its
    [N, V] block; targets [N] are global ids, the same on every device of the axis. Returns
    the per-row loss [N], the same on every device of the axis (invariant over it), with the
    ignore_index and out-of-range rules of `softmax_cross_entropy` applied to the whole
    vocabulary. num_classes (default: all columns of all devices) is the size of the real
    vocabulary, the padded columns after it being left out as in `softmax_cross_entropy`.
    Each device's block of the gradient stays on that device; the forward
    exchanges three [N] vectors (one pmax, two psums), the backward nothing.
    """
    op = "vocab_parallel_softmax_cross_entropy"
    targets, ignore_index = _prepare(op, logits, targets, ignore_index)
    return _vocab_parallel(logits, targets, ignore_index, axis_name,
                           _num_classes(op, num_classes, None))


# --- checks ---------------------------------------------------------------------------------------

def _prepare(op, logits, targets, ignore_index):
    """Checks the arguments every entry shares; returns (int32 targets, ignore_index)."""
    _check_logits(op, logits)
    _check_targets(op, targets, logits)
    ignore_index = _check_ignore_index(op, ignore_index)
    require_kernels(op)
    return _as_int32(targets, ignore_index), ignore_index


def _check_logits(op, logits):
    if logits.ndim != 2:
        raise ValueError(f"{op}: logits must be [N, V] (rows, classes), got shape {logits.shape}")
    if logits.shape[1] == 0:
        raise ValueError(f"{op}: logits has no classes (shape {logits.shape})")
    if logits.shape[1] > _INT32.max:
        raise ValueError(f"{op}: at most 2^31 - 1 classes, got {logits.shape[1]}")
    check_dtype(op, "logits", logits, _DTYPES)
    check_float64_platform(op, logits.dtype)


def _check_targets(op, targets, logits):
    dtype = jnp.dtype(targets.dtype)
    if dtype not in (jnp.dtype(jnp.int32), jnp.dtype(jnp.int64)):
        raise TypeError(f"{op}: targets must be int32 (or int64) class ids, got {dtype.name}")
    if targets.shape != logits.shape[:1]:
        raise ValueError(f"{op}: targets must have shape ({logits.shape[0]},), one class id per "
                         f"row of logits {logits.shape}, got {targets.shape}")


def _check_ignore_index(op, ignore_index) -> int:
    try:
        value = operator.index(ignore_index)
    except TypeError:
        raise TypeError(f"{op}: ignore_index must be a Python int (it is compiled into the "
                        f"kernel call), got {ignore_index!r}") from None
    if not _INT32.min <= value <= _INT32.max:
        raise ValueError(f"{op}: ignore_index must fit in int32 (targets are int32), got {value}")
    return value


# Stands for "no limit" in the kernels' num_classes attribute.
_ALL_CLASSES = np.iinfo(np.int64).max


def _num_classes(op, num_classes, vocab) -> int:
    """num_classes as the kernels take it; None means every column (vocab, when known)."""
    if num_classes is None:
        return _ALL_CLASSES if vocab is None else vocab
    try:
        value = operator.index(num_classes)
    except TypeError:
        raise TypeError(f"{op}: num_classes must be a Python int, got {num_classes!r}") from None
    if value < 1 or (vocab is not None and value > vocab):
        bound = f"[1, {vocab}] (the logits' class axis)" if vocab is not None else ">= 1"
        raise ValueError(f"{op}: num_classes must be in {bound}, got {value}")
    return value


def _vocab_start(op, vocab_start):
    """vocab_start as an int32 scalar array; Python ints are checked here."""
    if isinstance(vocab_start, (int, np.integer)):
        if not 0 <= vocab_start <= _INT32.max:
            raise ValueError(f"{op}: vocab_start must be in [0, 2^31), got {vocab_start}")
        return jnp.asarray(vocab_start, jnp.int32)
    if jnp.ndim(vocab_start) != 0 or not jnp.issubdtype(jnp.result_type(vocab_start), jnp.integer):
        raise TypeError(f"{op}: vocab_start must be an int or an integer scalar, got "
                        f"{getattr(vocab_start, 'dtype', type(vocab_start))}"
                        f"{list(jnp.shape(vocab_start))}")
    return jnp.asarray(vocab_start).astype(jnp.int32)


def _as_int32(targets, ignore_index):
    """int32 targets with the same outcome per row as the given ones.

    int64 ids beyond int32 are out of range (NaN rows); they become a negative id that is not
    ignore_index, rather than wrapping around onto a real class.
    """
    if targets.dtype == jnp.int32:
        return targets
    xp = np if isinstance(targets, np.ndarray) else jnp  # a loader's numpy int64 stays exact
    outside = (targets < _INT32.min) | (targets > _INT32.max)
    sentinel = -2 if ignore_index == -1 else -1
    return jnp.asarray(xp.where(outside, sentinel, targets).astype(np.int32))


def _stat_dtype(dtype):
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


# --- ffi calls ------------------------------------------------------------------------------------
# vmap_method "broadcast_all": a batch axis is more rows (vocab_start then holds one value per
# batch member, which the kernels accept).

def _fwd_call(logits, targets, ignore_index, num_classes):
    logits, targets = match_vma(logits, targets)
    row = result_type(logits, logits.shape[:-1], _stat_dtype(logits.dtype))
    return jax.ffi.ffi_call(
        "blujax_cross_entropy_fwd", (row, row), vmap_method="broadcast_all",
    )(logits, targets, ignore_index=np.int64(ignore_index), num_classes=np.int64(num_classes))


def _stats_call(logits, targets, vocab_start, num_classes):
    logits, targets, vocab_start = match_vma(logits, targets, vocab_start)
    row = result_type(logits, logits.shape[:-1], _stat_dtype(logits.dtype))
    return jax.ffi.ffi_call(
        "blujax_cross_entropy_stats", (row, row, row), vmap_method="broadcast_all",
    )(logits, targets, vocab_start, num_classes=np.int64(num_classes))


def _grad_call(logits, targets, lse, g, vocab_start, ignore_index, num_classes, alias=True):
    logits, targets, lse, g, vocab_start = match_vma(logits, targets, lse, g, vocab_start)
    # With alias, dlogits reuses the logits buffer; XLA inserts a copy first wherever the
    # logits are still live, so this is safe whoever else holds them.
    return jax.ffi.ffi_call(
        "blujax_cross_entropy_bwd", result_type(logits), vmap_method="broadcast_all",
        input_output_aliases={0: 0} if alias else None,
    )(logits, targets, lse, g, vocab_start, ignore_index=np.int64(ignore_index),
      num_classes=np.int64(num_classes))


def _loss_grad_call(logits, targets, scale, ignore_index, num_classes, alias=True):
    """(per-row loss, dlogits = (softmax - onehot) * scale) in one pass over the logits."""
    logits, targets, scale = match_vma(logits, targets, scale)
    row = result_type(logits, logits.shape[:-1], _stat_dtype(logits.dtype))
    # As in _grad_call: with alias dlogits reuses the logits buffer, XLA copying them first
    # wherever they are still live.
    return jax.ffi.ffi_call(
        "blujax_cross_entropy_loss_grad", (row, result_type(logits)),
        vmap_method="broadcast_all", input_output_aliases={0: 1} if alias else None,
    )(logits, targets, scale, ignore_index=np.int64(ignore_index),
      num_classes=np.int64(num_classes))


# --- differentiable ops ---------------------------------------------------------------------------

@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _softmax_cross_entropy(logits, targets, ignore_index, num_classes, alias):
    return _fwd_call(logits, targets, ignore_index, num_classes)[0]


def _softmax_cross_entropy_fwd(logits, targets, ignore_index, num_classes, alias):
    loss, lse = _fwd_call(logits, targets, ignore_index, num_classes)
    return loss, (logits, targets, lse)


def _softmax_cross_entropy_bwd(ignore_index, num_classes, alias, res, g):
    logits, targets, lse = res
    return _grad_call(logits, targets, lse, g, jnp.int32(0), ignore_index, num_classes,
                      alias), None


_softmax_cross_entropy.defvjp(_softmax_cross_entropy_fwd, _softmax_cross_entropy_bwd)


def _counted_rows(targets, ignore_index, dtype):
    """The mean's divisor: the rows that are not ignored, at least 1 (no rows: a mean of 0)."""
    return jnp.maximum(jnp.sum(targets != ignore_index, axis=-1), 1).astype(dtype)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _softmax_cross_entropy_mean(logits, targets, ignore_index, num_classes, alias):
    # Not differentiated: the loss-only kernel, no gradient written.
    loss = _fwd_call(logits, targets, ignore_index, num_classes)[0]
    return jnp.sum(loss, axis=-1) / _counted_rows(targets, ignore_index, loss.dtype)


def _softmax_cross_entropy_mean_fwd(logits, targets, ignore_index, num_classes, alias):
    count = _counted_rows(targets, ignore_index, _stat_dtype(logits.dtype))
    loss, dlogits = _loss_grad_call(logits, targets, 1 / count, ignore_index, num_classes, alias)
    return jnp.sum(loss, axis=-1) / count, dlogits


def _softmax_cross_entropy_mean_bwd(ignore_index, num_classes, alias, dlogits, g):
    # The forward wrote the gradient for a cotangent of 1. Under jax.grad (and value_and_grad)
    # g is that constant 1, and XLA's algebraic simplifier removes the multiply (and the
    # converts around it for bfloat16), so fwd+bwd stays one read and one write of the logits;
    # any other g costs one elementwise pass over dlogits. The product is taken in g's float32
    # (float64) and rounded once to the logits' dtype.
    return (dlogits.astype(g.dtype) * g).astype(dlogits.dtype), None


_softmax_cross_entropy_mean.defvjp(_softmax_cross_entropy_mean_fwd,
                                   _softmax_cross_entropy_mean_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _vocab_parallel(logits, targets, ignore_index, axis_name, num_classes):
    return _vocab_parallel_fwd(logits, targets, ignore_index, axis_name, num_classes)[0]


def _vocab_parallel_fwd(logits, targets, ignore_index, axis_name, num_classes):
    vocab = logits.shape[-1]
    start = jax.lax.axis_index(axis_name).astype(jnp.int32) * vocab
    row_max, sum_exp, target_logit = _stats_call(logits, targets, start, num_classes)
    m = jax.lax.pmax(row_max, axis_name)
    lse = m + jnp.log(jax.lax.psum(sum_exp * jnp.exp(row_max - m), axis_name))
    picked = jax.lax.psum(target_logit, axis_name)
    # targets are the same on every device of the axis, so these masks and the loss are too.
    ignored = targets == ignore_index
    known = (targets >= 0) & (targets < min(vocab * jax.lax.axis_size(axis_name), num_classes))
    lse = jnp.where(known | ignored, lse, jnp.nan)  # NaN loss and NaN gradient rows
    loss = jnp.where(ignored, 0, lse - picked)
    return loss, (logits, targets, lse, start)


def _vocab_parallel_bwd(ignore_index, axis_name, num_classes, res, g):
    logits, targets, lse, start = res
    return _grad_call(logits, targets, lse, g, start, ignore_index, num_classes), None


_vocab_parallel.defvjp(_vocab_parallel_fwd, _vocab_parallel_bwd)
