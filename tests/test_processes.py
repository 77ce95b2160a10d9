"""Processes.fail_fast: two CPU processes of one JAX run (a localhost coordinator, gloo
collectives) in a loop of collectives, where one of them stops."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # end to end: outside the fast tier (-m "not slow")

# Process `failer` stops at iteration 3 (as `mode` says) while the other goes on calling
# collectives. It prints on stdout when it stops. Shorter waits than a real run's.
_SCRIPT = """
import os, signal, sys, time
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from blujax import processes
from blujax.cli.settings import USER_ERRORS, UsageError

processes.SILENT_S = processes.EXIT_GRACE_S = 3.0


def main():
    index, port, mode, failer = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    procs = processes.start(f"localhost:{port}", 2, index, errors=USER_ERRORS)
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    total = jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, P()))
    x = procs.global_array(np.ones(jax.device_count(), np.float32),
                           NamedSharding(mesh, P("d")))
    try:
        with procs.fail_fast():
            for step in range(12):
                if step == 3 and index == failer and mode != "ok":
                    print(f"stopping at {time.time()}", flush=True)
                    if mode == "sigstop":
                        os.kill(os.getpid(), signal.SIGSTOP)
                    raise UsageError(f"bad data at step {step}")
                assert float(total(x)) == jax.device_count()
                assert procs.gather(step) == [step, step]
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        if mode == "linger":  # slow to end on its own: fail_fast ends it
            time.sleep(60)
        return 2
    print("finished", flush=True)
    return 0


