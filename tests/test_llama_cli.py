"""`examples/gpt2.py` with --model llama-* and qwen2-*: train, resume bit for bit, eval, sample,
export to Hugging Face and back, and the same run on a mesh of emulated devices."""

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from blujax.checkpoint import Checkpointer
from blujax.data.shards import write_shard
from blujax.model import llama
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
    """fsdp 2 x cp 2 (parameters split over "fsdp", sequences over "context"; the tensor
    splits are tests/test_llama_sharding.py's), read by eval, sample and export, then resumed
    on one device: the straight run's losses, to rounding."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (the emulated CPUs of tests/conftest.py)")
    out, one = tmp_path / "mesh", tmp_path / "one"
    base = ["train", "--data", corpus, *SMALL, "--model", "llama-tiny", "--steps", 4,
            "--eval-every", 0, "--dtype", "f32", "--remat", "selective"]
    assert _run(capsys, *base, "--out", one)[0] == 0
    status, stdout, err = _run(capsys, *base, "--fsdp", 2, "--cp", 2, "--stop-after", 2,
                               "--out", out)
    assert status == 0, err
    assert "dp 1 x fsdp 2 x tp 1 x cp 2" in stdout
    settings = json.loads((out / "config.json").read_text())["settings"]
    assert (settings["fsdp"], settings["remat"]) == (2, "selective")
    assert Checkpointer(out / "ckpt").steps() == [2]
    status, stdout, err = _run(capsys, "eval", "--out", out)
    assert status == 0 and "val loss" in stdout, err
    status, stdout, err = _run(capsys, "sample", "--out", out, "--prompt", "ROMEO:",
                               "--max-new-tokens", 4)
    assert status == 0 and "--- sample 1 ---" in stdout, err
    status, _, err = _run(capsys, "export", "--out", out, "--format", "hf", "--to",
                          tmp_path / "hf")
    assert status == 0 and (tmp_path / "hf" / "model.safetensors").exists(), err
    status, stdout, err = _run(capsys, "train", "--resume", "--out", out, "--no-progress",
                               "--fsdp", 1, "--cp", 1)
    assert status == 0 and "done: step 4" in stdout, err
    np.testing.assert_allclose([r["loss"] for r in _metrics(out)],
                               [r["loss"] for r in _metrics(one)], rtol=1e-5)


def test_shards_past_the_tokenizer_are_refused(tmp_path, capsys, monkeypatch):
    """A model wider than its tokenizer (llama-8b's 128256 rows on GPT-2's 50257 tokens) reads
    unlabelled shards only of ids the tokenizer has: an id past them (another tokenizer's
    shards, say llm.c's Llama 3 ones) stops the run before step 1, in one line."""
    wide = dataclasses.replace(llama.PRESETS["llama-tiny"], vocab_size=60000,
                               padded_vocab_size=60032)
    monkeypatch.setitem(llama.PRESETS, "llama-wide", wide)
    tokens = np.arange(8192, dtype=np.uint32) % 1000
    tokens[5000] = 55000  # < the model's 60000, >= GPT-2's 50257
    shard = write_shard(tmp_path / "wide_train_000000.bin", tokens, wide=True)
    status, _, err = _run(capsys, "train", "--data", shard, "--model", "llama-wide", *SMALL,
                          "--steps", 1, "--out", tmp_path / "run")
    assert status == 2 and "55000" in err and "Traceback" not in err, err
