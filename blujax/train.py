"""Training a model: the loss, the optimizer and its schedule, and the one jitted train step,
on one device or over a ("data", "fsdp", "tensor", "context") mesh.

    tcfg = TrainConfig(steps=1000, warmup_steps=100, dtype="bf16")
    state = init_state(config, tcfg, jax.random.key(0))          # config: any model family's
    step = make_train_step(config, tcfg, ops=blujax.kernels)
    state, metrics = step(state, inputs, targets)    # int32 [accum_steps, B, T] each

    mesh = sharding.make_mesh(data=2, tensor=2, context=2)       # the same, over 8 devices
    state = init_state(config, tcfg, key, mesh=mesh, shard_optimizer=True)
    step = make_train_step(config, tcfg, mesh=mesh, shard_optimizer=True)
    mesh = sharding.make_mesh(tensor=2, fsdp=4)                  # parameters split over 4

The step is one `jax.jit` program: forward and backward of every micro-batch (a `lax.scan`
summing float32 gradients), global-norm clipping (none for grad_clip 0), AdamW with a warmup +
cosine learning rate, and the parameter update, with the old state's buffers donated to the new
one. A step whose loss or gradient norm is not finite updates nothing but the step counter
(metrics["skipped"] says so); the caller decides when too many in a row end a run. With our
kernels (`ops=blujax.kernels`) the optimizer is `blujax.optim.adamw` (a fused in-place
kernel); with the plain-XLA ops it is `optax.adamw`, the ordinary JAX baseline. No randomness
enters a step, so a run is a function of its seed and its data order.

Checkpoints keep the state as it is on one device (`gather`); `place_state` puts one on a mesh
of any shape.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from blujax import fp8 as fp8_lib, kernels, optim
from blujax.model import family_of
from blujax.model.family import ONE_DEVICE
from blujax.model.stack import remat_mode
from blujax.sharding.layout import Layout, fsdp_axes_of, state_shardings
from blujax.sharding.mesh import (AXES, BATCH_AXES, CONTEXT, FSDP, TENSOR, check_batch,
                                  mesh_sizes)
from blujax.sharding.parallel import Parallel, fsdp_dims, vary
from blujax.sharding.ring import zigzag

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
    # What the backward recomputes: "none", "selective" (the norms and activations, keeping
    # the matrix products' and attention's outputs) or "full" (each block); True is "full".
    remat: str = "none"
    scan_layers: bool | None = None  # see gpt2.forward; None: a loop on GPUs, a scan elsewhere
    # FP8 block products (blujax.fp8): "off", "on" (where they pay: fp8.pays) or "all"; their
    # scaling ("delayed" or "dynamic") and the gradients' format ("e5m2" or "e4m3");
    # fp8_fuse: the gated MLP as one FP8 piece where it can be (blujax.fp8.Recipe.fuse).
    fp8: str = "off"
    fp8_scaling: str = fp8_lib.DEFAULT_SCALING
    fp8_grad: str = "e5m2"
    fp8_fuse: bool = True

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"TrainConfig.dtype must be one of {', '.join(DTYPES)}, got "
                             f"{self.dtype!r}")
        try:
            object.__setattr__(self, "remat", remat_mode(self.remat))
        except ValueError as e:
            raise ValueError(f"TrainConfig.{e}") from None
        if self.fp8 not in fp8_lib.MODES:
            raise ValueError(f"TrainConfig.fp8 must be one of {', '.join(fp8_lib.MODES)}, got "
                             f"{self.fp8!r}")
        try:
            fp8_lib.Recipe(self.fp8_scaling, self.fp8_grad)
        except ValueError as e:
            raise ValueError(f"TrainConfig: {e}") from None
        if not isinstance(self.fp8_fuse, bool):
            raise ValueError(f"TrainConfig.fp8_fuse must be True or False, got "
                             f"{self.fp8_fuse!r}")
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

    @property
    def fp8_recipe(self) -> fp8_lib.Recipe | None:
        """The FP8 products' recipe, or None when fp8 is "off"."""
        if self.fp8 == "off":
            return None
        return fp8_lib.Recipe(self.fp8_scaling, self.fp8_grad, every=self.fp8 == "all",
                              fuse=self.fp8_fuse)


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
    fp8: Any = None  # delayed FP8 scaling's amax histories (blujax.fp8.History), else None


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