sys.exit(main())
"""


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path, mode: str, failer: int = 1, wait=(0, 1), timeout: float = 90):
    """Both processes' (returncode, stdout, stderr, time it ended), once those in `wait` have
    ended (the others are killed then)."""
    script = tmp_path / "run.py"
    script.write_text(_SCRIPT)
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
               XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=str(Path(__file__).parents[1]))
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(i), port, mode, str(failer)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in (0, 1)]
    try:
        deadline = time.monotonic() + timeout
        ended = [None, None]
        while any(ended[i] is None for i in wait) and time.monotonic() < deadline:
            for i, p in enumerate(procs):
                if ended[i] is None and p.poll() is not None:
                    ended[i] = time.time()
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
    results = []
    for p, t in zip(procs, ended):
        out, err = p.communicate()
        results.append((p.returncode, out, err, t))
    return results


def _stopped_at(out: str) -> float:
    return float(out.split("stopping at ")[1].split()[0])


def test_fail_fast_lets_a_good_run_finish(tmp_path):
    results = _run(tmp_path, "ok")
    for code, out, err, _ in results:
        assert code == 0, err
        assert "finished" in out


@pytest.mark.parametrize("failer", [0, 1])
def test_an_error_on_one_process_stops_both(tmp_path, failer):
    """The failing process prints its error; the other one line naming it; no traceback.
    Process 0 hosts the coordination service: failing or not, it ends last."""
    results = _run(tmp_path, "raise", failer)
    other = 1 - failer
    code, out, err, ended = results[failer]
    assert code == 2, err
    assert err.strip().splitlines()[-1] == "error: bad data at step 3"
    code, _, err_other, ended_other = results[other]
    assert code == 2, err_other
    assert (f"error: process {failer} of 2 stopped with an error (its output says which); "
            f"this process ({other}) stops too") in err_other.splitlines()
    assert err_other.count("stops too") == 1
    for _, _, e, _ in results:
        assert "Traceback" not in e and "Check failure" not in e
    assert max(ended, ended_other) - _stopped_at(out) < 30


def test_the_other_process_ends_while_stuck_in_a_collective(tmp_path):
    """Process 1 fails but stays alive (its collectives' peer still there, as with NCCL):
    process 0, inside a collective that never completes, is ended by its watcher, and
    process 1 by fail_fast EXIT_GRACE_S after its error."""
    results = _run(tmp_path, "linger")
    code, out, err, ended = results[1]
    assert code == 2 and "error: bad data at step 3" in err
    code0, _, err0, ended0 = results[0]
    assert code0 == 2, err0
    assert ("error: process 1 of 2 stopped with an error (its output says which); this process "
            "(0) stops too") in err0.splitlines()
    assert "Traceback" not in err0
    assert max(ended, ended0) - _stopped_at(out) < 30


def test_a_silent_process_stops_the_other(tmp_path):
    """Process 1 freezes (SIGSTOP: as if killed, for a collective that waits for it): process 0
    stops SILENT_S later."""
    results = _run(tmp_path, "sigstop", wait=[0])
    code0, _, err0, ended0 = results[0]
    assert code0 == 2, err0
    assert ("error: process 1 of 2 has not been heard from for 3 s (killed, or stuck); this "
            "process (0) stops too") in err0.splitlines()
    assert ended0 - _stopped_at(results[1][1]) < 30


_ALONE = """
import sys
from blujax import processes
from blujax.cli.settings import USER_ERRORS
index, port = int(sys.argv[1]), sys.argv[2]
processes.start(f"localhost:{port}", 2, index, errors=USER_ERRORS, init_timeout=3)
print("started", flush=True)
"""


def test_a_process_waiting_for_a_missing_one_says_so_then_gives_up(tmp_path):
    """Process 0 of 2 whose peer never starts, and process 1 whose coordinator never comes up:
    each says what it waits for within seconds, then gives up after --init-timeout with one
    line and status 2, no traceback."""
    script = tmp_path / "alone.py"
    script.write_text(_ALONE)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(Path(__file__).parents[1]))
    ports = [str(_free_port()) for _ in range(2)]
    began = time.monotonic()
    procs = [subprocess.Popen([sys.executable, str(script), str(i), ports[i]], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in (0, 1)]
    try:
        results = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert time.monotonic() - began < 30
    for i, (p, (out, err)) in enumerate(zip(procs, results)):
        where = f"process {i} of 2 waiting for the others at localhost:{ports[i]}"
        assert p.returncode == 2, err
        assert "started" not in out and "Traceback" not in err and "Check failure" not in err
        lines = err.strip().splitlines()
        assert lines[0].startswith(f"{where} (2 s of at most 3 s)"), err
        assert lines[-1] == (f"error: process {i} of 2 gave up waiting for the others at "
                             f"localhost:{ports[i]} after 3 s: some have not started (each "
                             f"needs the same coordinator and number of processes, and an id "
                             f"of its own)")
        assert all(line.startswith(where) for line in lines[:-1])


class _FakeStore:
    """The coordination service's key-value store, in this process."""

    def __init__(self):
        self.kv = {}

    def key_value_set(self, key, value, allow_overwrite=False):
        if key in self.kv and not allow_overwrite:
            raise RuntimeError(f"ALREADY_EXISTS: {key}")
        self.kv[key] = value

    def key_value_try_get(self, key):
        if key not in self.kv:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.kv[key]

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


@pytest.fixture
def fake_run(monkeypatch):
    """Process 0 of 2 over a fake store; no watcher at work and nothing ended at exit."""
    from blujax import processes
    from blujax.cli.settings import USER_ERRORS
    store = _FakeStore()
    monkeypatch.setattr(processes, "_client", lambda: store)
    monkeypatch.setattr(processes, "_leaving", [])
    monkeypatch.setattr(processes, "POLL_S", 1e6)
    blocks = []
    yield processes, processes.Processes(0, 2, USER_ERRORS), store, blocks
    for block in blocks:
        block._finished.set()  # the watcher's loop ends


def test_fail_fast_tells_its_own_error_from_an_echo(fake_run):
    from blujax.cli.settings import UsageError
    processes, procs, store, blocks = fake_run

    def fail(error):
        block = procs.fail_fast()
        blocks.append(block)
        with pytest.raises(Exception) as caught:
            with block:
                raise error
        return block, caught.value

    # First to fail: announced, re-raised, the process to end with main()'s status.
    block, e = fail(UsageError("bad data"))
    assert str(e) == "bad data"
    assert store.kv[block.prefix + "first"] == "0" and block._key("failed") in store.kv
    assert block._leaving[0] == 2 and processes._leaving == [block]

    # Process 1 failed first: a collective's error here is only its echo.
    processes._leaving.clear()
    block = procs.fail_fast()
    store.kv[block.prefix + "first"] = "1"
    blocks.append(block)
    with pytest.raises(processes.OtherProcessFailed) as caught:
        with block:
            raise ValueError("Gloo all-reduce failed: connection closed by peer")
    assert str(caught.value) == ("process 1 of 2 stopped with an error (its output says "
                                 "which); this process (0) stops too")
    assert block._leaving[0] == 2

    # ... but one of main()'s one-line errors is this process's own; so is a bug, first.
    processes._leaving.clear()
    block = procs.fail_fast()
    store.kv[block.prefix + "first"] = "1"
    blocks.append(block)
    with pytest.raises(UsageError, match="bad settings"):
        with block:
            raise UsageError("bad settings")
    assert block._leaving[0] == 2
    processes._leaving.clear()
    block, e = fail(KeyError("a bug"))
    assert isinstance(e, KeyError) and block._leaving[0] == 1
    processes._leaving.clear()

    # together()'s word that another process failed is no news to the others.
    block, e = fail(processes.OtherProcessFailed(1, 2, 0))
    assert isinstance(e, processes.OtherProcessFailed) and block._leaving[0] == 2
    assert block.prefix + "first" not in store.kv and block._key("failed") not in store.kv
    processes._leaving.clear()


def test_fail_fast_does_nothing_with_one_process():
    from blujax import processes
    with processes.Processes().fail_fast():
        pass
    with pytest.raises(ZeroDivisionError):
        with processes.Processes().fail_fast():
            1 / 0


def test_start_takes_its_arguments_else_the_environment(monkeypatch):
    """One process needs nothing started; the count, the id and their environment variables
    are checked before jax.distributed is asked (the two-process runs above start it)."""
    from blujax import processes
    for name in (processes.ENV_COORDINATOR, processes.ENV_NUM_PROCESSES,
                 processes.ENV_PROCESS_ID):
        monkeypatch.delenv(name, raising=False)
    procs = processes.start()
    assert (procs.index, procs.count, procs.lead) == (0, 1, True)
    monkeypatch.setenv(processes.ENV_NUM_PROCESSES, "two")
    with pytest.raises(processes.ProcessError, match="^BLUJAX_NUM_PROCESSES=two is not a whole "
                                                     "number$"):
        processes.start()
    assert processes.start(num_processes=1).count == 1  # an argument comes first
    with pytest.raises(processes.ProcessError, match="must be at least 1, got 0"):
        processes.start(num_processes=0)
    monkeypatch.setenv(processes.ENV_NUM_PROCESSES, "1")
    monkeypatch.setenv(processes.ENV_PROCESS_ID, "x")
    assert processes.start().count == 1  # one process: its id is not looked at
    with pytest.raises(processes.ProcessError, match="BLUJAX_PROCESS_ID=x is not a whole"):
        processes.start(num_processes=2)
    with pytest.raises(processes.ProcessError, match=r"must lie in \[0, 2\), got 2"):
        processes.start(num_processes=2, process_id=2)
    for wait in (0, -1, float("inf"), float("nan")):
        with pytest.raises(processes.ProcessError, match="^the time to wait for the other "
                                                         "processes must be a finite number "
                                                         "of seconds above 0, got "):
            processes.start(num_processes=2, process_id=0, init_timeout=wait)
