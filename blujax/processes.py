"""Several processes (hosts) in one run: starting them, keeping them in step, and who writes.

    procs = processes.start()                # first of all; jax.distributed with several
    with procs.together():                   # set-up: all processes go on, or all stop
        loader = ...
    with procs.fail_fast():                  # training: one process failing ends them all
        state, stop = loop.run(state, step, loader, config, processes=procs, ...)

    # every host, the same command (2 hosts here; ids 0 and 1):
    BLUJAX_COORDINATOR=host0:1234 BLUJAX_NUM_PROCESSES=2 BLUJAX_PROCESS_ID=0 python train.py

start() takes the coordinator, the process count and this process's id as arguments, else from
those environment variables, else (the coordinator and id) from what jax.distributed detects
under SLURM or Open MPI. Afterwards jax.devices() lists the devices of every host and
sharding.make_mesh spans them (host-major, so a "tensor" group stays on one host when the
tensor size divides the devices per host).

Every process runs the same program over one mesh of all processes' devices (SPMD): it reads
the same data, takes the same decisions and calls the same collectives in the same order; it
holds the whole batch and puts in the pieces its devices hold (global_array), which works on
any mesh. Only process 0 (the lead) writes the run's files and prints; to save checkpoints,
blujax.train.gather gives every process each array whole, and process 0 saves it. A process
that stops on its own (an error the others do not meet) would leave the others waiting in
their next collective, so the set-up runs in `together()` blocks, after which all processes go
on or all stop; the training runs in a `fail_fast()` block, where a process that stops (an
error, or killed) ends the others within seconds, even those waiting inside a collective; and
a signal that reaches some processes only stops all of them after the same step (blujax.loop
polls for it every LoopConfig.stop_poll steps).

To try it on one machine with CPU devices (two processes of 4 devices, gloo collectives):

    for i in 0 1; do JAX_PLATFORMS=cpu JAX_CPU_COLLECTIVES_IMPLEMENTATION=gloo \\
      XLA_FLAGS=--xla_force_host_platform_device_count=4 BLUJAX_COORDINATOR=localhost:12355 \\
      BLUJAX_NUM_PROCESSES=2 BLUJAX_PROCESS_ID=$i python my_run.py & done; wait
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import math
import os
import sys
import threading
import time

import jax
import numpy as np

from blujax.checkpoint import CheckpointError
from blujax.data import DataError

# fail_fast's timing, in seconds: how often each process looks for news of the others; how
# long a process may go unheard before the others take it for dead (JAX's own heartbeat
# timeout is 100 s); how long a failing process may take to end after its error before it is
# ended; how long process 0, which hosts the coordination service, waits at most for the
# others to end before it ends (and the service with it): longer than EXIT_GRACE_S.
POLL_S, SILENT_S, EXIT_GRACE_S, LAST_WAIT_S = 1.0, 20.0, 15.0, 20.0
# start()'s timing, in seconds: how long the processes wait for each other by default; when a
# waiting process first says so, then how often. JAX's own initialization_timeout is set
# INIT_MARGIN_S beyond ours, since its expiry aborts the process with a C++ fatal error.
INIT_TIMEOUT_S, INIT_FIRST_S, INIT_EVERY_S, INIT_MARGIN_S = 300.0, 2.0, 10.0, 60
EXIT_ERROR = 2    # a process ended with an error of its own (one of Processes.errors)
EXIT_STOPPED = 2  # a process ended because another one stopped


class ProcessError(Exception):
    """The processes of a run cannot start, disagree (on a setting, a folder, a checkpoint), or
    another one stopped with an error."""


class OtherProcessFailed(ProcessError):
    """Another process of the run stopped with an error (which it printed); this one stops
    too."""

    def __init__(self, failed: int, count: int, index: int):
        super().__init__(f"process {failed} of {count} stopped with an error (its output says "
                         f"which); this process ({index}) stops too")


# The errors a process raises on purpose, with a message for its user (printed in one line,
# the process ending with status 2): its own, never the echo of another process's failure in
# a collective. A program adds its own (the command line adds its usage error).
ERRORS = (ProcessError, DataError, CheckpointError)

# Where start() finds what it is not given.
ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = (
    "BLUJAX_COORDINATOR", "BLUJAX_NUM_PROCESSES", "BLUJAX_PROCESS_ID")


@dataclasses.dataclass(frozen=True)
class Processes:
    """This process's place in the run: index in [0, count). errors: the exceptions that are
    a process's own, printed in one line (see fail_fast)."""

    index: int = 0
    count: int = 1
    errors: tuple = ERRORS

    @classmethod
    def from_jax(cls, errors: tuple = ERRORS) -> Processes:
        """This process's place among JAX's processes (one, unless jax.distributed started)."""
        return cls(jax.process_index(), jax.process_count(), errors)

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
            raise OtherProcessFailed(failed[0], self.count, self.index)

    def fail_fast(self):
        """A context manager for a phase (the training loop) in which a process may stop while
        the others wait for it inside a collective: then every process ends within seconds,
        with a non-zero status. Nothing more than the block itself with one process.

        - The block raises here: this process tells the others (the coordination service's
          key-value store) and re-raises; its error is printed as usual (`error: ...` for one
          of `errors`, as blujax.cli.main does, or a traceback), then the process ends at once
          (status 2 for one of `errors`, 130 for Ctrl-C, else 1) rather than in
          jax.distributed.shutdown(), which would wait for the others up to 5 minutes;
          EXIT_GRACE_S after the error at most.
        - Another process raised: a watcher thread sees it within POLL_S, prints
          `error: process 1 of 2 stopped with an error (its output says which); this process
          (0) stops too` and ends this process with status 2, wherever its main thread is. An
          error here that only echoes that failure (a collective that lost its peer) raises
          OtherProcessFailed with that message instead, and ends the same way.
        - Another process went silent for SILENT_S (killed, or stuck): the same, with
          `error: process 1 of 2 has not been heard from for 20 s (killed, or stuck); ...`.

        A collective: every process enters it at the same point, and leaves it when every
        process has finished the block (or ends). A checkpoint being written when a process
        ends is left in its temporary folder, which the next Checkpointer tidies away; the
        earlier checkpoints stay whole."""
        if self.count == 1 or _client() is None:
            return contextlib.nullcontext()
        return _FailFast(self)

    def same(self, value: int, what: str):
        """Refuses to go on (on every process) unless every process has the same `value`."""
        values = self.gather(value)
        if len(set(values)) > 1:
            raise ProcessError(f"the processes disagree on {what}: "
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


def start(coordinator: str | None = None, num_processes: int | None = None,
          process_id: int | None = None, *, errors: tuple = ERRORS,
          init_timeout: float | None = None, local_device_ids=None) -> Processes:
    """This process's place in the run, with jax.distributed started when there are several:
    call it before anything asks JAX for its devices. Left out, coordinator ("HOST:PORT" of
    process 0's host), num_processes and process_id come from ENV_COORDINATOR,
    ENV_NUM_PROCESSES and ENV_PROCESS_ID, else num_processes is 1 and the others are what
    JAX detects (SLURM, Open MPI). errors: as Processes'. ProcessError for values that cannot
    start a run, or a start that fails.

    While the processes wait for each other, each says so on stderr after INIT_FIRST_S, then
    every INIT_EVERY_S (`process 0 of 2 waiting for the others at localhost:1234 (12 s of at
    most 300 s)`); after init_timeout seconds (default INIT_TIMEOUT_S) it gives up with one
    line, `error: process 0 of 2 gave up waiting for the others at localhost:1234 after
    300 s: some have not started (...)`, and ends with status 2 (from a thread: JAX's wait
    cannot be interrupted)."""
    init_timeout = INIT_TIMEOUT_S if init_timeout is None else init_timeout
    if not 0 < init_timeout < math.inf:
        raise ProcessError(f"the time to wait for the other processes must be a finite number "
                           f"of seconds above 0, got {init_timeout:g}")
    if num_processes is None:
        num_processes = _env_int(ENV_NUM_PROCESSES, 1)
    if num_processes < 1:
        raise ProcessError(f"the number of processes must be at least 1, got {num_processes}")
    if num_processes == 1:
        return Processes(errors=errors)
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR) or None
    if process_id is None:
        process_id = _env_int(ENV_PROCESS_ID, None)
    if process_id is not None and not 0 <= process_id < num_processes:
        raise ProcessError(f"the process id must lie in [0, {num_processes}), got {process_id}")
    given = {"coordinator_address": coordinator, "process_id": process_id}
    try:
        with _Waiting(process_id, num_processes, coordinator, init_timeout):
            jax.distributed.initialize(
                num_processes=num_processes, local_device_ids=local_device_ids,
                initialization_timeout=math.ceil(init_timeout) + INIT_MARGIN_S,
                **{k: v for k, v in given.items() if v is not None})
    except (ValueError, RuntimeError) as e:
        raise ProcessError(f"could not start a run of {num_processes} processes: {e} (give "
                           f"process 0's HOST:PORT and this process's id: {ENV_COORDINATOR}, "
                           f"{ENV_PROCESS_ID})") from None
    if jax.process_count() != num_processes:
        raise ProcessError(f"{num_processes} processes asked for, but JAX started "
                           f"{jax.process_count()}")
    return Processes(jax.process_index(), num_processes, errors)