class Optimizer(NamedTuple):
    """The train step's optimizer: global-norm clipping, AdamW and the update applied.

    init(params) -> opt_state: (the clipping's state, AdamW's), the tree checkpoints keep.
    apply(grads, opt_state, params, grad_norm) -> (params, opt_state): the gradients clipped
    to grad_clip by their global norm grad_norm (the step's, over all devices; grad_clip 0:
    not clipped, as in nanoGPT), AdamW's update applied. On our kernels that is one fused
    pass (blujax.optim.adamw_apply, the clipping factor and the addition inside it); on XLA's,
    optax's clip, adamw and apply_updates as a JAX user writes them."""

    init: Callable
    apply: Callable


def make_adamw(tcfg: TrainConfig, ops=kernels, decay_mask=None) -> optax.GradientTransformation:
    """The optimizer's AdamW as an optax transformation (its state is the optimizer state's
    second part): blujax.optim's fused kernel on our ops, optax's on XLA's; decay_mask(params)
    says which leaves decay (the family's: not biases or norms)."""
    adamw = optim.adamw if ops is kernels else optax.adamw
    return adamw(schedule(tcfg), **_adamw_args(tcfg, decay_mask))


def make_optimizer(tcfg: TrainConfig, ops=kernels, decay_mask=None) -> Optimizer:
    """The Optimizer of a TrainConfig: make_adamw's AdamW, with clipping and the update."""
    adamw, clip = make_adamw(tcfg, ops, decay_mask), tcfg.grad_clip

    def init(params):
        # optax.chain(clip_by_global_norm or identity, adamw)'s state: clipping keeps none
        # (EmptyState), so the tree is the same whatever grad_clip and mesh, as checkpoints
        # have it.
        return optax.EmptyState(), adamw.init(params)

    if ops is kernels:
        fused = optim.adamw_apply(schedule(tcfg), **_adamw_args(tcfg, decay_mask))

        def apply(grads, opt_state, params, norm):
            scale = jnp.where(norm < clip, 1.0, clip / norm).astype(jnp.float32) if clip else None
            params, adam_state = fused(grads, opt_state[1], params, scale)
            return params, (opt_state[0], adam_state)

        return Optimizer(init, apply)

    def apply(grads, opt_state, params, norm):
        if clip:  # optax.clip_by_global_norm, with the global norm
            trigger = norm < clip
            grads = jax.tree.map(lambda g: jax.lax.select(
                trigger, g, (g / norm.astype(g.dtype)) * clip), grads)
        updates, adam_state = adamw.update(grads, opt_state[1], params)
        return optax.apply_updates(params, updates), (opt_state[0], adam_state)

    return Optimizer(init, apply)


def _adamw_args(tcfg: TrainConfig, decay_mask) -> dict:
    return dict(b1=tcfg.b1, b2=tcfg.b2, eps=tcfg.eps, weight_decay=tcfg.weight_decay,
                mask=decay_mask)


def init_state(config, tcfg: TrainConfig, key, ops=kernels, mesh=None, *,
               shard_optimizer: bool = False) -> TrainState:
    """Step 0 of training a fresh model of `config` (its family's init). On a mesh, the same
    values, made directly in their shards."""
    family = family_of(config)
    if mesh is None:
        return state_from_params(config, family.init(config, key), tcfg, ops)

    def init(key):
        return state_from_params(config, family.init(config, key), tcfg, ops)

    shardings = state_shardings(jax.eval_shape(init, key), family.logical_axes(config), mesh,
                                shard_optimizer, whole_axes(config, mesh_sizes(mesh)))
    return jax.jit(init, out_shardings=shardings)(key)


def state_from_params(config, params, tcfg: TrainConfig, ops=kernels) -> TrainState:
    """Step 0 of training `params` of a model of `config` (say, pretrained weights:
    blujax.interop.load_pretrained), as float32 master weights with a fresh optimizer state,
    on one device (place_state puts it on a mesh)."""
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    init = make_optimizer(tcfg, ops, family_of(config).decay_mask).init
    return TrainState(jnp.zeros([], jnp.int32), params, jax.jit(init)(params),
                      fp8_lib.init_history(tcfg.fp8_recipe, config.n_layer))


