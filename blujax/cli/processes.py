"""A run over several processes (hosts) from the command line: starting them.

    # host 0 and host 1 (each with its GPUs), the same command but --process-id:
    gpt2.py train --dp 4 --tp 2 --coordinator host0:1234 --num-processes 2 --process-id 0
    gpt2.py train --dp 4 --tp 2 --coordinator host0:1234 --num-processes 2 --process-id 1

Keeping them in step once started (together, fail_fast, who writes) is blujax.processes.
"""

from __future__ import annotations

import os

import jax

from blujax import metrics, sharding
from blujax.cli.settings import UsageError
from blujax.loop import TrainingError
from blujax.processes import ERRORS, ProcessError, Processes

ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = (
    "BLUJAX_COORDINATOR", "BLUJAX_NUM_PROCESSES", "BLUJAX_PROCESS_ID")

# The library's errors main() does not know: cmd_train says them as UsageErrors.
LIBRARY_ERRORS = (ProcessError, TrainingError, metrics.MetricsError)
# The errors main() (blujax/cli/__init__.py) prints in one line with status 2: a process's
# own (see blujax.processes.Processes.fail_fast).
USER_ERRORS = (UsageError, *ERRORS, *LIBRARY_ERRORS)


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
        return Processes(errors=USER_ERRORS)
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
    return Processes(jax.process_index(), count, USER_ERRORS)
