"""Runs that travel and evaluations that agree (issue 47): --init-from another run's folder
fine-tunes its latest checkpoint; a run resumes on the same text under another name; a run
whose config.json was lost rebuilds it from its checkpoint; eval --data gives one number for
the same weights from a run and from its export; eval's refusals and its --json file."""

import errno
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from blujax import data
from tests.test_gpt2_cli import (TINY, _assert_usage_error, _run, corpus,  # noqa: F401
                                 private_cache)

pytestmark = pytest.mark.slow  # end to end: they train


def _train(capsys, out, corpus, *extra, steps=4):  # noqa: F811
    status, stdout, err = _run(capsys, "train", "--data", corpus, *TINY, "--steps", steps,
                               "--eval-every", 2, "--eval-batches", 2, "--save-every", 2,
                               "--sample-tokens", 0, "--out", out, *extra)
    assert status == 0, err
    return stdout


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):  # noqa: F811
    from blujax import cli
    out = tmp_path_factory.mktemp("runs") / "a"
    assert cli.main(["train", "--data", str(corpus), *map(str, TINY), "--steps", "4",
                     "--eval-every", "2", "--eval-batches", "2", "--save-every", "2",
                     "--sample-tokens", "0", "--out", str(out)]) == 0
    return out


def test_init_from_a_run_folder_fine_tunes_its_latest_checkpoint(capsys, run, corpus,  # noqa
                                                                  tmp_path):
    status, stdout, err = _run(capsys, "eval", "--init-from", run, "--data", corpus, "--seq",
                               32, "--batch", 4, "--eval-batches", 2)
    assert status == 0, err
    same = stdout.split("val loss ")[1].split()[0]
    status, stdout, err = _run(capsys, "eval", "--out", run, "--data", corpus, "--seq", 32,
                               "--batch", 4, "--eval-batches", 2)
    assert status == 0 and stdout.split("val loss ")[1].split()[0] == same, err
    ft = tmp_path / "ft"
    status, stdout, err = _run(capsys, "train", "--init-from", run, "--data", corpus, "--batch",
                               4, "--seq", 32, "--steps", 2, "--sample-tokens", 0,
                               "--no-progress", "--out", ft)
    assert status == 0, err
    config = json.loads((ft / "config.json").read_text())
    assert config["init_from"]["kind"] == "run" and config["init_from"]["step"] == 4
    assert config["model"]["n_layer"] == json.loads((run / "config.json").read_text())[
        "model"]["n_layer"]


def test_the_same_text_under_another_name_resumes(capsys, corpus, tmp_path):  # noqa: F811
    out = tmp_path / "r"
    _train(capsys, out, corpus, "--stop-after", 2)
    renamed = tmp_path / "elsewhere" / "renamed.txt"
    renamed.parent.mkdir()
    shutil.copyfile(corpus, renamed)
    config = json.loads((out / "config.json").read_text())
    config["settings"]["data"] = str(renamed)  # the run as it travelled with its text
    (out / "config.json").write_text(json.dumps(config))
    status, stdout, err = _run(capsys, "train", "--resume", "--out", out, "--no-progress")
    assert status == 0 and "resuming after step 2" in stdout, err
    # Other text is still refused, in one line.
    other = tmp_path / "other.txt"
    other.write_text(corpus.read_text()[::-1])
    config["settings"]["data"] = str(other)
    (out / "config.json").write_text(json.dumps(config))
    status, _, err = _run(capsys, "train", "--resume", "--steps", 6, "--out", out,
                          "--no-progress")
    _assert_usage_error(status, err, "the training data differs from the run's")


def test_a_lost_config_json_is_rebuilt_from_the_checkpoint(capsys, corpus, tmp_path):  # noqa
    out = tmp_path / "lost"
    _train(capsys, out, corpus, "--stop-after", 2)
    before = json.loads((out / "config.json").read_text())
    (out / "config.json").unlink()
    status, stdout, err = _run(capsys, "eval", "--out", out)
    assert status == 0 and "written again from the checkpoint of step 2" in err, err
    assert json.loads((out / "config.json").read_text())["settings"] == before["settings"]
    (out / "config.json").unlink()
    status, stdout, err = _run(capsys, "train", "--resume", "--out", out, "--no-progress")
    assert status == 0 and "resuming after step 2" in stdout, err


