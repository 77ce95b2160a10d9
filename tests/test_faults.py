"""The faults a new user meets, through the command line (issue 40): each ends with the right
result or one line and exit status 2, never a traceback, never exit 0 on a broken run, and
nothing already trained is lost.

Runs are the tiny model for a few steps. What needs the corpus and the tokenizer skips without
them (BLUJAX_TEST_DATA, TIKTOKEN_CACHE_DIR; see tests/test_gpt2_cli.py).
"""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from blujax import checkpoint as ckpt_lib
from blujax import data
from blujax.checkpoint import Checkpointer
from blujax.runs import RunLock
from tests.test_gpt2_cli import (TINY, _assert_usage_error, _run, corpus,  # noqa: F401
                                 private_cache)

pytestmark = pytest.mark.slow  # end to end: outside the fast tier (-m "not slow")

STEPS = ["--steps", 4, "--eval-every", 2, "--eval-batches", 1, "--sample-tokens", 0]


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _same_run(a: Path, b: Path):
    """b's losses, validation losses and last checkpoint equal a's, bit for bit."""
    ma, mb = _metrics(a), _metrics(b)
    for key in ("step", "loss", "grad_norm", "lr", "val_loss"):
        assert [r.get(key) for r in mb] == [r.get(key) for r in ma], key
    x, y = Checkpointer(a / "ckpt").restore(), Checkpointer(b / "ckpt").restore()
    assert x.step == y.step and x.loader == y.loader
    for name in x.tree:
        np.testing.assert_array_equal(x.tree[name], y.tree[name], err_msg=name)


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):  # noqa: F811
    """Four steps straight, a checkpoint every step (the last 3 kept)."""
    from blujax import cli
    out = tmp_path_factory.mktemp("faults") / "straight"
    assert cli.main([str(a) for a in ["train", "--data", corpus, *TINY, *STEPS,
                                      "--save-every", 1, "--out", out]]) == 0
    return out


@pytest.fixture(scope="module")
def stopped(corpus, tmp_path_factory):  # noqa: F811
    """The same run stopped after step 3: checkpoints of steps 1-3."""
    from blujax import cli
    out = tmp_path_factory.mktemp("faults") / "stopped"
    assert cli.main([str(a) for a in ["train", "--data", corpus, *TINY, *STEPS,
                                      "--save-every", 1, "--stop-after", 3, "--out", out]]) == 0
    assert Checkpointer(out / "ckpt").steps() == [1, 2, 3]
    return out


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    (to / ".lock").unlink(missing_ok=True)
    return to


