"""The faults of `train` (issue 47): each ends with one line (stderr, exit status 2; 130 for
Ctrl-C), never a traceback, and nothing already trained is lost; a train refused at set-up
leaves no folder it made and no lock; saves are regular by default; settings that train, but
not as meant, get a warning line each.

Runs are the tiny model on 2 x 32 tokens for a few steps. What needs the corpus and the
tokenizer skips without them (BLUJAX_TEST_DATA, TIKTOKEN_CACHE_DIR; see tests/test_gpt2_cli.py).
"""

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from blujax import data, loop, metrics, startup
from blujax import runs as runs_module
from blujax.checkpoint import Checkpointer
from blujax.cli import parser as cli_parser
from blujax.cli import train as train_module
from blujax.cli.settings import resolve_train_settings
from tests.test_gpt2_cli import (_assert_usage_error, _run, corpus,  # noqa: F401
                                 private_cache)

SMALL = ["--model", "tiny", "--batch", 2, "--seq", 32, "--no-progress"]
QUIET = ["--eval-every", 2, "--eval-batches", 1, "--sample-tokens", 0]
FULL = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _records(out: Path) -> list[dict]:
    return metrics.read_metrics(out / "metrics.jsonl")


def _steps(out: Path) -> list[int]:
    return Checkpointer(out / "ckpt", read_only=True).steps()


def _interrupted(status, err, message):
    assert status == 130, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"interrupted: {message}"], err


# Item 3: a full disk, wherever train writes in --out --------------------------------------

class _FullFile:
    """A file whose writes fail as on a full disk."""

    def __init__(self, f):
        self.f = f

    def __getattr__(self, name):
        return getattr(self.f, name)

    def write(self, text):
        raise FULL


@pytest.mark.parametrize("where", ["lock", pytest.param("config", marks=pytest.mark.slow)])
def test_a_full_disk_is_one_line_and_leaves_nothing(where, corpus, tmp_path, capsys,  # noqa: F811
                                                    monkeypatch):
    if where == "lock":
        monkeypatch.setattr(runs_module, "open", lambda *a, **k: _FullFile(open(*a, **k)),
                            raising=False)
    else:
        def write_json(path, obj):
            raise FULL
        monkeypatch.setattr(runs_module, "write_json", write_json)
    out = tmp_path / "new" / "run"
    status, _, err = _run(capsys, "train", "--data", corpus, *SMALL, *QUIET, "--steps", 2,
                          "--out", out)
    _assert_usage_error(status, err, f"cannot write in {out}: No space left on device")
    assert not (tmp_path / "new").exists()


def test_trains_lock_goes_with_it(tmp_path):
    out = tmp_path / "run"
    with runs_module.RunLock(out, remove=True):
        assert "pid " in (out / ".lock").read_text()
        with pytest.raises(runs_module.RunError, match="another training run is using"):
            runs_module.RunLock(out, remove=True).__enter__()
    assert not (out / ".lock").exists()
    stale = runs_module.RunLock(out).__enter__()  # held by an open file, as a killed run's was
    stale._file.close()  # the kernel drops the lock; the file stays
    with runs_module.RunLock(out, remove=True):
        assert (out / ".lock").exists()
    assert list(out.iterdir()) == []


# Item 4: profiling, evaluating, plotting fail: the steps are kept -------------------------

