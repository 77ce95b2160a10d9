"""Data, tensor (Megatron, sequence-parallel) and context (ring attention) parallelism for
GPT-2: the train step as one shard_map over a ("data", "tensor", "context") mesh.

    mesh = make_mesh(data=2, tensor=2, context=2)
    state = init_sharded_state(config, tcfg, key, mesh, shard_optimizer=True)
    step = make_sharded_train_step(config, tcfg, mesh, shard_optimizer=True)
    state, metrics = step(state, inputs, targets)

mesh.py: the mesh and its checks; parallel.py: the model's per-device hooks; ring.py: ring
attention; specs.py: where each leaf lives; step.py: the steps; distributed.py: several hosts.
"""

from blujax.sharding.distributed import initialize
from blujax.sharding.mesh import AXES, CONTEXT, DATA, TENSOR, make_mesh
from blujax.sharding.parallel import Parallel
from blujax.sharding.ring import ring_attention, zigzag
from blujax.sharding.specs import (Layout, from_parallel_layout, from_parallel_state,
                                   state_shardings, to_parallel_layout, to_parallel_state)
from blujax.sharding.step import (batch_sharding, init_sharded_state, make_sharded_eval_step,
                                  make_sharded_train_step, make_sharded_value_and_grad,
                                  shard_state, unshard_params, unshard_state)

__all__ = [
    "AXES", "CONTEXT", "DATA", "TENSOR", "Layout", "Parallel", "batch_sharding",
    "from_parallel_layout", "from_parallel_state", "init_sharded_state", "initialize", "make_mesh",
    "make_sharded_eval_step", "make_sharded_train_step", "make_sharded_value_and_grad",
    "ring_attention", "shard_state", "state_shardings", "to_parallel_layout",
    "to_parallel_state", "unshard_params", "unshard_state", "zigzag",
]