class _Waiting:
    """start()'s watch over jax.distributed.initialize, which blocks until every process has
    connected: a thread says on stderr what this process waits for, and ends it (status 2)
    once `timeout` has passed. How many have connected is not known before then."""

    def __init__(self, index: int | None, count: int, coordinator: str | None,
                 timeout: float):
        who = f"process {index} of {count}" if index is not None else \
            f"this process (one of {count})"
        self.what = f"{who} waiting for the others" + (f" at {coordinator}" if coordinator
                                                        else "")
        self.timeout = timeout
        self._lock = threading.Lock()
        self._done = threading.Event()

    def __enter__(self):
        self._start = time.monotonic()
        threading.Thread(target=self._watch, name="blujax-start", daemon=True).start()
        return self

    def __exit__(self, *exc):
        with self._lock:  # the watcher ends the process under it, or never
            self._done.set()
        return False

    def _watch(self):
        deadline = self._start + self.timeout
        report = self._start + INIT_FIRST_S
        while not self._done.wait(max(0.0, min(report, deadline) - time.monotonic())):
            now = time.monotonic()
            if now >= deadline:
                break
            print(f"{self.what} ({now - self._start:.0f} s of at most {self.timeout:g} s)",
                  file=sys.stderr, flush=True)
            report += INIT_EVERY_S
        with self._lock:
            if self._done.is_set():
                return
            print(f"error: {self.what.replace(' waiting for', ' gave up waiting for', 1)} "
                  f"after {self.timeout:g} s: some have not started (each needs the same "
                  f"coordinator and number of processes, and an id of its own)",
                  file=sys.stderr, flush=True)
            with contextlib.suppress(Exception):
                sys.stdout.flush()
            # os._exit: the main thread is inside initialize, which no exception reaches.
            os._exit(EXIT_ERROR)