def test_an_unwritable_profile_folder_is_refused_before_step_1(corpus, tmp_path,  # noqa: F811
                                                                capsys):
    (tmp_path / "file").write_text("in the way")
    status, _, err = _run(capsys, "train", "--data", corpus, *SMALL, *QUIET, "--profile",
                          tmp_path / "file" / "trace", "--out", tmp_path / "run")
    _assert_usage_error(status, err, f"cannot write a profile into {tmp_path / 'file'}")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_failed_evaluation_keeps_the_steps(corpus, tmp_path, capsys,  # noqa: F811
                                             monkeypatch):
    def make_eval_step(*args, **kwargs):
        def eval_step(params, x, y):
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory\nmore detail")
        return eval_step

    out = tmp_path / "run"
    argv = ["train", "--data", corpus, *SMALL, *QUIET, "--steps", 4, "--out", out]
    with monkeypatch.context() as m:
        m.setattr(train_module, "make_eval_step", make_eval_step)
        status, _, err = _run(capsys, *argv)
    _assert_usage_error(status, err, "evaluation failed after step 2 (RuntimeError: "
                                     "RESOURCE_EXHAUSTED: out of memory): stopped, with a "
                                     f"checkpoint of step 2 in {out / 'ckpt'}; continue with: "
                                     f"train --resume --out {out}")
    assert _steps(out) == [2] and [r["step"] for r in _records(out)] == [1, 2]
    assert not (out / ".lock").exists()
    status, stdout, err = _run(capsys, "train", "--resume", "--out", out)
    assert status == 0 and "resuming after step 2" in stdout, err
    records = _records(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4] and "val_loss" in records[-1]


@pytest.mark.slow
@pytest.mark.parametrize("what", ["plot", "profile"])
def test_a_failed_plot_or_profile_keeps_the_steps(what, corpus, tmp_path, capsys,  # noqa: F811
                                                  monkeypatch):
    out = tmp_path / "run"
    argv = ["train", "--data", corpus, *SMALL, *QUIET, "--steps", 6, "--out", out]
    if what == "plot":  # at the first evaluation, whose record it draws
        def plot_losses(records, path, title=""):
            raise FULL
        monkeypatch.setattr(metrics, "plot_losses", plot_losses)
        message, step = (f"recording the metrics failed after step 2 (cannot write "
                         f"{out / 'loss.png'}: No space left on device)"), 2
    else:
        def start_trace(*args, **kwargs):
            raise RuntimeError("FAILED_PRECONDITION: the profiler is busy")
        monkeypatch.setattr(jax.profiler, "start_trace", start_trace)
        argv += ["--profile", tmp_path / "trace"]
        message, step = ("profiling failed after step 3 (RuntimeError: FAILED_PRECONDITION: "
                         "the profiler is busy)"), 3
    status, _, err = _run(capsys, *argv)
    _assert_usage_error(status, err, f"{message}: stopped, with a checkpoint of step {step}")
    assert f"continue with: train --resume --out {out}" in err
    assert _steps(out) == [step] and [r["step"] for r in _records(out)] == list(
        range(1, step + 1))


# Item 5: regular saves by default; messages that agree ---------------------------------------

@pytest.mark.parametrize("flags, rule", [
    ([], (15, 10.0)),  # every tenth of the run, or every 10 minutes
    (["--steps", 8], (0, 10.0)),  # under 10 steps: by the clock and at the end
    (["--save-every", 5], (5, 0.0)),  # as it says
    (["--save-every", 0], (0, 0.0)),  # only at the end
    (["--save-minutes", 2], (15, 2.0)),
    (["--save-every", 0, "--save-minutes", 0.5], (0, 0.5)),
])
def test_the_save_rule_is_resolved(flags, rule):
    args = cli_parser.build_parser().parse_args(["train", "--steps", "150", *map(str, flags)])
    s = resolve_train_settings(args, None)
    assert (s.save_every, s.save_minutes) == rule
    # Resuming a run of an earlier version (save_every recorded, save_minutes not): as it was.
    saved = {"settings": {k: v for k, v in vars(s).items() if k != "save_minutes"}}
    resumed = resolve_train_settings(cli_parser.build_parser().parse_args(["train"]), saved)
    assert (resumed.save_every, resumed.save_minutes) == (s.save_every, 0.0)


@pytest.fixture(scope="module")
def by_the_clock(corpus, tmp_path_factory):  # noqa: F811
    """A run stopped after step 3 that saved by the clock alone (after every step)."""
    from blujax import cli
    out = tmp_path_factory.mktemp("clock") / "run"
    assert cli.main([str(a) for a in ["train", "--data", corpus, *SMALL, "--steps", 10,
                                      "--eval-every", 0, "--sample-tokens", 0, "--stop-after",
                                      3, "--save-every", 0, "--save-minutes", "1e-5", "--out",
                                      out]]) == 0
    return out


