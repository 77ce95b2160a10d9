"""`examples/gpt2.py` with --model llama-* and qwen2-*: train, resume bit for bit, eval, sample,
export to Hugging Face and back, and the same run on a mesh of emulated devices."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from blujax.checkpoint import Checkpointer
from tests.test_gpt2_cli import _run, corpus, private_cache  # noqa: F401

pytestmark = pytest.mark.slow  # end to end: outside the fast tier (-m "not slow")

SMALL = ["--batch", "4", "--seq", "32", "--lr", "1e-3", "--no-progress", "--sample-tokens", "0"]
# (preset, family, how the run names it, the Hugging Face architecture it exports)
FAMILIES = [("llama-tiny", "llama", "Llama", "LlamaForCausalLM"),
            ("qwen2-tiny", "qwen2", "Qwen2", "Qwen2ForCausalLM")]


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("preset,family,title,arch", FAMILIES, ids=[f[1] for f in FAMILIES])
def test_trains_resumes_evaluates_samples_exports(corpus, tmp_path, capsys,  # noqa: F811
                                                  preset, family, title, arch):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    base = ["train", "--data", corpus, *SMALL, "--model", preset, "--steps", 4,
            "--eval-every", 2]
    status, stdout, err = _run(capsys, *base, "--out", straight)
    assert status == 0, err
    assert f"{title} {preset}:" in stdout
    config = json.loads((straight / "config.json").read_text())
    assert config["model"]["family"] == family and config["model"]["n_kv_head"] == 1

    status, _, err = _run(capsys, *base, "--stop-after", 2, "--out", resumed)
    assert status == 0, err
    status, stdout, err = _run(capsys, "train", "--resume", "--out", resumed, "--no-progress")
    assert status == 0 and "resuming after step 2" in stdout, err
    a, b = _metrics(straight), _metrics(resumed)
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert a[-1]["loss"] < a[0]["loss"]

    status, stdout, err = _run(capsys, "eval", "--out", straight)
    assert status == 0, err
    assert f"val loss {a[-1]['val_loss']:.4f}" in stdout
    status, stdout, err = _run(capsys, "sample", "--out", straight, "--prompt", "ROMEO:",
                               "--max-new-tokens", 8, "--seed", 1)
    assert status == 0 and "--- sample 1 ---" in stdout, err

    hf = tmp_path / "hf"
    status, _, err = _run(capsys, "export", "--out", straight, "--format", "hf", "--to", hf)
    assert status == 0, err
    assert json.loads((hf / "config.json").read_text())["architectures"] == [arch]
    same = ["--data", corpus, "--seq", 32, "--batch", 4, "--eval-batches", 8, "--dtype", "f32"]
    status, stdout, err = _run(capsys, "eval", "--init-from", hf, *same)
    assert status == 0, err
    status, stdout2, err = _run(capsys, "eval", "--out", straight, *same)
    assert status == 0, err
    loss = [line for line in stdout.splitlines() if "val loss" in line]
    loss2 = [line for line in stdout2.splitlines() if "val loss" in line]
    assert loss and loss2 and loss[0].split("val loss")[1] == loss2[0].split("val loss")[1]


def test_llama_on_a_mesh_resumes_on_one_device(corpus, tmp_path, capsys):  # noqa: F811
    """dp 2 x tp 1 x cp 2 (data and context: the tensor splits are tests/test_llama_sharding.py's),
    then one device."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (the emulated CPUs of tests/conftest.py)")
    out = tmp_path / "mesh"
    base = ["train", "--data", corpus, *SMALL, "--model", "llama-tiny", "--steps", 4,
            "--eval-every", 0]
    status, stdout, err = _run(capsys, *base, "--dp", 2, "--cp", 2, "--stop-after", 2,
                               "--out", out)
    assert status == 0, err
    assert Checkpointer(out / "ckpt").steps() == [2]
    status, stdout, err = _run(capsys, "train", "--resume", "--out", out, "--no-progress",
                               "--dp", 1, "--cp", 1)
    assert status == 0 and "done: step 4" in stdout, err
    assert all(np.isfinite(r["loss"]) for r in _metrics(out))