def place_state(state: TrainState, config, mesh, *, shard_optimizer: bool = False):
    """A single-device TrainState (say, a restored checkpoint) placed on `mesh`. With several
    processes, every process passes the same whole state (each its own copy)."""
    if jax.process_count() > 1:
        # device_put takes host arrays, not another device's, for a mesh that spans processes
        # (each process then puts in the pieces its devices hold).
        state = jax.device_get(state)
    shardings = state_shardings(state, family_of(config).logical_axes(config), mesh,
                                shard_optimizer, whole_axes(config, mesh_sizes(mesh)))
    return jax.device_put(state, shardings)


def gather(tree):
    """Every array of a sharded tree (params, a TrainState) whole: on several processes,
    replicated over the mesh so that each process holds all of it (every process calls this;
    one of them can then save it); on one, as XLA lays it out (the process reaches every
    shard anyway). What a checkpoint keeps: place_state puts it back on a mesh of any shape,
    or a single-device run takes it as it is."""
    if jax.process_count() == 1:
        return tree
    replicated = NamedSharding(jax.tree.leaves(tree)[0].sharding.mesh, P())
    return jax.jit(lambda x: x, out_shardings=replicated)(tree)


def local_copy(tree, mesh):
    """A tree of arrays on `mesh` (None: on one device already, returned as it is) whole on
    this process's first device: what single-device code (sampling, HellaSwag) takes. Every
    process calls it (a collective with several)."""
    if mesh is None:
        return tree
    tree = gather(tree)
    if jax.process_count() > 1:  # replicated: each process's first piece is all of it
        return jax.tree.map(lambda x: x.addressable_data(0), tree)
    return jax.device_put(tree, jax.local_devices()[0])


def batch_sharding(mesh) -> NamedSharding | None:
    """How a global batch [accum_steps, B, T] is best placed: B over "data" x "fsdp" (None: one
    device). (On several hosts, where each process holds the whole batch, build it with
    jax.make_array_from_callback(shape, batch_sharding(mesh), lambda index: batch[index]).)"""
    return None if mesh is None else NamedSharding(mesh, P(None, BATCH_AXES))


# --------------------------------------------------------------------------------------------
# The step: one implementation, on one device or per device inside a shard_map over a
# ("data", "fsdp", "tensor", "context") mesh. Per device, the model runs with the device's
# hooks (family.ONE_DEVICE, or sharding.Parallel: weights gathered over "fsdp",
# sequence-parallel Megatron layers over "tensor", ring attention over "context"), the loss is
# this device's share of the mean, and every collective is explicit and comes from the
# parameters' Layout (none on one device).


class _Device(NamedTuple):
    """What the per-device code needs to know about where it runs."""
    par: Any                 # the model's hooks
    sizes: dict              # mesh axis sizes ({} on one device)
    reduce_in_backward: bool

    def psum(self, x, axes=(*BATCH_AXES, CONTEXT)):
        return jax.lax.psum(x, axes) if self.sizes else x

    @property
    def token_shards(self) -> int:
        """Devices over which one step's tokens split (the batch and the sequence)."""
        return math.prod(self.sizes.get(a, 1) for a in (*BATCH_AXES, CONTEXT))


def _device(config, mesh, collective_matmul=False, reduce_in_backward=False,
            keep_gathered=False) -> _Device:
    if mesh is None:
        return _Device(ONE_DEVICE, {}, False)
    sizes = mesh_sizes(mesh)
    family = family_of(config)
    family.check_mesh(config, sizes)
    axes = family.logical_axes(config)
    params = jax.eval_shape(lambda k: family.init(config, k), jax.random.key(0))
    dims = fsdp_dims(params, fsdp_axes_of(axes, jax.tree.structure(params), sizes[FSDP]))
    return _Device(Parallel(sizes[TENSOR], sizes[CONTEXT], collective_matmul,
                            reduce_in_backward, whole_axes(config, sizes), dims, keep_gathered),
                   sizes, reduce_in_backward)


