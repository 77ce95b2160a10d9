"""The device mesh of a parallel run: axes ("data", "fsdp", "tensor", "context"), any of them 1.

    mesh = make_mesh(data=2, tensor=2, context=2)      # 8 devices
    mesh = make_mesh(tensor=2, fsdp=4)                 # 8 devices, parameters split over 4

data splits the batch; fsdp splits the batch too, and also every parameter, its gradient and
its optimizer state (ZeRO-3: each layer's weights are gathered where the layer runs); tensor
the heads, MLP and vocabulary (Megatron, with sequence-parallel LayerNorm regions), context the
sequence (ring attention). The axes are Auto-typed: the train
step is one `shard_map` over the whole mesh, and jit may move a batch that arrives with another
sharding (or none) to the step's layout itself.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


DATA, FSDP, TENSOR, CONTEXT = "data", "fsdp", "tensor", "context"
AXES = (DATA, FSDP, TENSOR, CONTEXT)
# The axes a batch's sequences split over.
BATCH_AXES = (DATA, FSDP)


def make_mesh(data: int = 1, tensor: int = 1, context: int = 1, devices=None, *,
              fsdp: int = 1) -> Mesh:
    """A ("data", "fsdp", "tensor", "context") mesh over `devices` (default: all of them); the
    product of the sizes must be the number of devices."""
    sizes = {DATA: data, FSDP: fsdp, TENSOR: tensor, CONTEXT: context}
    for name, n in sizes.items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"make_mesh: {name} must be a positive int, got {n!r}")
    devices = jax.devices() if devices is None else list(devices)
    if math.prod(sizes.values()) != len(devices):
        raise ValueError(f"make_mesh: {describe(sizes)} = {math.prod(sizes.values())} devices, "
                         f"but there are {len(devices)}; the product must equal the device "
                         f"count")
    # Devices in order (jax.devices() is host-major) fill (data, fsdp, context, tensor): the
    # tensor groups, whose collectives are the most frequent, are neighbours on one host, then
    # the context rings; the fsdp groups next (a gather per layer), data outermost (one
    # reduction per step).
    grid = np.asarray(devices, dtype=object).reshape(data, fsdp, context, tensor)
    return Mesh(grid.transpose(0, 1, 3, 2), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def describe(sizes: dict[str, int]) -> str:
    """"data 2 x fsdp 2 x tensor 2 x context 1" of mesh sizes."""
    return " x ".join(f"{a} {sizes.get(a, 1)}" for a in AXES)


def mesh_devices(data: int = 1, tensor: int = 1, context: int = 1, *, fsdp: int = 1) -> list:
    """The devices a mesh of these sizes takes: the first data x fsdp x tensor x context of
    jax.devices(); with several processes, all of them (a process whose devices were left out
    would have nothing to compute). ValueError if that is not what JAX has."""
    n, have, processes = data * fsdp * tensor * context, jax.device_count(), jax.process_count()
    product = (f"{describe({DATA: data, FSDP: fsdp, TENSOR: tensor, CONTEXT: context})} = {n} "
               f"devices")
    if processes > 1 and n != have:
        raise ValueError(f"blujax.sharding: {product}, but the {processes} processes have "
                         f"{have} ({jax.default_backend()}) together; with several processes "
                         f"the product must equal that count (the mesh spans all of them)")
    if n > have:
        raise ValueError(f"blujax.sharding: {product}, but JAX has {have} "
                         f"({jax.default_backend()}); the product must be at most the device "
                         f"count (the mesh takes the first ones)")
    return jax.devices()[:n]


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
    """{"data": n, "fsdp": n, "tensor": n, "context": n} of a mesh with exactly these axes."""
    if set(mesh.axis_names) != set(AXES) or len(mesh.axis_names) != len(AXES):
        raise ValueError(f"blujax.sharding: the mesh must have the axes {AXES} (make_mesh builds "
                         f"one), got {tuple(mesh.axis_names)}")
    return dict(mesh.shape)


def check_batch(shape, sizes: dict[str, int], config) -> None:
    """A global batch [..., B, T] splits evenly: B over data x fsdp; T over context in 2 x
    context zig-zag chunks; each device's T / context tokens over tensor (sequence
    parallelism)."""
    B, T = shape[-2:]
    dp, tp, cp = sizes[DATA] * sizes[FSDP], sizes[TENSOR], sizes[CONTEXT]
    if B % dp:
        raise ValueError(f"blujax.sharding: the batch size ({B}) must be divisible by data x "
                         f"fsdp ({sizes[DATA]} x {sizes[FSDP]} = {dp}): both split the batch")
    if cp > 1 and T % (2 * cp):
        raise ValueError(f"blujax.sharding: the sequence length ({T}) must be divisible by 2 x "
                         f"context = {2 * cp}: each device holds two of 2 x context chunks "
                         f"(zig-zag, for balanced causal attention)")
    if (T // cp) % tp:
        raise ValueError(f"blujax.sharding: each device's sequence ({T} / context {cp} = "
                         f"{T // cp}) must be divisible by the tensor axis ({tp}): the "
                         f"LayerNorm regions are split over it (sequence parallelism)")
    if T > config.block_size:
        raise ValueError(f"blujax.sharding: sequence length {T} exceeds the model's block_size "
                         f"({config.block_size})")