def _env_int(name: str, default: int | None) -> int | None:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ProcessError(f"{name}={value} is not a whole number") from None


def _client():
    """jax.distributed's client (the coordination service's key-value store), or None."""
    from jax._src import distributed
    return distributed.global_state.client


_blocks = itertools.count()  # fail_fast blocks entered: the same sequence on every process
_END = threading.Lock()      # taken by whatever ends the process, never given back
_leaving: list = []          # the _FailFast of a process on its way out (after its error)


def _exit_status(e: BaseException, errors: tuple) -> int:
    """The status a process ends with when `e` leaves its program: 2 for one of `errors`
    (printed in one line, as blujax.cli.main does), 130 for Ctrl-C, 1 for anything else."""
    if isinstance(e, SystemExit):
        return e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    if isinstance(e, KeyboardInterrupt):
        return 130
    return EXIT_ERROR if isinstance(e, errors) else 1


@atexit.register  # after jax's own exit handlers (jax is imported above), so it runs first
def _end_if_leaving():
    if _leaving:
        _leaving[0].end()


class _FailFast:
    """Processes.fail_fast() on one process. Each block has its keys in the coordination
    service's key-value store, under blujax/fail_fast/<block>/: `first` (the process that
    failed first), failed/<i>, beat/<i> (a count each process bumps every POLL_S), done/<i>
    (it finished the block) and stopping/<i> (it is ending)."""

    def __init__(self, procs: Processes):
        self.procs, self.client = procs, _client()
        self.prefix = f"blujax/fail_fast/{next(_blocks)}/"
        self.others = [j for j in range(procs.count) if j != procs.index]
        self._lock = threading.Lock()
        self._leaving = None  # (status, since when): this process is on its way out
        self._silent: set[int] = set()
        self._finished = threading.Event()
        self._beats = itertools.count()

    def _key(self, what: str, j: int | None = None) -> str:
        return f"{self.prefix}{what}/{self.procs.index if j is None else j}"

    def _set(self, what: str, value="1"):
        try:
            self.client.key_value_set(self._key(what), str(value), allow_overwrite=True)
        except Exception:  # the service is gone: JAX's error polling ends the process
            pass

    def __enter__(self):
        self._set("beat", next(self._beats))
        self._watcher = threading.Thread(target=self._watch, name="blujax-fail-fast",
                                         daemon=True)
        self._watcher.start()
        return self

    def __exit__(self, kind, e, tb):
        if kind is None:
            self._finish()
            return False
        with self._lock:  # the watcher waits: this process's own news comes first
            if self._leaving is not None:  # the watcher is ending the process already
                threading.Event().wait()
            if isinstance(e, OtherProcessFailed):  # from together(): no news to the others
                status, first = EXIT_STOPPED, None
            else:
                first = self._announce()
                errors = self.procs.errors
                if first in (None, self.procs.index) or isinstance(e, errors):
                    status, first = _exit_status(e, errors), None
                else:
                    # Most likely a collective that lost a process which stopped first (on
                    # the CPU, gloo's "connection closed"): that one's error is the news.
                    status = EXIT_STOPPED
            self._leaving = (status, time.monotonic())
            # The process ends at interpreter exit, once its error is printed
            # (_end_if_leaving), or EXIT_GRACE_S from now (the watcher).
            _leaving.append(self)
        if first is not None:
            raise OtherProcessFailed(first, self.procs.count, self.procs.index) from None
        return False

    def _announce(self) -> int | None:
        """Tells the others that this process failed; which process failed first (this one or
        another), or None when the service is out of reach."""
        try:
            try:  # without overwrite: the first to set it keeps it
                self.client.key_value_set(self.prefix + "first", str(self.procs.index))
                first = self.procs.index
            except Exception:
                first = int(self.client.key_value_try_get(self.prefix + "first"))
            self.client.key_value_set(self._key("failed"), "1", allow_overwrite=True)
            return first
        except Exception:
            return None

    def _stop(self, why: str):
        """The watcher's verdict: this process stops, with `why` on stderr (unless the block
        has just raised here: then that takes its course)."""
        with self._lock:
            if self._leaving is not None:
                return
            self._leaving = (EXIT_STOPPED, time.monotonic())
        self.end(("\n" if sys.stderr.isatty() else "")  # past a progress bar's line
                 + f"error: {why}")

    def end(self, line: str | None = None):
        """Ends this process, after telling the others. Process 0 ends last, up to LAST_WAIT_S
        later: it hosts the coordination service, and its end would abort the others' JAX
        runtimes (a C++ fatal error) before they have seen the news and printed their line."""
        _END.acquire()  # a second caller waits here for the first to end the process
        if line:
            print(line, file=sys.stderr, flush=True)
        self._set("stopping")
        if self.procs.index == 0:
            deadline = time.monotonic() + LAST_WAIT_S
            while time.monotonic() < deadline:
                try:
                    keys = {k for k, _ in self.client.key_value_dir_get(self.prefix)}
                except Exception:
                    break
                if all(self._key("stopping", j) in keys
                       for j in self.others if j not in self._silent):
                    break
                time.sleep(0.05)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        # os._exit, not sys.exit or a return: the main thread may be blocked inside XLA in a
        # collective that will never complete (a watcher's sys.exit would only end the
        # watcher), and a normal exit runs jax.distributed.shutdown() (an atexit handler),
        # which waits at a barrier for every process, up to shutdown_timeout_seconds (300 s).
        os._exit(self._leaving[0])

    def _watch(self):
        """Every POLL_S: a beat, then the news of the others; ends the process when another
        one failed or fell silent, or when this one is slow to end after its own error."""
        me, count = self.procs.index, self.procs.count
        heard = time.monotonic()  # the service last answered
        beats, seen = {}, {j: heard for j in self.others}
        while not self._finished.wait(POLL_S):
            now = time.monotonic()
            with self._lock:
                leaving = self._leaving
            if leaving is not None:
                if now - leaving[1] > EXIT_GRACE_S:
                    self.end()
                continue
            try:
                self.client.key_value_set(self._key("beat"), str(next(self._beats)),
                                          allow_overwrite=True)
                entries = dict(self.client.key_value_dir_get(self.prefix))
                heard = now
            except Exception:  # JAX's error polling most often ends the process first
                if now - heard > SILENT_S:
                    self._stop(f"the run's coordination service (process 0 of {count}) has "
                               f"not answered for {SILENT_S:g} s; this process ({me}) stops "
                               f"too")
                continue
            failed = [j for j in self.others if self._key("failed", j) in entries]
            if failed:
                first = int(entries.get(self.prefix + "first", failed[0]))
                self._stop(str(OtherProcessFailed(failed[0] if first == me else first, count,
                                                  me)))
                continue
            for j in self.others:
                if self._key("done", j) in entries or self._key("stopping", j) in entries:
                    continue
                beat = entries.get(self._key("beat", j))
                if beat != beats.get(j):
                    beats[j], seen[j] = beat, now
                elif now - seen[j] > SILENT_S:
                    self._silent.add(j)
                    self._stop(f"process {j} of {count} has not been heard from for "
                               f"{SILENT_S:g} s (killed, or stuck); this process ({me}) stops "
                               f"too")
                    break

    def _finish(self):
        """The block ended well here: waits until it has on every process (watching on)."""
        self._set("done")
        pause = 0.01
        while True:
            try:
                keys = {k for k, _ in self.client.key_value_dir_get(self.prefix)}
                if all(self._key("done", j) in keys for j in self.others):
                    break
            except Exception:
                pass
            time.sleep(pause)
            pause = min(2 * pause, POLL_S)
        self._finished.set()
        self._watcher.join()