def test_a_lost_config_json_of_an_older_checkpoint_says_what_to_do(capsys, run, tmp_path):
    """Checkpoints of an earlier blujax kept the settings alone: no config.json from them."""
    from blujax.checkpoint import Checkpointer
    out = tmp_path / "old"
    restored = Checkpointer(run / "ckpt", read_only=True).restore()
    with Checkpointer(out / "ckpt") as ckpt:
        ckpt.save(restored.step, restored.tree, loader=restored.loader,
                  config=restored.config["settings"])
    status, _, err = _run(capsys, "eval", "--out", out)
    assert status == 2 and "Traceback" not in err, err
    assert "config.json is missing" in err and "--overwrite" in err, err
    assert not (out / "config.json").exists()


def test_eval_data_has_one_default_for_a_run_and_its_export(capsys, run, corpus, tmp_path):
    hf = tmp_path / "hf"
    status, _, err = _run(capsys, "export", "--out", run, "--format", "hf", "--to", hf)
    assert status == 0, err
    same = ["--data", corpus, "--seq", 32, "--batch", 4, "--dtype", "f32"]
    status, a, err = _run(capsys, "eval", "--out", run, *same)
    assert status == 0, err
    status, b, err = _run(capsys, "eval", "--init-from", hf, *same)
    assert status == 0, err
    assert "every batch" in a and "every batch" in b
    assert a.split("val loss ")[1].split()[0] == b.split("val loss ")[1].split()[0]
    status, c, err = _run(capsys, "eval", "--out", run, *same, "--eval-batches", 1)
    assert status == 0 and "(the first batch: 1 batch of 4 x 32, 128 tokens)" in c, err


def test_eval_seq_past_the_context_is_refused(capsys, run):
    for argv in (["--out", run], ["--out", run, "--data", run / "nothing.txt"]):
        status, _, err = _run(capsys, "eval", *argv, "--seq", 4096)
        _assert_usage_error(status, err, "--seq 4096 is longer than the model's context")


def test_eval_json_is_whole_or_absent(capsys, run, tmp_path, monkeypatch):
    target = tmp_path / "result.json"
    real = Path.write_text

    def full(self, *args, **kwargs):
        if self.name == f".{target.name}.tmp":
            real(self, "{", encoding="utf-8")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full)
    status, _, err = _run(capsys, "eval", "--out", run, "--json", target)
    _assert_usage_error(status, err, "No space left on device")
    assert not target.exists() and not list(tmp_path.glob(".*.tmp"))
    monkeypatch.undo()
    link = tmp_path / "link.json"
    link.symlink_to(target)
    status, _, err = _run(capsys, "eval", "--out", run, "--json", link)
    assert status == 0 and link.is_symlink() and json.loads(target.read_text())["val_loss"] > 0


def test_shards_are_known_by_their_tokens(tmp_path):
    tokens = np.arange(5000) % 50257
    a, b = tmp_path / "a_train_000000.bin", tmp_path / "b" / "x_train_000000.bin"
    b.parent.mkdir()
    data.write_shard(a, tokens)
    data.write_shard(b, tokens)
    with data.DataLoader([a], None, batch_size=2, seq_len=8, process_index=0,
                         process_count=1) as la, \
            data.DataLoader([b], None, batch_size=2, seq_len=8, process_index=0,
                            process_count=1) as lb:
        state = la.state()
        assert state["shards"] == lb.state()["shards"]
        lb.load_state(state)
    data.write_shard(b, tokens[::-1])
    with data.DataLoader([b], None, batch_size=2, seq_len=8, process_index=0,
                         process_count=1) as lb:
        assert not lb.same_shards(state["shards"])
        with pytest.raises(ValueError, match="the shards' tokens"):
            lb.load_state(state)
