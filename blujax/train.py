"""Training GPT-2: the loss, the optimizer and its schedule, and one jitted train step.

    tcfg = TrainConfig(steps=1000, warmup_steps=100, dtype="bf16")
    state = init_state(config, tcfg, jax.random.key(0))
    step = make_train_step(config, tcfg, ops=blujax.kernels)
    state, metrics = step(state, inputs, targets)    # int32 [accum_steps, B, T] each

The step is one `jax.jit` program: forward and backward of every micro-batch (a `lax.scan`
summing float32 gradients), global-norm clipping, AdamW with a warmup + cosine learning rate,
and the parameter update, with the old state's buffers donated to the new one. With our
kernels (`ops=blujax.kernels`) the optimizer is `blujax.optim.adamw` (a fused in-place
kernel); with the plain-XLA ops it is `optax.adamw`, the ordinary JAX baseline. No randomness
enters a step, so a run is a function of its seed and its data order.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
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
        if self.steps < 1 or self.accum_steps < 1 or self.warmup_steps < 0:
            raise ValueError("TrainConfig: steps and accum_steps must be >= 1 and warmup_steps "
                             f">= 0, got {self.steps}, {self.accum_steps}, {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"TrainConfig.min_lr_ratio must be in [0, 1], got "
                             f"{self.min_lr_ratio}")

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]


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
    """Global-norm clipping, then AdamW; biases and LayerNorm parameters do not decay."""
    return optax.chain(optax.clip_by_global_norm(tcfg.grad_clip), make_adamw(tcfg, ops))


def make_adamw(tcfg: TrainConfig, ops=kernels) -> optax.GradientTransformation:
    """make_optimizer's AdamW alone (a sharded step clips by the norm over all devices)."""
    adamw = optim.adamw if ops is kernels else optax.adamw
    return adamw(schedule(tcfg), b1=tcfg.b1, b2=tcfg.b2, eps=tcfg.eps,
                 weight_decay=tcfg.weight_decay, mask=gpt2.decay_mask)


def init_state(config: gpt2.GPT2Config, tcfg: TrainConfig, key, ops=kernels) -> TrainState:
    params = gpt2.init(config, key)
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
    micro-batches), grad_norm (before clipping) and lr (of this step).
    """
    optimizer = make_optimizer(tcfg, ops)
    lr_at = schedule(tcfg)
    grad_fn = jax.value_and_grad(partial(loss_fn, config=config, ops=ops,
                                         dtype=tcfg.compute_dtype, remat=tcfg.remat,
                                         scan_layers=tcfg.scan_layers))

    def step(state: TrainState, inputs, targets):
        check_batch(inputs, targets, tcfg)

        def micro(acc, batch):
            loss, grads = grad_fn(state.params, *batch)
            return jax.tree.map(jnp.add, acc, (loss, grads)), None

        zero = (jnp.zeros([], jnp.float32), jax.tree.map(jnp.zeros_like, state.params))
        (loss, grads), _ = jax.lax.scan(micro, zero, (inputs, targets))
        n = inputs.shape[0]
        loss, grads = loss / n, jax.tree.map(lambda g: g / n, grads)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads),
                   "lr": lr_at(state.step).astype(jnp.float32)}
        return TrainState(state.step + 1, params, opt_state), metrics

    return jax.jit(step, donate_argnums=0)


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
