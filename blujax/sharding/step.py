"""The GPT-2 train step as one shard_map over a ("data", "tensor", "context") mesh.

    mesh = make_mesh(data=2, tensor=2, context=2)
    state = init_sharded_state(config, tcfg, jax.random.key(0), mesh)
    step = make_sharded_train_step(config, tcfg, mesh)
    state, metrics = step(state, inputs, targets)      # global int32 [accum_steps, B, T]

The same arithmetic as `blujax.train.make_train_step`, per device: the model is
`gpt2.forward` with the `Parallel` hooks (sequence-parallel Megatron layers over "tensor",
ring attention over "context"), the loss the vocabulary-parallel cross-entropy, and every
collective is explicit. Each device keeps its own copy of the parameters' gradients through
the micro-batches; then one all-reduce per leaf over the axes it is replicated on (or, with
shard_optimizer, a reduce-scatter over "data" and the AdamW step on this device's piece,
followed by an all-gather of the new parameters: ZeRO-1). Gradient clipping uses the norm over
all devices; a non-finite loss or norm skips the update, as train.make_train_step does.

The state keeps the params in the parallel layout (specs.py); `unshard_params` gives the
model's layout back (for sampling, comparisons), `unshard_state` the whole TrainState's (for
checkpoints: `shard_state` restores one on any mesh).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from blujax import kernels, train
from blujax.model import gpt2
from blujax.sharding.mesh import (AXES, CONTEXT, DATA, TENSOR, check_batch, check_model,
                                  mesh_sizes)
from blujax.sharding.parallel import Parallel, vary
from blujax.sharding.ring import zigzag
from blujax.sharding.specs import (Layout, from_parallel_layout, from_parallel_state,
                                   state_shardings, to_parallel_state)

# A batch [B, T]: sequences over "data", each sequence (zig-zag ordered) over "context"; the
# train step's [accum_steps, B, T].
_BATCH = P(DATA, CONTEXT)
_MICRO_BATCHES = P(None, DATA, CONTEXT)


def init_sharded_state(config: gpt2.GPT2Config, tcfg: train.TrainConfig, key, mesh,
                       ops=kernels, *, shard_optimizer: bool = False) -> train.TrainState:
    """train.init_state's state (the same values for the same key), built directly in its
    shards on `mesh`, in the parallel layout."""
    def init(key):
        return to_parallel_state(train.init_state(config, tcfg, key, ops))

    shardings = state_shardings(jax.eval_shape(init, key), mesh, shard_optimizer)
    return jax.jit(init, out_shardings=shardings)(key)


def shard_state(state: train.TrainState, mesh, *, shard_optimizer: bool = False):
    """A single-device TrainState (say, a restored checkpoint) placed on `mesh`. With several
    processes, every process passes the same whole state (each its own copy)."""
    if jax.process_count() > 1:
        # device_put takes host arrays, not another device's, for a mesh that spans processes
        # (each process then puts in the pieces its devices hold).
        state = jax.device_get(state)
    state = to_parallel_state(state)
    return jax.device_put(state, state_shardings(state, mesh, shard_optimizer))


def unshard_params(params):
    """The model's params (global arrays) from the sharded state's. With several processes,
    every process calls it, and each gets every array whole (replicated over the mesh)."""
    return _whole_on_every_process(from_parallel_layout, params)


def unshard_state(state: train.TrainState) -> train.TrainState:
    """The whole sharded state (params and AdamW's moments) in train.init_state's layout, as
    global arrays: what a checkpoint keeps, so that shard_state can put it back on a mesh of
    any shape, or a single-device run can take it as it is. With several processes, every
    process calls it, and each gets every array whole (replicated over the mesh), so that one
    of them can save it."""
    return _whole_on_every_process(from_parallel_state, state)


def _whole_on_every_process(f, tree):
    """jit(f)(tree), its outputs whole on every process: replicated over the mesh with several
    processes; with one, laid out as XLA likes (no copies it does not need: the process
    reaches every shard anyway)."""
    if jax.process_count() == 1:
        return jax.jit(f)(tree)
    replicated = NamedSharding(jax.tree.leaves(tree)[0].sharding.mesh, P())
    return jax.jit(f, out_shardings=replicated)(tree)


def batch_sharding(mesh) -> NamedSharding:
    """How a global batch [accum_steps, B, T] is best placed: B over "data". (On several
    hosts, where each process holds the whole batch, build it with
    jax.make_array_from_callback(shape, batch_sharding(mesh), lambda index: batch[index]).)"""
    return NamedSharding(mesh, P(None, DATA))


def make_sharded_train_step(config: gpt2.GPT2Config, tcfg: train.TrainConfig, mesh, ops=kernels,
                            *, shard_optimizer: bool = False, collective_matmul: bool = False,
                            reduce_in_backward: bool = False):
    """step(state, inputs, targets) -> (state, metrics), jitted, the state donated.

    state: from init_sharded_state / shard_state with the same shard_optimizer. inputs,
    targets: int32 [accum_steps, B, T], global; B divisible by "data", T by 2 x "context"
    (when "context" > 1) and T / "context" by "tensor". metrics as train.make_train_step's,
    a step with a non-finite loss or gradient norm skipped as there.

    Two ways to hide communication (same values; parallel.py says how):
    collective_matmul: the tensor-parallel all-gathers and reduce-scatters as ppermute steps
    overlapping slices of their matrix products. reduce_in_backward: each layer's gradient
    reduced during the backward, as soon as it is computed, rather than all of them after it;
    with accum_steps > 1 that is one reduction per micro-batch instead of one per step.
    """
    sizes = mesh_sizes(mesh)
    check_model(config, sizes)
    adamw = train.make_adamw(tcfg, ops)
    lr_at = train.schedule(tcfg)
    loss = partial(_local_loss, config=config, ops=ops, dtype=tcfg.compute_dtype,
                   remat=tcfg.remat, scan_layers=tcfg.scan_layers,
                   par=Parallel(sizes[TENSOR], sizes[CONTEXT], collective_matmul,
                                reduce_in_backward))

    def body(layout, state, inputs, targets):
        n_tokens = inputs.shape[1] * inputs.shape[2] * sizes[DATA] * sizes[CONTEXT]
        value, grads = _accumulate(partial(loss, n_tokens=n_tokens), state.params, inputs,
                                   targets, reduced=reduce_in_backward)
        grads = _reduce(grads, layout, reduced=reduce_in_backward)
        norm = _global_norm(grads, layout)
        value = jax.lax.psum(value, (DATA, CONTEXT))

        def update(params, adam_state, grads):
            if tcfg.grad_clip:  # optax.clip_by_global_norm, with the global norm; 0: none
                trigger = norm < tcfg.grad_clip
                grads = jax.tree.map(lambda g: jax.lax.select(
                    trigger, g, (g / norm.astype(g.dtype)) * tcfg.grad_clip), grads)
            updates, adam_state = adamw.update(grads, adam_state, params)
            return optax.apply_updates(params, updates), adam_state

        clip_state, adam_state = state.opt_state  # train.make_optimizer's chain
        # The loss and norm are the same on every device, so every device takes the same branch
        # (train.skip_unless); the all-gather stays outside the cond, and a skipped step
        # gathers back the very pieces it cut.
        finite = train.finite_step(value, norm)
        params, adam_state = train.skip_unless(finite, update, _zero_pieces(state.params, layout),
                                               adam_state, grads)
        params = _zero_gather(params, layout)
        metrics = {"loss": value, "grad_norm": norm, "lr": lr_at(state.step).astype(jnp.float32),
                   "skipped": 1.0 - finite.astype(jnp.float32)}
        return train.TrainState(state.step + 1, params, (clip_state, adam_state)), metrics

    def step(state, inputs, targets):
        train.check_batch(inputs, targets, tcfg, "sharded train step")
        check_batch(inputs.shape, sizes, config)
        layout = Layout.of(state.params, sizes, shard_optimizer)
        specs = layout.state_specs(state)
        run = jax.shard_map(partial(body, layout), mesh=mesh,
                            in_specs=(specs, _MICRO_BATCHES, _MICRO_BATCHES),
                            out_specs=(specs, P()))
        cp = sizes[CONTEXT]
        return run(state, zigzag(inputs, cp), zigzag(targets, cp))

    return jax.jit(step, donate_argnums=0)


def make_sharded_value_and_grad(config: gpt2.GPT2Config, mesh, ops=kernels, *,
                                dtype=jnp.float32, remat: bool = False,
                                collective_matmul: bool = False,
                                reduce_in_backward: bool = False):
    """f(params, inputs, targets) -> (mean loss, grads), jitted: train.loss_fn and its
    gradient over the mesh, for parallel-layout params and global int32 [B, T] batches.
    The options as make_sharded_train_step's."""
    sizes = mesh_sizes(mesh)
    check_model(config, sizes)
    loss = partial(_local_loss, config=config, ops=ops, dtype=dtype, remat=remat,
                   par=Parallel(sizes[TENSOR], sizes[CONTEXT], collective_matmul,
                                reduce_in_backward))

    def body(layout, params, inputs, targets):
        n_tokens = inputs.size * sizes[DATA] * sizes[CONTEXT]
        value, grads = _accumulate(partial(loss, n_tokens=n_tokens), params, inputs[None],
                                   targets[None], reduced=reduce_in_backward)
        grads = _reduce(grads, layout, reduced=reduce_in_backward)
        return jax.lax.psum(value, (DATA, CONTEXT)), grads

    def f(params, inputs, targets):
        check_batch(inputs.shape, sizes, config)
        layout = Layout.of(params, sizes)
        specs = layout.param_specs()
        run = jax.shard_map(partial(body, layout), mesh=mesh,
                            in_specs=(specs, _BATCH, _BATCH), out_specs=(P(), specs))
        cp = sizes[CONTEXT]
        return run(params, zigzag(inputs, cp), zigzag(targets, cp))

    return jax.jit(f)


def make_sharded_eval_step(config: gpt2.GPT2Config, tcfg: train.TrainConfig, mesh, ops=kernels,
                           *, collective_matmul: bool = False):
    """eval_step(params, inputs, targets) -> mean loss (float32) over global int32 [B, T]
    batches, for parallel-layout params (train.make_eval_step over the mesh)."""
    sizes = mesh_sizes(mesh)
    check_model(config, sizes)
    loss = partial(_local_loss, config=config, ops=ops, dtype=tcfg.compute_dtype, remat=False,
                   par=Parallel(sizes[TENSOR], sizes[CONTEXT], collective_matmul))

    def body(params, inputs, targets):
        n_tokens = inputs.size * sizes[DATA] * sizes[CONTEXT]
        return jax.lax.psum(loss(params, inputs, targets, n_tokens=n_tokens), (DATA, CONTEXT))

    def f(params, inputs, targets):
        check_batch(inputs.shape, sizes, config)
        specs = Layout.of(params, sizes).param_specs()
        run = jax.shard_map(body, mesh=mesh, in_specs=(specs, _BATCH, _BATCH),
                            out_specs=P())
        cp = sizes[CONTEXT]
        return run(params, zigzag(inputs, cp), zigzag(targets, cp))

    return jax.jit(f)


# --- per device ----------------------------------------------------------------------------------

def _local_loss(params, inputs, targets, *, config, ops, dtype, remat, par, n_tokens,
                scan_layers=None):
    """This device's share of the mean loss: the sum of its tokens' losses / n_tokens (all
    tokens of the micro-batch), so the shares add up to train.loss_fn over "data" and
    "context"; the same on every device of "tensor"."""
    logits = gpt2.forward(from_parallel_layout(params), inputs, config=config, ops=ops,
                          dtype=dtype, remat=remat, parallel=par, scan_layers=scan_layers)
    vocab = logits.shape[-1]  # this device's slice of the padded vocabulary
    # The padded columns never enter the softmax, as in train.loss_fn.
    losses = ops.vocab_parallel_softmax_cross_entropy(
        logits.reshape(-1, vocab), targets.reshape(-1), axis_name=TENSOR,
        num_classes=config.vocab_size)
    return jnp.sum(losses) / n_tokens


def _accumulate(loss, params, inputs, targets, *, reduced=False):
    """(loss share, grads) summed over the micro-batches [accum, B, T], then averaged.

    The params are cast to varying over every axis first: each device's gradient is then its
    own contribution, and the reduction over devices happens once, after the last micro-batch
    (_reduce), instead of inside every backward. With `reduced` the loss casts them itself,
    layer by layer (Parallel.share), and the gradients come out of each backward reduced.
    """
    if not reduced:
        params = vary(params)
    grad = jax.value_and_grad(loss)

    def micro(acc, batch):
        return jax.tree.map(jnp.add, acc, grad(params, *batch)), None

    zero = (vary(jnp.zeros([], jnp.float32), (DATA, CONTEXT)), jax.tree.map(jnp.zeros_like, params))
    (value, grads), _ = jax.lax.scan(micro, zero, (inputs, targets))
    n = inputs.shape[0]
    return value / n, jax.tree.map(lambda g: g / n, grads)


def _reduce(grads, layout, *, reduced=False):
    """Each gradient summed over the devices that share its leaf: all-reduce over the axes it
    is replicated on; with a ZeRO axis, reduce-scatter over "data" along it instead. Gradients
    `reduced` already (in the backward) are only cut to this device's ZeRO piece."""
    if reduced:
        return _zero_pieces(grads, layout)
    out = []
    for g, t, z in zip(layout.treedef.flatten_up_to(grads), layout.tensor_axes,
                       layout.zero_axes):
        replicated = tuple(a for a in AXES if not (a == TENSOR and t is not None)
                           and not (a == DATA and z is not None))
        g = jax.lax.psum(g, replicated)
        if z is not None:
            g = jax.lax.psum_scatter(g, DATA, scatter_dimension=z, tiled=True)
        out.append(g)
    return layout.treedef.unflatten(out)


def _global_norm(grads, layout):
    """optax.tree.norm of the whole (unsharded) gradient: squares summed per device, then
    over the axes each leaf is split along."""
    sums = {}
    for g, t, z in zip(layout.treedef.flatten_up_to(grads), layout.tensor_axes,
                       layout.zero_axes):
        axes = (TENSOR,) * (t is not None) + (DATA,) * (z is not None)
        sums[axes] = sums.get(axes, 0.0) + jnp.sum(jnp.square(g.astype(jnp.float32)))
    return jnp.sqrt(sum(jax.lax.psum(s, axes) if axes else s for axes, s in sums.items()))


def _zero_pieces(params, layout):
    """This device's piece of each leaf along its ZeRO axis (the part it updates)."""
    def piece(p, z):
        if z is None:
            return p
        n = p.shape[z] // jax.lax.axis_size(DATA)
        return jax.lax.dynamic_slice_in_dim(p, jax.lax.axis_index(DATA) * n, n, axis=z)

    return layout.treedef.unflatten(
        [piece(p, z) for p, z in zip(layout.treedef.flatten_up_to(params), layout.zero_axes)])


def _zero_gather(params, layout):
    """The updated pieces put together again on every device of "data"."""
    return layout.treedef.unflatten([
        p if z is None else jax.lax.all_gather(p, DATA, axis=z, tiled=True, to="invarying")
        for p, z in zip(layout.treedef.flatten_up_to(params), layout.zero_axes)])
