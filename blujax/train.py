"""Training GPT-2: the loss, the optimizer and its schedule, and one jitted train step.

    tcfg = TrainConfig(steps=1000, warmup_steps=100, dtype="bf16")
    state = init_state(config, tcfg, jax.random.key(0))
    step = make_train_step(config, tcfg, ops=blujax.kernels)
    state, metrics = step(state, inputs, targets)    # int32 [accum_steps, B, T] each

The step is one `jax.jit` program: forward and backward of every micro-batch (a `lax.scan`
summing float32 gradients), global-norm clipping (none for grad_clip 0), AdamW with a warmup +
cosine learning rate, and the parameter update, with the old state's buffers donated to the new
one. A step whose loss or gradient norm is not finite updates nothing but the step counter
(metrics["skipped"] says so); the caller decides when too many in a row end a run. With our
kernels (`ops=blujax.kernels`) the optimizer is `blujax.optim.adamw` (a fused in-place
kernel); with the plain-XLA ops it is `optax.adamw`, the ordinary JAX baseline. No randomness
enters a step, so a run is a function of its seed and its data order.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from blujax import kernels, optim
from blujax.model import gpt2

DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int
    learning_rate: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    accum_steps: int = 1
    dtype: str = "bf16"
    remat: bool = False
    scan_layers: bool | None = None  # see gpt2.forward; None: a loop on GPUs, a scan elsewhere

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"TrainConfig.dtype must be one of {', '.join(DTYPES)}, got "
                             f"{self.dtype!r}")
        # Every number checked here, once: a NaN, an inf or a sign slip otherwise trains on
        # quietly (a negative grad_clip reverses every step, lr = inf makes NaN params).
        # warmup_steps may exceed steps: the warmup then never finishes, a well-defined ramp.
        _check_int("steps", self.steps, low=1)
        _check_int("accum_steps", self.accum_steps, low=1)
        _check_int("warmup_steps", self.warmup_steps, low=0)
        _check_float("learning_rate", self.learning_rate, "> 0", lambda x: x > 0)
        _check_float("min_lr_ratio", self.min_lr_ratio, "in [0, 1]", lambda x: 0 <= x <= 1)
        _check_float("weight_decay", self.weight_decay, ">= 0", lambda x: x >= 0)
        _check_float("grad_clip", self.grad_clip, ">= 0 (0: no clipping)", lambda x: x >= 0)
        _check_float("b1", self.b1, "in [0, 1)", lambda x: 0 <= x < 1)
        _check_float("b2", self.b2, "in [0, 1)", lambda x: 0 <= x < 1)
        _check_float("eps", self.eps, "> 0", lambda x: x > 0)

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]


def _check_int(name, value, *, low):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < low:
        raise ValueError(f"TrainConfig.{name} must be an integer >= {low}, got {value!r}")


def _check_float(name, value, bounds, ok):
    """A finite real number (not a bool) for which ok(value) holds."""
    if (not isinstance(value, (int, float, np.integer, np.floating)) or isinstance(value, bool)
            or not math.isfinite(value) or not ok(value)):
        raise ValueError(f"TrainConfig.{name} must be a finite number {bounds}, got {value!r}")


class TrainState(NamedTuple):
    step: jax.Array  # int32 [], steps taken
    params: Any      # float32 master weights
    opt_state: Any


def schedule(tcfg: TrainConfig):
    """Linear warmup from lr/warmup to lr over warmup_steps, then a cosine decay to
    lr * min_lr_ratio at the last step (nanoGPT's schedule)."""
    lr, lo = tcfg.learning_rate, tcfg.learning_rate * tcfg.min_lr_ratio
    warm, decay = tcfg.warmup_steps, max(tcfg.steps - tcfg.warmup_steps, 1)

    def lr_at(step):
        step = jnp.asarray(step, jnp.float32)
        progress = jnp.clip((step - warm) / decay, 0.0, 1.0)
        cosine = lo + 0.5 * (lr - lo) * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(step < warm, lr * (step + 1) / max(warm, 1), cosine)

    return lr_at


def make_optimizer(tcfg: TrainConfig, ops=kernels) -> optax.GradientTransformation:
    """Global-norm clipping (none for grad_clip 0, as in nanoGPT), then AdamW; biases and
    LayerNorm parameters do not decay."""
    # optax.identity's state is clip_by_global_norm's (EmptyState), so a checkpoint does not
    # depend on grad_clip.
    clip = optax.clip_by_global_norm(tcfg.grad_clip) if tcfg.grad_clip else optax.identity()
    return optax.chain(clip, make_adamw(tcfg, ops))


def make_adamw(tcfg: TrainConfig, ops=kernels) -> optax.GradientTransformation:
    """make_optimizer's AdamW alone (a sharded step clips by the norm over all devices)."""
    adamw = optim.adamw if ops is kernels else optax.adamw
    return adamw(schedule(tcfg), b1=tcfg.b1, b2=tcfg.b2, eps=tcfg.eps,
                 weight_decay=tcfg.weight_decay, mask=gpt2.decay_mask)


def init_state(config: gpt2.GPT2Config, tcfg: TrainConfig, key, ops=kernels) -> TrainState:
    return state_from_params(gpt2.init(config, key), tcfg, ops)


def state_from_params(params, tcfg: TrainConfig, ops=kernels) -> TrainState:
    """Step 0 of training `params` (say, pretrained weights: blujax.interop.load_pretrained),
    as float32 master weights with a fresh optimizer state."""
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    opt_state = jax.jit(make_optimizer(tcfg, ops).init)(params)
    return TrainState(jnp.zeros([], jnp.int32), params, opt_state)


def loss_fn(params, inputs, targets, *, config, ops, dtype=jnp.float32, remat=False,
            scan_layers=None):
    """Mean next-token cross-entropy (float32) of int [B, T] inputs against [B, T] targets."""
    logits = gpt2.forward(params, inputs, config=config, ops=ops, dtype=dtype, remat=remat,
                          scan_layers=scan_layers)
    # The padded vocabulary columns are left out of the softmax (without slicing a copy). No
    # target is ignore_index, so this is the mean over all B * T tokens; on our kernels its
    # gradient comes out of the loss's own pass over the logits.
    return ops.softmax_cross_entropy_mean(logits.reshape(-1, logits.shape[-1]),
                                          targets.reshape(-1), num_classes=config.vocab_size)


def make_train_step(config: gpt2.GPT2Config, tcfg: TrainConfig, ops=kernels):
    """step(state, inputs, targets) -> (state, metrics), jitted, the state donated.

    inputs, targets: int32 [accum_steps, B, T]. metrics: float32 scalars loss (mean over the
    micro-batches), grad_norm (before clipping), lr (of this step) and skipped (1.0 where the
    loss or grad_norm was not finite: params and opt_state are then returned unchanged, bit
    for bit, and only state.step advances; else 0.0). AdamW's own count, which its learning
    rate and bias correction follow, counts the updates made: after k skipped steps it is k
    behind state.step (and the lr it applies is lr_at(state.step - k)).
    """
    optimizer = make_optimizer(tcfg, ops)
    lr_at = schedule(tcfg)
    grad_fn = jax.value_and_grad(partial(loss_fn, config=config, ops=ops,
                                         dtype=tcfg.compute_dtype, remat=tcfg.remat,
                                         scan_layers=tcfg.scan_layers))

    def update(params, opt_state, grads):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def step(state: TrainState, inputs, targets):
        check_batch(inputs, targets, tcfg)

        def micro(acc, batch):
            loss, grads = grad_fn(state.params, *batch)
            return jax.tree.map(jnp.add, acc, (loss, grads)), None

        zero = (jnp.zeros([], jnp.float32), jax.tree.map(jnp.zeros_like, state.params))
        (loss, grads), _ = jax.lax.scan(micro, zero, (inputs, targets))
        n = inputs.shape[0]
        loss, grads = loss / n, jax.tree.map(lambda g: g / n, grads)
        norm = optax.tree.norm(grads)
        finite = finite_step(loss, norm)
        params, opt_state = skip_unless(finite, update, state.params, state.opt_state, grads)
        metrics = {"loss": loss, "grad_norm": norm, "lr": lr_at(state.step).astype(jnp.float32),
                   "skipped": 1.0 - finite.astype(jnp.float32)}
        return TrainState(state.step + 1, params, opt_state), metrics

    return jax.jit(step, donate_argnums=0)


def finite_step(loss, grad_norm):
    """Whether a step may update the params: its loss and gradient norm both finite (a NaN or
    inf anywhere in the gradients makes the norm one)."""
    return jnp.isfinite(loss) & jnp.isfinite(grad_norm)


def skip_unless(finite, update, params, opt_state, *args):
    """update(params, opt_state, *args) -> (params, opt_state) where `finite`, else the two as
    they are: a step with a non-finite loss or gradient is skipped, as llm.c skips outliers.

    A lax.cond rather than a jnp.where per leaf: the where would be one more pass over the
    params and both AdamW moments every step (the fused AdamW call writes its moments in place,
    so the old values could not be selected afterwards without copies of them); the cond costs
    one scalar read of the predicate, and its skipping branch passes the donated buffers
    through.
    """
    return jax.lax.cond(finite, update, lambda p, s, *_: (p, s), params, opt_state, *args)


def make_eval_step(config: gpt2.GPT2Config, tcfg: TrainConfig, ops=kernels):
    """eval_step(params, inputs, targets) -> mean loss (float32) over int32 [B, T] batches."""
    return jax.jit(partial(loss_fn, config=config, ops=ops, dtype=tcfg.compute_dtype))


def check_batch(inputs, targets, tcfg: TrainConfig, step: str = "train step"):
    """inputs and targets must both be [accum_steps, B, T]; `step` names the caller."""
    if inputs.ndim != 3 or inputs.shape != targets.shape:
        raise ValueError(f"{step}: inputs and targets must both be [accum_steps, B, T], got "
                         f"{inputs.shape} and {targets.shape}")
    if inputs.shape[0] != tcfg.accum_steps:
        raise ValueError(f"{step}: the leading axis ({inputs.shape[0]}) must be "
                         f"accum_steps ({tcfg.accum_steps})")


# Dense bf16 / tf32 tensor-core peaks used for MFU, by device kind. H100 (and H200, the same
# chip) at 800 TFLOP/s bf16: the sustained figure our targets are stated against, below the
# 989 of the datasheet.
PEAK_FLOPS = {
    "H100": {"bf16": 800e12, "f32": 400e12},
    "H200": {"bf16": 800e12, "f32": 400e12},
    "A100": {"bf16": 312e12, "f32": 156e12},
}


def peak_flops(device, dtype: str) -> float | None:
    """The peak FLOP/s MFU is measured against for this device and "bf16"/"f32", or None when
    unknown (a CPU, say)."""
    kind = getattr(device, "device_kind", "")
    for name, peaks in PEAK_FLOPS.items():
        if name in kind:
            return peaks[dtype]
    return None
