"""Runs over several hosts: one process per host, each calling `initialize()` first.

    # every host, before any other JAX call (2 hosts here; ids 0 and 1):
    BLUJAX_COORDINATOR=host0:1234 BLUJAX_NUM_PROCESSES=2 BLUJAX_PROCESS_ID=0 python train.py

The GPT-2 command line does all of this: `examples/gpt2.py train --coordinator host0:1234
--num-processes 2 --process-id 0` (the same variables are its defaults); see blujax/cli/
processes.py and the README.

Under SLURM or Open MPI, jax.distributed.initialize finds the coordinator and process ids by
itself and those variables can be left out. Afterwards jax.devices() lists the devices of
every host and `make_mesh` spans them (host-major, so a "tensor" group stays on one host when
the tensor size divides the devices per host). The batch goes in as a global array that each
process builds from the parts its devices hold: with every process holding the whole batch,
jax.make_array_from_callback(shape, batch_sharding(mesh), lambda index: batch[index]), which
works on any mesh; with each holding only its own rows, make_array_from_process_local_data,
which fits when the "data" groups line up with the processes. Everything else is the same
program on every host. To save checkpoints, blujax.train.gather gives every process each
array whole, and process 0 saves it (blujax.checkpoint).

To try it on one machine with CPU devices (two processes of 4 devices, gloo collectives):

    for i in 0 1; do JAX_PLATFORMS=cpu JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo \\
      XLA_FLAGS=--xla_force_host_platform_device_count=4 BLUJAX_COORDINATOR=localhost:12355 \\
      BLUJAX_NUM_PROCESSES=2 BLUJAX_PROCESS_ID=$i python my_run.py & done; wait
"""

from __future__ import annotations

import os

import jax

_ENV = {"coordinator_address": "BLUJAX_COORDINATOR", "num_processes": "BLUJAX_NUM_PROCESSES",
        "process_id": "BLUJAX_PROCESS_ID"}


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids=None) -> None:
    """jax.distributed.initialize with each argument left out taken from its environment
    variable (BLUJAX_COORDINATOR, BLUJAX_NUM_PROCESSES, BLUJAX_PROCESS_ID), or else detected by
    JAX (SLURM, Open MPI, ...). Does nothing for a single process (BLUJAX_NUM_PROCESSES=1)."""
    args = {"coordinator_address": coordinator_address, "num_processes": num_processes,
            "process_id": process_id}
    for name, var in _ENV.items():
        if args[name] is None and os.environ.get(var):
            value = os.environ[var]
            if name != "coordinator_address":
                try:
                    value = int(value)
                except ValueError:
                    raise ValueError(f"blujax.sharding.initialize: {var} must be an int, got "
                                     f"{value!r}") from None
            args[name] = value
    if args["num_processes"] == 1:
        return
    jax.distributed.initialize(**{k: v for k, v in args.items() if v is not None},
                               local_device_ids=local_device_ids)
