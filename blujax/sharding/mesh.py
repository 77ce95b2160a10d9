"""The device mesh of a parallel run: axes ("data", "tensor", "context"), any of them 1.

    mesh = make_mesh(data=2, tensor=2, context=2)      # 8 devices

data splits the batch, tensor the heads, MLP and vocabulary (Megatron, with sequence-parallel
LayerNorm regions), context the sequence (ring attention). The axes are Auto-typed: the train
step is one `shard_map` over the whole mesh, and jit may move a batch that arrives with another
sharding (or none) to the step's layout itself.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


DATA, TENSOR, CONTEXT = "data", "tensor", "context"
AXES = (DATA, TENSOR, CONTEXT)


def make_mesh(data: int = 1, tensor: int = 1, context: int = 1, devices=None) -> Mesh:
    """A ("data", "tensor", "context") mesh over `devices` (default: all of them); the product of
    the sizes must be the number of devices."""
    sizes = (data, tensor, context)
    for name, n in zip(AXES, sizes):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"make_mesh: {name} must be a positive int, got {n!r}")
    devices = jax.devices() if devices is None else list(devices)
    if math.prod(sizes) != len(devices):
        raise ValueError(f"make_mesh: data x tensor x context = {data} x {tensor} x {context} = "
                         f"{math.prod(sizes)}, but there are {len(devices)} devices; the "
                         f"product must equal the device count")
    # Devices in order (jax.devices() is host-major) fill (data, context, tensor): the tensor
    # groups, whose collectives are the most frequent, are neighbours on one host.
    grid = np.asarray(devices, dtype=object).reshape(data, context, tensor).transpose(0, 2, 1)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 3)


def mesh_devices(data: int = 1, tensor: int = 1, context: int = 1) -> list:
    """The devices a mesh of these sizes takes: the first data x tensor x context of
    jax.devices(); with several processes, all of them (a process whose devices were left out
    would have nothing to compute). ValueError if that is not what JAX has."""
    n, have, processes = data * tensor * context, jax.device_count(), jax.process_count()
    product = f"data {data} x tensor {tensor} x context {context} = {n} devices"
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
    """{"data": n, "tensor": n, "context": n} of a mesh with exactly these axes."""
    if set(mesh.axis_names) != set(AXES) or len(mesh.axis_names) != len(AXES):
        raise ValueError(f"blujax.sharding: the mesh must have the axes {AXES} (make_mesh builds "
                         f"one), got {tuple(mesh.axis_names)}")
    return dict(mesh.shape)


def check_batch(shape, sizes: dict[str, int], config) -> None:
    """A global batch [..., B, T] splits evenly: B over data; T over context in 2 x context
    zig-zag chunks; each device's T / context tokens over tensor (sequence parallelism)."""
    B, T = shape[-2:]
    dp, tp, cp = sizes[DATA], sizes[TENSOR], sizes[CONTEXT]
    if B % dp:
        raise ValueError(f"blujax.sharding: the batch size ({B}) must be divisible by the data "
                         f"axis ({dp})")
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