def _flip_a_byte(step_dir: Path, array: str):
    """One byte flipped in the first chunk of the array whose key path starts with `array`."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    record = next(r for r in manifest["arrays"] if r["path"].startswith(array))
    chunk = step_dir / record["chunks"][0]["file"]
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    chunk.write_bytes(bytes(raw))


# 1. Numeric flags -----------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--grad-clip", "-1"], "--grad-clip must be >= 0 (0: no clipping), got -1"),
    (["--grad-clip", "inf"], "--grad-clip must be a finite number, got inf"),
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--lr", "0"], "--lr must be > 0, got 0"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0, got -0.1"),
    (["--min-lr-ratio", "1.5"], "--min-lr-ratio must be <= 1, got 1.5"),
    (["--warmup", "-3"], "--warmup must be >= 0, got -3"),
])
def test_numeric_flags_out_of_range_exit_2(argv, message, tmp_path, capsys):
    status, _, err = _run(capsys, "train", "--model", "tiny", "--seq", 32, *argv,
                          "--out", tmp_path / "run")
    _assert_usage_error(status, err, message)
    assert not (tmp_path / "run" / "config.json").exists()


def test_sample_temperature_must_be_finite(straight, capsys):
    status, _, err = _run(capsys, "sample", "--out", straight, "--temperature", "inf")
    _assert_usage_error(status, err, "--temperature must be a finite number, got inf")


def test_grad_clip_0_means_no_clipping(corpus, tmp_path, capsys):  # noqa: F811
    base = ["train", "--data", corpus, *TINY, "--steps", 3, "--eval-every", 0,
            "--sample-tokens", 0, "--lr", "3e-3"]
    status, _, err = _run(capsys, *base, "--grad-clip", 0, "--out", tmp_path / "off")
    assert status == 0, err
    status, _, err = _run(capsys, *base, "--grad-clip", "1e30", "--out", tmp_path / "huge")
    assert status == 0, err
    status, _, err = _run(capsys, *base, "--grad-clip", "0.01", "--out", tmp_path / "tight")
    assert status == 0, err
    off, huge, tight = (_metrics(tmp_path / n) for n in ("off", "huge", "tight"))
    # 0 trains as if there were no limit: the loss falls, exactly as with a limit never met.
    assert [r["loss"] for r in off] == [r["loss"] for r in huge]
    assert off[-1]["loss"] < off[0]["loss"]
    assert [r["loss"] for r in tight][1:] != [r["loss"] for r in off][1:]


# 2. One run per folder ------------------------------------------------------------------------

def test_a_second_run_into_a_busy_folder_exits_2(corpus, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    with RunLock(out):  # as a run in progress holds it
        for extra in ([], ["--overwrite"], ["--resume"]):
            status, _, err = _run(capsys, "train", "--data", corpus, *TINY, *STEPS, *extra,
                                  "--out", out)
            _assert_usage_error(status, err, f"another training run is using {out} (pid ")
    assert sorted(p.name for p in out.iterdir()) == [".lock"]


def test_a_killed_run_leaves_no_stuck_lock(corpus, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import os, sys, time; from blujax.runs import RunLock; "
                               f"l = RunLock({str(out)!r}).__enter__(); print('held', "
                               "flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        status, _, err = _run(capsys, "train", "--data", corpus, *TINY, *STEPS, "--out", out)
        _assert_usage_error(status, err, "another training run is using")
    finally:
        holder.kill()  # SIGKILL: no clean-up of its own
        holder.wait()
    status, _, err = _run(capsys, "train", "--data", corpus, *TINY, *STEPS, "--out", out)
    assert status == 0, err


# 3. An unwritable checkpoint folder -----------------------------------------------------------

def test_unwritable_checkpoint_folder_found_before_step_1(corpus, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    out.mkdir()
    (out / "ckpt").write_text("not a folder")  # unwritable, even for root
    status, _, err = _run(capsys, "train", "--data", corpus, *TINY, *STEPS, "--out", out)
    _assert_usage_error(status, err, str(out / "ckpt"))
    assert not (out / "metrics.jsonl").exists() or not _metrics(out)


def test_a_save_that_fails_later_stops_the_run_promptly(corpus, tmp_path, capsys,  # noqa: F811
                                                         monkeypatch):
    out = tmp_path / "run"
    def full_disk(root, name, index, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt_lib, "_write_chunk", full_disk)
    status, _, err = _run(capsys, "train", "--data", corpus, *TINY, "--steps", 8,
                          "--eval-every", 0, "--sample-tokens", 0, "--save-every", 2,
                          "--out", out)
    _assert_usage_error(status, err, str(out / "ckpt"))
    assert "No space left on device" in err
    # Stopped within a step or two of the failed save, not at the next save or the end; the
    # checkpoint that was written is intact.
    assert _metrics(out)[-1]["step"] <= 4
    assert Checkpointer(out / "ckpt").steps() == []


# 4. A bad token in a later shard --------------------------------------------------------------

def test_a_bad_token_in_a_later_shard_stops_before_step_1(tmp_path, capsys):
    rng = np.random.default_rng(0)
    shards = tmp_path / "shards"
    shards.mkdir()
    data.write_shard(shards / "s_val_000000.bin", rng.integers(0, 50257, 4096))
    good = rng.integers(0, 50257, 20_000)
    for i in (1, 2):
        data.write_shard(shards / f"s_train_{i:06d}.bin", good)
    bad = good.copy()
    bad[12_345] = 50_300
    data.write_shard(shards / "s_train_000003.bin", bad)
    out = tmp_path / "run"
    argv = ["train", "--data", shards, *TINY, *STEPS, "--out", out]
    status, _, err = _run(capsys, *argv)
    _assert_usage_error(status, err, "s_train_000003.bin")
    assert "50300" in err
    # Nothing was started there: once the shard is mended, a new run needs no --overwrite.
    assert not (out / "config.json").exists()
    data.write_shard(shards / "s_train_000003.bin", good)
    status, _, err = _run(capsys, *argv)
    assert status == 0, err


# 5. Text that is not UTF-8 --------------------------------------------------------------------

@pytest.mark.parametrize("command", ["train", "eval"])
def test_text_that_is_not_utf8_exits_2(command, straight, tmp_path, capsys):
    latin1 = tmp_path / "notes.txt"
    latin1.write_bytes("Caf\u00e9 au lait, cr\u00e8me br\u00fbl\u00e9e.\n".encode("latin-1") * 50)
    argv = (["train", "--data", latin1, *TINY, *STEPS, "--out", tmp_path / "run"]
            if command == "train" else ["eval", "--out", straight, "--data", latin1])
    status, _, err = _run(capsys, *argv)
    _assert_usage_error(status, err, str(latin1))
    assert "offset 3" in err  # the first byte that is not UTF-8: the e-acute of "Café"


# 6. A torn last line in metrics.jsonl ---------------------------------------------------------

def test_a_torn_metrics_line_is_dropped_on_resume(stopped, straight, tmp_path, capsys):
    out = _copy(stopped, tmp_path / "run")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 3.1')  # a crash in the middle of a line
    status, _, err = _run(capsys, "train", "--resume", "--out", out)
    assert status == 0, err
    assert "metrics.jsonl: the last line (line 4) is torn" in err
    _same_run(straight, out)


# 7. A corrupt or incomplete latest checkpoint -------------------------------------------------

def test_a_corrupt_latest_checkpoint_falls_back(stopped, straight, tmp_path, capsys):
    out = _copy(stopped, tmp_path / "run")
    _flip_a_byte(out / "ckpt" / "step_00000003", "['params']")
    status, stdout, err = _run(capsys, "train", "--resume", "--out", out)
    assert status == 0, err
    assert "step_00000003" in err and "warning" in err
    assert "resuming after step 2" in stdout
    _same_run(straight, out)


def test_a_deleted_latest_manifest_is_warned_about(stopped, straight, tmp_path, capsys):
    out = _copy(stopped, tmp_path / "run")
    (out / "ckpt" / "step_00000003" / "manifest.json").unlink()
    status, stdout, err = _run(capsys, "train", "--resume", "--out", out)
    assert status == 0, err
    assert "step_00000003" in err and "manifest.json" in err
    assert "resuming after step 2" in stdout
    _same_run(straight, out)


def test_eval_and_sample_verify_the_parameters_only(stopped, tmp_path, capsys):
    out = _copy(stopped, tmp_path / "run")
    _flip_a_byte(out / "ckpt" / "step_00000003", "['opt_state']")
    status, stdout, err = _run(capsys, "eval", "--out", out)
    assert status == 0 and "warning" not in err, err
    assert "step 3 of " in stdout and ": val loss" in stdout
    status, stdout, err = _run(capsys, "sample", "--out", out, "--max-new-tokens", 4)
    assert status == 0 and "# step 3 of" in stdout, err
    _flip_a_byte(out / "ckpt" / "step_00000003", "['params']")
    status, stdout, err = _run(capsys, "eval", "--out", out)
    assert status == 0 and "step 2 of " in stdout, err
    assert "step_00000003" in err and "warning" in err


# 8. The plain-XLA ops namespace ---------------------------------------------------------------

def test_train_eval_sample_with_xla_ops(corpus, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    status, stdout, err = _run(capsys, "train", "--data", corpus, *TINY, "--steps", 2,
                               "--eval-every", 2, "--eval-batches", 1, "--sample-tokens", 4,
                               "--ops", "xla", "--out", out)
    assert status == 0, err
    assert (out / "samples.txt").read_text().count("Hello, I'm a") == 2
    for argv in (["eval", "--out", out], ["sample", "--out", out, "--max-new-tokens", 4],
                 ["sample", "--out", out, "--max-new-tokens", 4, "--ops", "ffi"]):
        status, _, err = _run(capsys, *argv)
        assert status == 0, err


# 9. A loss that turns non-finite --------------------------------------------------------------

def test_non_finite_steps_are_skipped_then_the_run_stops(corpus, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    # A learning rate this large makes the weights overflow after a step or two.
    status, _, err = _run(capsys, "train", "--data", corpus, *TINY, "--steps", 40, "--lr",
                          "1e30", "--warmup", 0, "--eval-every", 0, "--sample-tokens", 0,
                          "--out", out)
    assert status == 2 and "Traceback" not in err
    warning, error = err.strip().splitlines()
    assert warning.startswith(f"warning: step ") and "the step was skipped" in warning
    assert error.startswith("error: the loss or gradient norm was not finite in ")
    records = _metrics(out)
    skipped = [r["step"] for r in records if r["skipped"]]
    # Ten in a row stop the run (the step already under way then is read back too).
    assert 10 <= len(skipped) <= 11
    assert skipped == list(range(skipped[0], skipped[-1] + 1))
    assert f"steps {skipped[0]}-{skipped[-1]}" in error
    assert records[-1]["step"] == skipped[-1] < 40
    # The checkpoint holds the last finite parameters: those of the step before the first
    # skipped one, which every skipped step left as they were.
    saved = Checkpointer(out / "ckpt").restore()
    assert saved.step == skipped[-1]
    params = [v for k, v in saved.tree.items() if k.startswith("['params']")]
    assert all(np.isfinite(p).all() for p in params)


# 10. A small corpus prepared with the defaults -----------------------------------------------

def test_a_small_prepared_corpus_trains(corpus, tmp_path, capsys):  # noqa: F811
    shards = tmp_path / "shards"
    assert data.main(["prepare", str(corpus), "--out", str(shards)]) == 0
    assert list(shards.glob("*_train_*.bin")) and list(shards.glob("*_val_*.bin"))
    status, _, err = _run(capsys, "train", "--data", shards, *TINY, "--steps", 2,
                          "--eval-every", 2, "--eval-batches", 1, "--sample-tokens", 0,
                          "--out", tmp_path / "run")
    assert status == 0, err


# 14. Extending a finished run -----------------------------------------------------------------

def test_a_finished_run_can_be_extended(straight, tmp_path, capsys):
    out = _copy(straight, tmp_path / "run")
    status, stdout, err = _run(capsys, "train", "--resume", "--steps", 6, "--out", out)
    assert status == 0, err
    assert "note: --steps 6 extends the run from 4 steps" in stdout
    assert "now spans 6 steps, so step 5 trains at lr" in stdout
    records = _metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["lr"] for r in records[:4]] == [r["lr"] for r in _metrics(straight)]
    config = json.loads((out / "config.json").read_text())
    assert config["settings"]["steps"] == 6 and config["train"]["steps"] == 6
    assert config["extensions"] == [{"at_step": 4, "steps_before": 4, "steps_after": 6}]
    assert Checkpointer(out / "ckpt").latest_step() == 6

    status, _, err = _run(capsys, "train", "--resume", "--steps", 5, "--out", out)
    _assert_usage_error(status, err, "the run is already at step 6")