def _local_loss(params, inputs, targets, *, config, ops, dtype, remat, dev, n_tokens,
                scan_layers=None, fp8=None, amaxes=None):
    """This device's share of the mean loss: the sum of its tokens' losses / n_tokens (all
    tokens of the micro-batch), so the shares add up to the mean over "data" and "context";
    the same on every device of "tensor". fp8: the FP8 recipe or None; amaxes: delayed
    scaling's histories (History.amaxes)."""
    layers = None if fp8 is None else fp8_lib.Layer(fp8, amaxes)
    logits = family_of(config).forward(params, inputs, config=config, ops=ops, dtype=dtype,
                                       remat=remat, parallel=None if not dev.sizes else dev.par,
                                       scan_layers=scan_layers, fp8=layers)
    vocab = logits.shape[-1]  # this device's slice of the padded vocabulary
    return dev.par.loss(ops, logits.reshape(-1, vocab), targets.reshape(-1),
                        num_classes=config.vocab_size, n_tokens=n_tokens)


def _accumulate(loss, params, inputs, targets, dev: _Device, amaxes=None):
    """(loss share, grads) summed over the micro-batches [accum, B, T], then averaged; with
    delayed FP8 scaling's `amaxes` (loss(params, inputs, targets, amaxes=)), (loss share,
    grads, the new amaxes: their max over the micro-batches and, on a mesh, the devices).

    On a mesh the params are cast to varying over every axis first: each device's gradient is
    then its own contribution, and the reduction over devices happens once, after the last
    micro-batch (Layout.reduce), instead of inside every backward. With reduce_in_backward
    the loss casts them itself, layer by layer (Parallel.share), and the gradients come out of
    each backward reduced.
    """
    if dev.sizes and not dev.reduce_in_backward:
        params = vary(params)
    if amaxes is None:
        grad = jax.value_and_grad(loss)
    else:
        if dev.sizes:
            amaxes = vary(amaxes)

        def both(params, amaxes, inputs, targets):
            return loss(params, inputs, targets, amaxes=amaxes)

        grad = jax.value_and_grad(both, argnums=(0, 1))

    def micro(acc, batch):
        if amaxes is None:
            return jax.tree.map(jnp.add, acc, grad(params, *batch)), None
        value, (g, new) = grad(params, amaxes, *batch)
        return (acc[0] + value, jax.tree.map(jnp.add, acc[1], g),
                fp8_lib.merge(acc[2], new)), None

    zero = jnp.zeros([], jnp.float32)
    if dev.sizes:
        zero = vary(zero, (*BATCH_AXES, CONTEXT))
    init = (zero, jax.tree.map(jnp.zeros_like, params))
    if amaxes is not None:
        init += (jax.tree.map(jnp.zeros_like, amaxes),)
    out, _ = jax.lax.scan(micro, init, (inputs, targets))
    n = inputs.shape[0]
    value, grads = out[0] / n, jax.tree.map(lambda g: g / n, out[1])
    if amaxes is None:
        return value, grads
    new = out[2]
    if dev.sizes:
        new = jax.tree.map(lambda a: jax.lax.pmax(a, AXES), new)
    return value, grads, new


def _sharded(f, mesh, dev, in_specs, out_specs):
    """f over the mesh (its batch arguments zig-zag ordered for ring attention), or f itself
    on one device."""
    if mesh is None:
        return f
    run = jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    cp = dev.sizes[CONTEXT]

    def g(x, inputs, targets):
        return run(x, zigzag(inputs, cp), zigzag(targets, cp))

    return g


