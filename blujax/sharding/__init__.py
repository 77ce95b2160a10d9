"""Data, fully sharded data (ZeRO-3), tensor (Megatron, sequence-parallel) and context (ring
attention) parallelism: the mesh, where each parameter lives on it, and the per-device hooks
of the one train step (`blujax.train.make_train_step(..., mesh=mesh)`).

    mesh = make_mesh(data=2, tensor=2, context=2)          # or make_mesh(tensor=2, fsdp=4)
    state = train.init_state(config, tcfg, key, mesh=mesh, shard_optimizer=True)
    step = train.make_train_step(config, tcfg, mesh=mesh, shard_optimizer=True)
    state, metrics = step(state, inputs, targets)

mesh.py: the mesh and its checks; layout.py: the logical-axis -> mesh-axis rules and where
each leaf lives; parallel.py: the model's per-device hooks; ring.py: ring attention. (A
mesh over several hosts: blujax.processes.start first.)
"""

from blujax.sharding.layout import RULES, Layout, state_shardings
from blujax.sharding.mesh import (AXES, BATCH_AXES, CONTEXT, DATA, FSDP, TENSOR, make_mesh,
                                  mesh_devices)
from blujax.sharding.parallel import Parallel
from blujax.sharding.ring import ring_attention, zigzag

__all__ = [
    "AXES", "BATCH_AXES", "CONTEXT", "DATA", "FSDP", "RULES", "TENSOR", "Layout", "Parallel",
    "make_mesh", "mesh_devices", "ring_attention", "state_shardings", "zigzag",
]