@pytest.mark.slow
def test_saves_by_the_clock(by_the_clock):
    assert _steps(by_the_clock) == [1, 2, 3]
    settings = json.loads((by_the_clock / "config.json").read_text())["settings"]
    assert (settings["save_every"], settings["save_minutes"]) == (0, 1e-5)
    assert not (by_the_clock / ".lock").exists()


@pytest.mark.slow
def test_a_run_with_no_checkpoint_says_overwrite(by_the_clock, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(by_the_clock, out)
    shutil.rmtree(out / "ckpt")  # as a run killed before its first save
    status, _, err = _run(capsys, "train", "--model", "tiny", "--seq", 32, "--out", out)
    _assert_usage_error(status, err, f"{out} holds a run with no checkpoint (it stopped before "
                                     f"its first save): --overwrite starts it again")
    assert "--resume" not in err
    status, _, err = _run(capsys, "train", "--resume", "--out", out)
    _assert_usage_error(status, err, f"--resume: {out} holds a run with no checkpoint to "
                                     f"continue from (nothing in {out / 'ckpt'}): --overwrite "
                                     f"starts it again")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "loss.png", "metrics.jsonl"]


@pytest.mark.slow
def test_a_killed_run_resumes_from_its_default_saves(corpus, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    # 40 steps: a checkpoint every 4 by default.
    p = subprocess.Popen([sys.executable, "-m", "blujax.cli", "train", "--data", str(corpus),
                          *map(str, SMALL), *map(str, QUIET), "--steps", "40", "--out",
                          str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while not _steps(out) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert p.poll() is None, p.stderr.read()
    finally:
        p.kill()  # SIGKILL: no clean-up of its own
        p.wait()
    saved = _steps(out)[-1]
    assert saved % 4 == 0
    status, _, err = _run(capsys, "train", "--data", corpus, *SMALL, *QUIET, "--out", out)
    _assert_usage_error(status, err, f"already holds a run (checkpoint of step {saved}): "
                                     f"--resume continues it")
    status, stdout, err = _run(capsys, "train", "--resume", "--stop-after", saved + 1,
                               "--out", out)
    assert status == 0 and f"resuming after step {saved}" in stdout, err


# Item 7: Ctrl-C before step 1 -----------------------------------------------------------------

def _ctrl_c(*args, **kwargs):
    raise KeyboardInterrupt  # what Python's SIGINT handler raises


@pytest.mark.parametrize("when", ["set-up", "first compile"])
def test_ctrl_c_before_step_1_leaves_nothing(when, corpus, tmp_path, capsys,  # noqa: F811
                                             monkeypatch):
    if when == "set-up":  # the model's initialization compiles
        monkeypatch.setattr(startup, "initial_state", _ctrl_c)
    else:  # a second Ctrl-C while the step compiles (the first asks for a stop after it)
        monkeypatch.setattr(train_module, "make_train_step", lambda *a, **k: _ctrl_c)
    out = tmp_path / "new" / "run"
    try:
        status, _, err = _run(capsys, "train", "--data", corpus, *SMALL, *QUIET, "--out", out)
    except KeyboardInterrupt:
        pytest.fail("the interrupt escaped")
    _interrupted(status, err, "nothing was trained")
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
def test_ctrl_c_in_a_resumed_run_says_how_to_continue(by_the_clock, tmp_path, capsys,
                                                      monkeypatch):
    out = tmp_path / "run"
    shutil.copytree(by_the_clock, out)
    monkeypatch.setattr(train_module, "make_train_step", lambda *a, **k: _ctrl_c)
    status, _, err = _run(capsys, "train", "--resume", "--out", out)
    _interrupted(status, err, f"its latest checkpoint, of step 3, is in {out / 'ckpt'}: "
                              f"continue with: train --resume --out {out}")
    assert _steps(out) == [1, 2, 3] and len(_records(out)) == 3
    assert not (out / ".lock").exists()


# The child starts with Ctrl-C live, as at a terminal, whatever its parent left it: a process
# started in the background inherits SIGINT ignored, and a library's thread may have blocked it
# (both make the child train on as if nothing came).
_SIGINT_IN_SET_UP = """
import signal, sys
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
signal.signal(signal.SIGINT, signal.default_int_handler)
from blujax import cli, startup
def initial_state(*args, **kwargs):
    signal.raise_signal(signal.SIGINT)  # to this thread: handled before the next line
    return real(*args, **kwargs)
real, startup.initial_state = startup.initial_state, initial_state
sys.exit(cli.main(sys.argv[1:]))
"""


def test_a_real_sigint_in_the_set_up(corpus, tmp_path):  # noqa: F811
    out = tmp_path / "new" / "run"
    p = subprocess.run([sys.executable, "-c", _SIGINT_IN_SET_UP, "train", "--data", str(corpus),
                        *map(str, SMALL), *map(str, QUIET), "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    _interrupted(p.returncode, p.stderr, "nothing was trained")
    assert not (tmp_path / "new").exists()


# Item 10: settings that train, but not as meant ----------------------------------------------

@pytest.mark.slow
def test_silent_misconfigurations_warn(tmp_path, capsys):
    shards = tmp_path / "shards"
    shards.mkdir()  # 100 tokens, no validation shard
    data.write_shard(shards / "s_train_000000.bin", np.random.default_rng(0).integers(0, 50257,
                                                                                     100))
    out = tmp_path / "run"
    status, stdout, err = _run(capsys, "train", "--data", shards, *SMALL, "--steps", 12,
                               "--warmup", 20, "--eval-every", 2, "--sample-tokens", 500,
                               "--stop-after", 1, "--out", out)
    assert status == 0 and "stopped after step 1 of 12" in stdout, err
    lines = err.strip().splitlines()
    assert len(lines) == 4 and all(line.startswith("warning: ") for line in lines), err
    warmup, val, sample, epochs = lines
    assert "--warmup 20 is longer than --steps 12: the learning rate never reaches --lr" in warmup
    assert f"no validation shard in token shards {shards}" in val
    assert "--eval-every 2 measures no validation loss" in val
    assert "--sample-tokens 500 is capped to 123: the model's context (128 tokens) holds the " \
        "prompt's 5 tokens and 123 more" in sample
    assert "reads its 100 training tokens 12 times" in epochs


# Item 12: a refused train leaves nothing; singular for 1 ------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--model", "tiny", "--seq", 32, "--steps", 0], "--steps must be at least 1"),
    (["--model", "tiny", "--seq", 32, "--data", "no/such.txt"], "no/such.txt: no such file"),
    (["--model", "gpt5"], "unknown model 'gpt5'"),
    (["--model", "tiny", "--seq", 32, "--save-minutes", -1], "--save-minutes must be >= 0"),
])
@pytest.mark.parametrize("folder", ["new", "existing"])
def test_a_refused_train_leaves_no_folder_and_no_lock(argv, message, folder, tmp_path, capsys):
    out = tmp_path / "new" / "run" if folder == "new" else tmp_path
    status, _, err = _run(capsys, "train", *argv, "--out", out)
    _assert_usage_error(status, err, message)
    assert [p.name for p in tmp_path.iterdir() if p.name != "xdg-cache"] == []


def test_counts_of_one_are_singular():
    assert loop.plural(1, "token") == "1 token" and loop.plural(2, "token") == "2 tokens"
    assert loop.plural(1, "batch", "batches") == "1 batch"
    assert loop.plural(1_000, "batch", "batches") == "1,000 batches"
    assert "not finite in 1 step in a row" in str(loop.NonFiniteError([5], None))
