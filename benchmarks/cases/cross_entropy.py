"""Softmax cross-entropy over a GPT-2 vocabulary: ours vs the jnp spec compiled by XLA.

"fwd+bwd" is what a training step runs: the per-row loss, then dlogits through the VJP with
the cotangent of a mean over rows (ones / N). Its bytes count one read of the logits and one
write of dlogits, so 100% of copy bandwidth would need a single pass over the logits; our
forward reads them once and the backward reads them again and writes dlogits, three passes
in all. The logits are inputs of the timed program, which XLA may not overwrite, so "ours"
times the kernels with dlogits in a buffer of its own; "ours_alias" is the public op, which
writes dlogits into the logits' buffer and so here pays a copy of the logits first (inside a
training step, where the logits are an intermediate, that copy does not happen).

softmax_cross_entropy_mean "fwd+bwd" is the training loss as train.loss_fn takes it:
jax.value_and_grad of the mean with respect to the logits. Ours computes dlogits in the
forward (one read of the logits, one write of dlogits: the bytes counted, so 100% is a copy);
"ours" is again the unaliased variant, XLA's is the spec under value_and_grad.
"""

import jax
import jax.numpy as jnp

from benchmarks.harness import Case, itemsize, normal
from blujax import kernels
from blujax.kernels import xla
from blujax.kernels.cross_entropy import (
    _softmax_cross_entropy_mean_unaliased,
    _softmax_cross_entropy_unaliased,
)

GPT2_VOCAB = 50257
SHAPES = [(16384, 50304), (32768, 50304), (16384, 50257)]
QUICK_SHAPES = [(32, 50304)]  # a smoke test that also runs on the CPU
IMPLS = {
    "ours": _softmax_cross_entropy_unaliased,
    "xla": xla.softmax_cross_entropy,
    "ours_alias": kernels.softmax_cross_entropy,
}
MEAN_IMPLS = {
    "ours": _softmax_cross_entropy_mean_unaliased,
    "xla": xla.softmax_cross_entropy_mean,
}


def _inputs(key, rows, vocab, dtype):
    kx, kt = jax.random.split(key)
    logits = normal(kx, (rows, vocab), dtype, 3.0)
    return logits, jax.random.randint(kt, (rows,), 0, min(vocab, GPT2_VOCAB), jnp.int32)


def _fwd_bwd(op):
    def run(logits, targets):
        loss, vjp = jax.vjp(lambda x: op(x, targets), logits)
        (dlogits,) = vjp(jnp.full(loss.shape, 1.0 / loss.shape[0], loss.dtype))
        return loss, dlogits
    return run


def _mean_value_and_grad(op):
    def run(logits, targets):
        return jax.value_and_grad(lambda x: op(x, targets))(logits)
    return run


def cases(quick: bool = False):
    out = []
    for dtype in (jnp.bfloat16, jnp.float32):
        for rows, vocab in QUICK_SHAPES if quick else SHAPES:
            s = itemsize(dtype)

            def make_fwd(impl, key, rows=rows, vocab=vocab, dtype=dtype):
                return IMPLS[impl], _inputs(key, rows, vocab, dtype)

            def make_fwd_bwd(impl, key, rows=rows, vocab=vocab, dtype=dtype):
                return _fwd_bwd(IMPLS[impl]), _inputs(key, rows, vocab, dtype)

            def make_mean(impl, key, rows=rows, vocab=vocab, dtype=dtype):
                return _mean_value_and_grad(MEAN_IMPLS[impl]), _inputs(key, rows, vocab, dtype)

            name, dt = f"{rows}x{vocab}", jnp.dtype(dtype).name
            # forward: read the logits and targets, write loss (lse stays with our residuals)
            fwd_bytes = rows * vocab * s + 2 * rows * 4
            # fwd+bwd: one read of the logits, one write of dlogits (and the per-row vectors)
            fwd_bwd_bytes = 2 * rows * vocab * s + 2 * rows * 4
            out.append(Case("softmax_cross_entropy", "fwd", name, dt, fwd_bytes, make_fwd))
            out.append(Case("softmax_cross_entropy", "fwd+bwd", name, dt, fwd_bwd_bytes,
                            make_fwd_bwd, impls=("ours", "xla", "ours_alias")))
            # the mean: read the logits and targets, write dlogits (and a scalar)
            mean_bytes = 2 * rows * vocab * s + rows * 4
            out.append(Case("softmax_cross_entropy_mean", "fwd+bwd", name, dt, mean_bytes,
                            make_mean))
    return out