def make_train_step(config, tcfg: TrainConfig, ops=kernels, mesh=None, *,
                    shard_optimizer: bool = False, collective_matmul: bool = False,
                    reduce_in_backward: bool = False, keep_gathered: bool = False):
    """step(state, inputs, targets) -> (state, metrics), jitted, the state donated.

    config: any registered model family's config. inputs, targets: int32 [accum_steps, B, T]
    (global arrays on a mesh; B divisible by "data" x "fsdp", T by 2 x "context" when
    "context" > 1 and T / "context" by "tensor"). mesh: None for one device, else a
    sharding.make_mesh mesh, the state from init_state / place_state on it with the same
    shard_optimizer (ZeRO-1: AdamW's moments and update split over "data": the gradients
    reduce-scattered there and the new params all-gathered). Over "fsdp" the params, their
    gradients and AdamW's moments are split whatever shard_optimizer says (ZeRO-3); each layer
    gathers its weights where it runs. With tcfg.remat "selective" or "full" the backward
    gathers them again, unless keep_gathered (which keeps every layer's gathered weights, in
    the compute dtype, for one gather a layer less); with "none" it keeps them.

    metrics: float32 scalars loss (mean over the micro-batches), grad_norm (before clipping,
    over the whole gradient), lr (of this step) and skipped (1.0 where the loss or grad_norm
    was not finite: params and opt_state are then returned unchanged, bit for bit, and only
    state.step advances; else 0.0). AdamW's own count, which its learning rate and bias
    correction follow, counts the updates made: after k skipped steps it is k behind
    state.step (and the lr it applies is lr_at(state.step - k)).

    Two ways to hide communication on a mesh (same values; sharding/parallel.py says how):
    collective_matmul: the tensor-parallel all-gathers and reduce-scatters as ppermute steps
    overlapping slices of their matrix products. reduce_in_backward: each layer's gradient
    reduced during the backward, as soon as it is computed, rather than all of them after it;
    with accum_steps > 1 that is one reduction per micro-batch instead of one per step.
    """
    family = family_of(config)
    dev = _device(config, mesh, collective_matmul, reduce_in_backward, keep_gathered)
    optimizer = make_optimizer(tcfg, ops, family.decay_mask)
    lr_at = schedule(tcfg)
    recipe = tcfg.fp8_recipe

    def body(layout, state, inputs, targets):
        n_tokens = inputs.shape[1] * inputs.shape[2] * dev.token_shards
        history = state.fp8
        if (history is None) != (recipe is None or not recipe.delayed):
            raise ValueError("train step: the state's FP8 amax history does not match "
                             "TrainConfig's fp8 settings (make the state with init_state or "
                             "state_from_params of the same TrainConfig)")
        step_recipe = recipe
        if history is not None and not history.calibrated:  # a fresh history: scale now
            step_recipe = dataclasses.replace(recipe, calibrating=True)
        loss = partial(_local_loss, config=config, ops=ops, dtype=tcfg.compute_dtype,
                       remat=tcfg.remat, scan_layers=tcfg.scan_layers, dev=dev,
                       n_tokens=n_tokens, fp8=step_recipe)
        if history is None:
            value, grads = _accumulate(loss, state.params, inputs, targets, dev)
        else:
            value, grads, amaxes = _accumulate(loss, state.params, inputs, targets, dev,
                                               history.amaxes)
        grads = layout.reduce(grads, reduced=dev.reduce_in_backward)
        norm = layout.global_norm(grads)
        value = dev.psum(value)

        def update(params, opt_state, grads):
            return optimizer.apply(grads, opt_state, params, norm)

        # The loss and norm are the same on every device, so every device takes the same branch
        # (skip_unless); the all-gather stays outside the cond, and a skipped step gathers back
        # the very pieces it cut.
        finite = finite_step(value, norm)
        params, opt_state = skip_unless(finite, update, layout.zero_pieces(state.params),
                                        state.opt_state, grads)
        params = layout.zero_gather(params)
        metrics = {"loss": value, "grad_norm": norm, "lr": lr_at(state.step).astype(jnp.float32),
                   "skipped": 1.0 - finite.astype(jnp.float32)}
        if history is not None:
            history = fp8_lib.stepped(history, amaxes, finite)
        return TrainState(state.step + 1, params, opt_state, history), metrics

    def step(state, inputs, targets):
        check_micro_batches(inputs, targets, tcfg)
        layout = _layout(state.params, config, dev, shard_optimizer)
        if mesh is None:
            return body(layout, state, inputs, targets)
        check_batch(inputs.shape, dev.sizes, config)
        specs = layout.state_specs(state)
        out = specs if state.fp8 is None else specs._replace(
            fp8=fp8_lib.History(specs.fp8.amaxes, True))
        run = _sharded(partial(body, layout), mesh, dev,
                       (specs, _MICRO_BATCHES, _MICRO_BATCHES), (out, P()))
        return run(state, inputs, targets)

    return jax.jit(step, donate_argnums=0)


