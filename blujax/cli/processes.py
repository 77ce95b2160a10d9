"""A run over several processes (hosts): starting them, keeping them in step, and who writes.

    # host 0 and host 1 (each with its GPUs), the same command but --process-id:
    gpt2.py train --dp 4 --tp 2 --coordinator host0:1234 --num-processes 2 --process-id 0
    gpt2.py train --dp 4 --tp 2 --coordinator host0:1234 --num-processes 2 --process-id 1

Every process runs the same program over one mesh of all processes' devices (SPMD): it reads
the same data, takes the same decisions and calls the same collectives in the same order.
Only process 0 (the lead) writes --out's files and prints. A process that stops on its own
(an error the others do not meet) would leave the others waiting in their next collective,
so the set-up runs in `together()` blocks, after which all processes go on or all stop; and
a signal that reaches some processes only stops all of them after the same step (train.py
polls for it every _TrainLoop.STOP_POLL steps).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import jax
import numpy as np

from blujax import sharding
from blujax.cli.settings import UsageError

ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = (
    "BLUJAX_COORDINATOR", "BLUJAX_NUM_PROCESSES", "BLUJAX_PROCESS_ID")


class OtherProcessFailed(UsageError):
    """Another process of the run stopped with an error (which it printed); this one stops
    too."""


@dataclasses.dataclass(frozen=True)
class Processes:
    """This process's place in the run: index in [0, count)."""

    index: int = 0
    count: int = 1

    @property
    def lead(self) -> bool:
        """Whether this process writes the run's files and prints (process 0)."""
        return self.index == 0

    def gather(self, value: int) -> list[int]:
        """Every process's `value`, by process. A collective: every process calls it at the
        same point."""
        if self.count == 1:
            return [int(value)]
        from jax.experimental import multihost_utils
        return [int(v) for v in multihost_utils.process_allgather(np.int32(value))]

    @contextlib.contextmanager
    def together(self):
        """Runs the block on every process; if it raises on any of them, it raises on all
        (there, with its own error; elsewhere OtherProcessFailed), so that no process is left
        waiting for the others. Nothing more than the block itself with one process."""
        if self.count == 1:
            yield
            return
        try:
            yield
        except Exception:
            self.gather(1)
            raise
        failed = [i for i, v in enumerate(self.gather(0)) if v]
        if failed:
            raise OtherProcessFailed(
                f"process {failed[0]} of {self.count} stopped with an error (its output says "
                f"which); this process ({self.index}) stops too")

    def same(self, value: int, what: str):
        """Refuses to go on (on every process) unless every process has the same `value`."""
        values = self.gather(value)
        if len(set(values)) > 1:
            raise UsageError(f"the processes disagree on {what}: "
                             + ", ".join(f"process {i} has {v}" for i, v in enumerate(values)))

    def any(self, flag: bool) -> bool:
        """Whether `flag` is set on any process (a collective with several)."""
        return bool(flag) if self.count == 1 else any(self.gather(int(flag)))

    def global_array(self, host: np.ndarray, sharding_):
        """The global array of `host`, which every process holds in full, with `sharding_`:
        each process puts in exactly the pieces its own devices hold. With one process, a
        plain device_put."""
        if self.count == 1:
            return jax.device_put(host, sharding_)
        return jax.make_array_from_callback(host.shape, sharding_, lambda index: host[index])


def start(args) -> Processes:
    """The run's processes from --coordinator, --num-processes and --process-id (else their
    environment variables); with more than one, jax.distributed starts here, before anything
    else asks JAX for its devices."""
    count = args.num_processes
    if count is None:
        env = os.environ.get(ENV_NUM_PROCESSES)
        try:
            count = int(env) if env else 1
        except ValueError:
            raise UsageError(f"{ENV_NUM_PROCESSES}={env} is not a whole number") from None
    if count < 1:
        raise UsageError(f"--num-processes must be at least 1, got {count}")
    if count == 1:
        given = [f for f, v in (("--coordinator", args.coordinator),
                                ("--process-id", args.process_id)) if v is not None]
        if given:
            raise UsageError(f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} "
                             f"to a run of several processes: give --num-processes too")
        return Processes()
    if args.process_id is not None and not 0 <= args.process_id < count:
        raise UsageError(f"--process-id must lie in [0, --num-processes {count}), got "
                         f"{args.process_id}")
    try:
        # Left out, the coordinator and process id come from BLUJAX_COORDINATOR and
        # BLUJAX_PROCESS_ID, else from what JAX detects (SLURM, Open MPI).
        sharding.initialize(args.coordinator, count, args.process_id)
    except (ValueError, RuntimeError) as e:
        raise UsageError(f"could not start a run of {count} processes: {e} (give "
                         f"--coordinator HOST:PORT and --process-id, or set "
                         f"{ENV_COORDINATOR} and {ENV_PROCESS_ID})") from None
    if jax.process_count() != count:
        raise UsageError(f"--num-processes {count}, but JAX started {jax.process_count()}")
    return Processes(jax.process_index(), count)
