"""The command line's side of interop and evaluation (issue 37): `--init-from` on train, eval
and sample, `export`, `eval --data/--json` with its fixed definition, and HellaSwag in `eval`
and `train`. The library behind them is tested in test_interop.py, test_evaluate.py and
test_hellaswag.py; the fixture is a small GPT2LMHeadModel that transformers saved, with the
logits it computed (tests/fixtures/hf_gpt2_tiny).
"""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from blujax import data, interop, train
from blujax.checkpoint import Checkpointer
from blujax.model import ops as model_ops
from tests.test_gpt2_cli import (TINY, _assert_usage_error, _run, corpus,  # noqa: F401
                                 private_cache)

pytestmark = pytest.mark.slow  # end to end: outside the fast tier (-m "not slow")

FIXTURE = Path(__file__).parent / "fixtures" / "hf_gpt2_tiny"


def _expected():
    return np.load(FIXTURE / "expected.npz")


def _cross_entropy(logits, targets) -> np.ndarray:
    """Per-token cross-entropy, in float64, of [T, V] logits against [T] targets."""
    z = logits.astype(np.float64)
    z = z - z.max(-1, keepdims=True)
    log_probs = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return -log_probs[np.arange(len(targets)), targets]


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """Token shards the fixture's 1000-token vocabulary can read (GPT-2's text cannot)."""
    folder = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    data.write_shard(folder / "r_val_000000.bin", rng.integers(0, 1000, 2048))
    data.write_shard(folder / "r_train_000001.bin", rng.integers(0, 1000, 20_000))
    return folder


def test_eval_init_from_gives_transformers_loss(tmp_path, capsys):
    """val_loss of the fixture on its first row, by the fixed definition, equals the
    cross-entropy of the logits transformers computed for that row."""
    expected = _expected()
    row = expected["tokens"][0]
    shard = data.write_shard(tmp_path / "row.bin", row)
    out_json = tmp_path / "eval.json"
    for ops in ("ffi", "xla"):
        status, stdout, err = _run(capsys, "eval", "--init-from", FIXTURE, "--data", shard,
                                   "--seq", len(row) - 1, "--batch", 1, "--dtype", "f32",
                                   "--ops", ops, "--json", out_json)
        assert status == 0, err
        result = json.loads(out_json.read_text())
        want = _cross_entropy(expected["logits"][0, :-1], row[1:]).mean()
        # float32 rounding on the CPU; a GPU's float32 matrix products are TF32.
        rel = 1e-6 if jax.default_backend() == "cpu" else 2e-3
        assert result["val_loss"] == pytest.approx(want, rel=rel), ops
        assert result["tokens"] == len(row) - 1 and result["batches"] == 1
        assert result["model"] == str(FIXTURE) and "val loss" in stdout


def test_fine_tuning_from_pretrained_runs_and_resumes(shards, tmp_path, capsys):
    base = ["train", "--init-from", FIXTURE, "--data", shards, "--batch", 4, "--seq", 32,
            "--steps", 4, "--eval-every", 2, "--eval-batches", 1, "--lr", "1e-3",
            "--sample-tokens", 8, "--no-progress"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    status, stdout, err = _run(capsys, *base, "--save-every", 2, "--out", straight)
    assert status == 0, err
    assert f"from {FIXTURE}" in stdout
    assert "no samples: the model has no tokenizer files" in err
    config = json.loads((straight / "config.json").read_text())
    assert config["init_from"]["kind"] == "hf" and config["settings"]["init_from"] == str(FIXTURE)
    assert config["model"]["vocab_size"] == 1000 and config["model"]["n_embd"] == 128

    # Step 0 is the fixture's weights: the first step's loss is theirs on the first batch.
    pre = interop.load_pretrained(FIXTURE)
    with data.DataLoader(shards, "train", batch_size=4, seq_len=32, seed=0) as loader:
        batch = next(loader)
    want = train.loss_fn(jax.device_put(pre.params), batch.inputs, batch.targets,
                         config=pre.config, ops=model_ops.get("ffi"),
                         dtype=train.DTYPES[config["settings"]["dtype"]])
    rel = 1e-6 if jax.default_backend() == "cpu" else 1e-3
    assert _metrics(straight)[0]["loss"] == pytest.approx(float(want), rel=rel)

    status, _, err = _run(capsys, *base, "--stop-after", 2, "--save-every", 2, "--out", resumed)
    assert status == 0, err
    status, stdout, err = _run(capsys, "train", "--resume", "--out", resumed, "--no-progress")
    assert status == 0, err
    assert "resuming after step 2" in stdout
    for key in ("loss", "grad_norm", "val_loss"):
        assert [r.get(key) for r in _metrics(resumed)] == [r.get(key) for r in
                                                           _metrics(straight)], key
    a, b = Checkpointer(straight / "ckpt").restore(), Checkpointer(resumed / "ckpt").restore()
    for name in a.tree:
        np.testing.assert_array_equal(a.tree[name], b.tree[name], err_msg=name)

    # A resumed run keeps its source.
    status, _, err = _run(capsys, "train", "--resume", "--out", resumed, "--init-from",
                          tmp_path / "elsewhere")
    _assert_usage_error(status, err, "--init-from")


def test_init_from_errors(tmp_path, capsys, monkeypatch):
    status, _, err = _run(capsys, "train", "--init-from", FIXTURE, "--model", "tiny",
                          "--out", tmp_path / "a")
    _assert_usage_error(status, err, "--model and --init-from")
    status, _, err = _run(capsys, "sample", "--init-from", FIXTURE)
    _assert_usage_error(status, err, "no tokenizer files (tokenizer.json) and its vocabulary (1000")
    status, _, err = _run(capsys, "eval", "--init-from", tmp_path / "missing")
    _assert_usage_error(status, err, "no such file or folder, and not a hub name")
    status, _, err = _run(capsys, "eval", "--init-from", FIXTURE)
    _assert_usage_error(status, err, "nothing to evaluate: give --data FILE")
    # A hub name with no network: one line that says what to do.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    status, _, err = _run(capsys, "eval", "--init-from", "gpt2", "--hellaswag")
    _assert_usage_error(status, err, "cannot download gpt2 from the Hugging Face hub")


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):  # noqa: F811
    """The tiny preset, three steps on tinyshakespeare, HellaSwag at every validation."""
    from blujax import cli
    folder = tmp_path_factory.mktemp("hellaswag")
    items = folder / "items.jsonl"
    rows = [{"ctx": "To be, or not to be, that is", "label": 0,
             "endings": ["the question.", "a banana split.", "not my cat.", "purple rain."]},
            {"ctx": "The king is dead; long live", "label": 2,
             "endings": ["the soup", "a Tuesday", "the king", "my shoes, again"]},
            {"ctx": "First Citizen: Before we proceed any further,", "label": 1,
             "endings": ["eat lunch.", "hear me speak.", "run away fast.", "sleep."]}]
    items.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = folder / "run"
    assert cli.main([str(a) for a in ["train", "--data", corpus, *TINY, "--steps", 3,
                                      "--eval-every", 3, "--eval-batches", 1,
                                      "--sample-tokens", 0, "--hellaswag", items,
                                      "--out", out]]) == 0
    return out, items