def make_value_and_grad(config, ops=kernels, mesh=None, *, dtype=jnp.float32,
                        remat=False, collective_matmul: bool = False,
                        reduce_in_backward: bool = False, keep_gathered: bool = False):
    """f(params, inputs, targets) -> (mean loss, grads), jitted, for int32 [B, T] batches:
    the train step's loss and gradient (on a mesh, the params placed by place_state's layout
    and the grads in it). The options as make_train_step's."""
    dev = _device(config, mesh, collective_matmul, reduce_in_backward, keep_gathered)
    loss = partial(_local_loss, config=config, ops=ops, dtype=dtype, remat=remat, dev=dev)

    def body(layout, params, inputs, targets):
        n_tokens = inputs.size * dev.token_shards
        value, grads = _accumulate(partial(loss, n_tokens=n_tokens), params, inputs[None],
                                   targets[None], dev)
        grads = layout.reduce(grads, reduced=dev.reduce_in_backward)
        return dev.psum(value), grads

    def f(params, inputs, targets):
        layout = _layout(params, config, dev)
        if mesh is None:
            return body(layout, params, inputs, targets)
        check_batch(inputs.shape, dev.sizes, config)
        specs = layout.param_specs()
        run = _sharded(partial(body, layout), mesh, dev, (specs, _BATCH, _BATCH),
                       (P(), specs))
        return run(params, inputs, targets)

    return jax.jit(f)


def make_eval_step(config, tcfg: TrainConfig, ops=kernels, mesh=None, *,
                   collective_matmul: bool = False):
    """eval_step(params, inputs, targets) -> mean loss (float32) over int32 [B, T] batches
    (global arrays on a mesh, the params placed as the train state's)."""
    dev = _device(config, mesh, collective_matmul)
    loss = partial(_local_loss, config=config, ops=ops, dtype=tcfg.compute_dtype, remat=False,
                   dev=dev)

    def body(params, inputs, targets):
        n_tokens = inputs.size * dev.token_shards
        return dev.psum(loss(params, inputs, targets, n_tokens=n_tokens))

    def f(params, inputs, targets):
        if mesh is None:
            return body(params, inputs, targets)
        check_batch(inputs.shape, dev.sizes, config)
        specs = _layout(params, config, dev).param_specs()
        return _sharded(body, mesh, dev, (specs, _BATCH, _BATCH), P())(params, inputs, targets)

    return jax.jit(f)


def loss_fn(params, inputs, targets, *, config, ops, dtype=jnp.float32, remat=False,
            scan_layers=None):
    """Mean next-token cross-entropy (float32) of int [B, T] inputs against [B, T] targets,
    on one device (the step's loss)."""
    return _local_loss(params, inputs, targets, config=config, ops=ops, dtype=dtype,
                       remat=remat, scan_layers=scan_layers, dev=_device(config, None),
                       n_tokens=inputs.size)


def _layout(params, config, dev, shard_optimizer=False) -> Layout:
    if not dev.sizes:
        return Layout.of(params, None, None)
    return Layout.of(params, family_of(config).logical_axes(config), dev.sizes, shard_optimizer,
                     dev.par.whole)


def whole_axes(config, sizes: dict[str, int]) -> tuple[str, ...]:
    """The logical axes config's family keeps whole (replicated over "tensor") on a mesh of
    these sizes though sharding.layout.RULES splits them: its optional whole_axes(config,
    sizes), none without one."""
    whole = getattr(family_of(config), "whole_axes", None)
    return tuple(whole(config, sizes)) if whole is not None else ()


# A batch [B, T]: sequences over "data", each sequence (zig-zag ordered) over "context"; the
# train step's [accum_steps, B, T].
_BATCH = P(BATCH_AXES, CONTEXT)
_MICRO_BATCHES = P(None, BATCH_AXES, CONTEXT)


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


def check_micro_batches(inputs, targets, tcfg: TrainConfig, step: str = "train step"):
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
