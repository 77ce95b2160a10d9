"""Runs over several hosts: one process per host, each calling `initialize()` first.

    # every host, before any other JAX call (2 hosts here; ids 0 and 1):
    BLUJAX_COORDINATOR=host0:1234 BLUJAX_NUM_PROCESSES=2 BLUJAX_PROCESS_ID=0 python train.py

Under SLURM or Open MPI, jax.distributed.initialize finds all of this by itself and the
variables can be left out. Afterwards jax.devices() lists the devices of every host and
`make_mesh` spans them (host-major, so a "tensor" group stays on one host when the tensor
size divides the devices per host). Each process puts its own rows of the batch in with
jax.make_array_from_process_local_data(batch_sharding(mesh), rows); everything else is the
same program on every host.

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