def test_train_scores_hellaswag_at_every_validation(trained, capsys):
    out, items = trained
    last = _metrics(out)[-1]
    assert last["step"] == 3 and last["hellaswag_n"] == 3
    assert {"hellaswag_acc", "hellaswag_acc_norm", "val_loss"} <= set(last)
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    # eval of the run's checkpoint scores the same items the same way.
    status, _, err = _run(capsys, "eval", "--out", out, "--hellaswag", items, "--json",
                          out / "eval.json")
    assert status == 0, err
    result = json.loads((out / "eval.json").read_text())
    for key in ("hellaswag_acc", "hellaswag_acc_norm", "hellaswag_n", "val_loss"):
        assert result[key] == pytest.approx(last[key], rel=1e-6), key


def test_export_round_trips(trained, corpus, tmp_path, capsys):  # noqa: F811
    out, _ = trained
    params = Checkpointer(out / "ckpt").restore()
    status, stdout, err = _run(capsys, "export", "--out", out, "--format", "hf",
                               "--to", tmp_path / "hf")
    assert status == 0 and "step 3 of" in stdout, err
    assert {"config.json", "model.safetensors", "vocab.json", "merges.txt"} <= {
        p.name for p in (tmp_path / "hf").iterdir()}
    hf = interop.load_pretrained(tmp_path / "hf")
    for name in ("wte", "wpe"):
        np.testing.assert_array_equal(hf.params[name], params.tree[f"['params']['{name}']"])
    for fmt, dtype in (("llmc", "float32"), ("llmc", "bfloat16")):
        path = tmp_path / f"model_{dtype}.bin"
        status, _, err = _run(capsys, "export", "--out", out, "--format", fmt, "--to", path,
                              "--dtype", dtype)
        assert status == 0, err
        back = interop.load_pretrained(path)
        wte = params.tree["['params']['wte']"]
        if dtype == "float32":
            np.testing.assert_array_equal(back.params["wte"], wte)
        else:
            np.testing.assert_allclose(back.params["wte"], wte, rtol=2 ** -8)

    # The exported weights evaluate as the run does, on the same tokens.
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    common = ["--data", corpus, "--seq", 32, "--batch", 4, "--eval-batches", 2, "--dtype", "f32"]
    assert _run(capsys, "eval", "--out", out, *common, "--json", a)[0] == 0
    assert _run(capsys, "eval", "--init-from", tmp_path / "hf", *common, "--json", b)[0] == 0
    assert json.loads(a.read_text())["val_loss"] == json.loads(b.read_text())["val_loss"]

    status, _, err = _run(capsys, "export", "--out", out, "--format", "hf", "--to",
                          tmp_path / "x", "--dtype", "bfloat16")
    _assert_usage_error(status, err, "--dtype applies to --format llmc")
