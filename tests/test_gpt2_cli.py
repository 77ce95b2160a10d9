"""examples/gpt2.py (blujax.cli): train, resume, eval, sample, the data it finds, its errors.

Needs, from the environment: BLUJAX_TEST_DATA (a folder with tinyshakespeare.txt, and llm.c's
shards of it in tinyshakespeare_llmc/) and TIKTOKEN_CACHE_DIR (or network access) for the
GPT-2 tokenizer; what needs them skips without them. Nothing is written beside the shared
files: the corpus is copied into the test's folder, and the user cache is a temporary one.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from blujax import cli, loop, train
from blujax.cli import parser as cli_parser
from blujax.checkpoint import Checkpointer
from blujax.data import corpus as data_corpus
from blujax.model import gpt2
from tests.util import rel_close

pytestmark = pytest.mark.slow  # end to end: outside the fast tier (-m "not slow")

# A 2-layer, 64-wide model on 4 x 32 tokens a step: a run of a few steps takes seconds.
TINY = ["--model", "tiny", "--batch", "4", "--seq", "32", "--lr", "1e-3", "--no-progress"]
# The model and a sequence it takes, whatever the defaults of this machine (GPT-2's 1024 on a
# GPU): the error cases below must meet their own error first.
TINY_MODEL = ["--model", "tiny", "--seq", "32"]


def _test_data() -> Path:
    root = os.environ.get("BLUJAX_TEST_DATA")
    if not root:
        pytest.skip("BLUJAX_TEST_DATA is not set (the folder with tinyshakespeare.txt)")
    path = Path(root) / "tinyshakespeare.txt"
    if not path.is_file():
        pytest.skip(f"{path} not found under BLUJAX_TEST_DATA")
    return Path(root)


def _tokenizer():
    from blujax.data import get_encoding
    try:
        return get_encoding("gpt2")
    except RuntimeError as e:
        pytest.skip(f"the GPT-2 tokenizer is unavailable (set TIKTOKEN_CACHE_DIR): {e}")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """The user cache is the test's own; no BLUJAX_CORPUS from the caller leaks in."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.delenv("BLUJAX_CORPUS", raising=False)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The first 100 kB of tinyshakespeare (about 27k tokens) in a folder of the test's own."""
    source = _test_data() / "tinyshakespeare.txt"
    _tokenizer()
    path = tmp_path_factory.mktemp("corpus") / "shakespeare.txt"
    path.write_bytes(source.read_bytes()[:100_000])
    return path


def _run(capsys, *argv):
    """main(argv) in-process: (exit status, stdout, stderr)."""
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """Six steps straight, validation and a checkpoint every three, samples and a profile."""
    out = tmp_path_factory.mktemp("run") / "straight"
    profile = out.parent / "profile"
    status = cli.main(["train", "--data", str(corpus), *TINY, "--steps", "6", "--eval-every",
                       "3", "--save-every", "3", "--sample-tokens", "8", "--profile",
                       str(profile), "--out", str(out)])
    assert status == 0
    return out


def test_train_writes_metrics_plot_config_checkpoints(trained, corpus):
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for r in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s"} <= set(r)
        assert np.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["lr"] > 0
        assert r["step_time_s"] > 0
    # The first step compiles: it is not counted as throughput; the others are.
    assert records[0]["tokens_per_s"] is None
    assert all(r["tokens_per_s"] > 0 for r in records[1:])
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    assert records[-1]["loss"] < records[0]["loss"]
    assert (trained / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    config = json.loads((trained / "config.json").read_text())
    assert config["model"]["name"] == "tiny" and config["model"]["n_layer"] == 2
    assert config["train"]["steps"] == 6 and config["settings"]["batch"] == 4
    assert config["data"]["spec"] == str(corpus.absolute())
    assert config["data"]["train_tokens"] > 20_000

    assert Checkpointer(trained / "ckpt").steps() == [3, 6]
    samples = (trained / "samples.txt").read_text()
    assert samples.count("Hello, I'm a") == 2
    # The tokenized corpus is cached beside the text, for the next run.
    assert sorted(p.name for p in (corpus.parent / "shakespeare.txt.tokens").glob("*.bin")) \
        == ["shakespeare_train_000001.bin", "shakespeare_val_000000.bin"]
    assert list((trained.parent / "profile").rglob("*.xplane.pb"))


def test_resume_is_bit_identical(trained, corpus, tmp_path, capsys):
    """Three steps, a stop, and three more in a new process equal six steps straight: the
    losses, the validation losses and the final checkpoint, bit for bit."""
    out = tmp_path / "resumed"
    base = ["train", "--data", corpus, *TINY, "--steps", 6, "--eval-every", 3,
            "--sample-tokens", 0, "--out", out]
    status, stdout, _ = _run(capsys, *base, "--stop-after", 3)
    assert status == 0 and "train --resume" in stdout
    assert Checkpointer(out / "ckpt").steps() == [3]

    # A resumed run keeps the settings that change its numbers.
    status, _, err = _run(capsys, "train", "--resume", "--out", out, "--lr", "2e-3")
    assert status == 2 and "--lr 0.002 (the run has 0.001)" in err

    # The environment (the user cache, XLA_FLAGS) is this test's.
    resumed = subprocess.run([sys.executable, "-m", "blujax.cli", "train", "--resume", "--out",
                              str(out), "--no-progress"], capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming after step 3" in resumed.stdout

    def metrics(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    straight, resumed = metrics(trained), metrics(out)
    for key in ("step", "loss", "grad_norm", "lr"):
        assert [r[key] for r in resumed] == [r[key] for r in straight], key
    assert [r.get("val_loss") for r in resumed] == [r.get("val_loss") for r in straight]
    a = Checkpointer(trained / "ckpt").restore()
    b = Checkpointer(out / "ckpt").restore()
    assert a.step == b.step == 6 and a.loader == b.loader
    assert a.tree.keys() == b.tree.keys()
    for name in a.tree:
        np.testing.assert_array_equal(a.tree[name], b.tree[name], err_msg=name)

    # Finished: a further --resume has nothing to do.
    status, stdout, _ = _run(capsys, "train", "--resume", "--out", out)
    assert status == 0 and "nothing to train" in stdout


def test_eval_matches_the_runs_validation_loss(trained, capsys):
    status, stdout, _ = _run(capsys, "eval", "--out", trained)
    assert status == 0
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert f"step 6 of {trained}: val loss {records[-1]['val_loss']:.4f}" in stdout


def test_a_checkpoint_in_the_earlier_layout_is_converted(trained, tmp_path, capsys):
    """A run saved before the QKV weight had its [.., 3, C] axis (fused [.., 3C], in the
    params and AdamW's moments): eval reads it with the same loss, --resume goes on from it."""
    old = tmp_path / "old"
    shutil.copytree(trained, old)
    r = Checkpointer(old / "ckpt").restore(loop.checkpoint_tree(
        train.init_state(gpt2.PRESETS["tiny"], train.TrainConfig(steps=1), jax.random.key(0)),
        sample_key=jax.random.key(0)))
    tree = loop.map_params(gpt2.legacy_params, r.tree)
    C = gpt2.PRESETS["tiny"].n_embd
    assert tree["params"]["blocks"]["attn"]["w"].shape == (2, C, 3 * C)
    assert tree["opt_state"][1].mu["blocks"]["attn"]["b"].shape == (2, 3 * C)
    shutil.rmtree(old / "ckpt")
    with Checkpointer(old / "ckpt", async_save=False) as ckpt:
        ckpt.save(r.step, tree, loader=r.loader, config=r.config)
    config = json.loads((old / "config.json").read_text())
    del config["model"]["family"]  # as runs of then wrote it
    (old / "config.json").write_text(json.dumps(config))

    status, stdout, err = _run(capsys, "eval", "--out", old)
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    assert status == 0, err
    assert f"val loss {records[-1]['val_loss']:.4f}" in stdout
    assert "earlier blujax's parameter layout" in err
    status, stdout, err = _run(capsys, "train", "--resume", "--steps", 7, "--out", old)
    assert status == 0, err
    assert "done: step 7" in stdout


def test_sample_is_deterministic_for_a_seed(trained, capsys):
    argv = ["sample", "--out", trained, "--prompt", "ROMEO:", "--max-new-tokens", 12,
            "--num-samples", 2]
    status, first, _ = _run(capsys, *argv, "--seed", 1)
    assert status == 0 and first.count("ROMEO:") == 2
    assert _run(capsys, *argv, "--seed", 1)[1] == first
    assert _run(capsys, *argv, "--seed", 2)[1] != first


def _assert_usage_error(status, err, message):
    assert status == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert message in lines[0], err


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt5"], "unknown model 'gpt5'; the presets are: gpt2,"),
    (["--model", "tiny", "--seq", "129"], "--seq 129 is longer than the model's block_size "
                                          "(128 for tiny)"),
    ([*TINY_MODEL, "--batch", "6", "--accum", "4"], "--batch 6 does not split into "
                                                          "--accum 4 equal micro-batches"),
    ([*TINY_MODEL, "--steps", "0"], "--steps must be at least 1"),
    ([*TINY_MODEL, "--steps", "4", "--stop-after", "5"], "--stop-after 5 must lie in"),
    (["--data", "no/such/corpus.txt", *TINY_MODEL], "no/such/corpus.txt: no such file or "
                                                    "directory"),
    (["--data", "no/such/*.bin", *TINY_MODEL], "the pattern matches no files"),
    ([*TINY_MODEL, "--cp", "0"], "--cp must be at least 1, got 0"),
    ([*TINY_MODEL, "--dp", "3", "--tp", "3", "--cp", "1024"],
     "data 3 x fsdp 1 x tensor 3 x context 1024 = 9216 devices, but JAX has"),
    ([*TINY_MODEL, "--process-id", "1"], "--process-id applies to a run of several processes: "
                                         "give --num-processes too"),
    ([*TINY_MODEL, "--num-processes", "2", "--process-id", "2"],
     "--process-id must lie in [0, --num-processes 2), got 2"),
    ([*TINY_MODEL, "--num-processes", "0"], "--num-processes must be at least 1, got 0"),
])
def test_bad_flags_exit_2_with_one_line(argv, message, tmp_path, capsys):
    status, _, err = _run(capsys, "train", *argv, "--out", tmp_path / "run")
    _assert_usage_error(status, err, message)


needs_8_devices = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (the "
                                     "tests' CPU platform has 8)")


@needs_8_devices
@pytest.mark.parametrize("argv, message", [
    (["--tp", "2"], "n_head (1) must be divisible by the tensor axis (2): each device holds "
                    "whole attention heads (--dp 1, --fsdp 1, --tp 2, --cp 1;"),
    (["--batch", "4", "--dp", "3"], "the batch size (4) must be divisible by data x fsdp (3 x 1 = 3)"),
    (["--batch", "8", "--accum", "2", "--dp", "8"], "the batch size (4) must be divisible by "
                                                    "data x fsdp (8 x 1 = 8): both split the "
                                                    "batch (--dp 8, --fsdp 1, --tp 1, --cp 1; "
                                                    "micro-batches of 4 x --seq 32 tokens"),
    (["--cp", "3"], "the sequence length (32) must be divisible by 2 x context = 6"),
    (["--fsdp", "3", "--batch", "6"], "n_embd (64) must be divisible by the fsdp axis (3)"),
])
def test_meshes_that_do_not_split_exit_2_before_compiling(argv, message, tmp_path, capsys):
    status, _, err = _run(capsys, "train", *TINY_MODEL, *argv, "--out", tmp_path / "run")
    _assert_usage_error(status, err, message)


@needs_8_devices
def test_parallel_run_matches_one_device_and_resumes_on_another_mesh(corpus, tmp_path, capsys,
                                                                     monkeypatch):
    """dp 2 x tp 2 x cp 2 with ZeRO-1 takes the single-device run's steps (f32, to rounding);
    its checkpoint is in the single-device layout, continues on dp 4, and `eval` reads it."""
    # tiny with 2 heads, so that tensor parallelism has heads to split.
    monkeypatch.setitem(gpt2.PRESETS, "tiny2h",
                        gpt2.GPT2Config(n_layer=2, n_head=2, n_embd=64, block_size=128))
    base = ["train", "--data", corpus, *TINY, "--model", "tiny2h", "--steps", 4,
            "--eval-every", 2, "--eval-batches", 1, "--sample-tokens", 0]
    one, par = tmp_path / "one", tmp_path / "par"
    assert _run(capsys, *base, "--out", one)[0] == 0
    status, stdout, _ = _run(capsys, *base, "--dp", 2, "--tp", 2, "--cp", 2, "--zero",
                             "--stop-after", 2, "--out", par)
    assert status == 0 and "8 x cpu (cpu), dp 2 x tp 2 x cp 2, ZeRO-1" in stdout.replace(
        jax.devices()[0].device_kind, "cpu")
    config = json.loads((par / "config.json").read_text())
    assert {k: config["settings"][k] for k in ("dp", "tp", "cp", "zero")} == \
        {"dp": 2, "tp": 2, "cp": 2, "zero": True}
    assert config["device"]["count"] == 8

    # The run's mesh, unless given: dp 4 x tp 2 x cp 2 needs 16 devices.
    status, _, err = _run(capsys, "train", "--resume", "--out", par, "--dp", 4)
    _assert_usage_error(status, err, "data 4 x fsdp 1 x tensor 2 x context 2 = 16 "
                                     "devices, but JAX has 8")
    assert "(--dp 4, --fsdp 1, --tp 2, --cp 2)" in err
    status, stdout, _ = _run(capsys, "train", "--resume", "--out", par, "--dp", 4, "--tp", 1,
                             "--cp", 1, "--no-progress")
    assert status == 0 and "resuming after step 2" in stdout
    assert "continues on dp 4 x tp 1 x cp 1, ZeRO-1" in stdout

    def metrics(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    a, b = metrics(one), metrics(par)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm", "lr"):
        np.testing.assert_allclose([r[key] for r in b], [r[key] for r in a], rtol=1e-5,
                                   err_msg=key)
    np.testing.assert_allclose([b[1]["val_loss"], b[3]["val_loss"]],
                               [a[1]["val_loss"], a[3]["val_loss"]], rtol=1e-5)

    # The checkpoint has the single-device run's tree, shapes and (to rounding) values: the
    # params and AdamW's moments, in the model's layout (QKV [L, C, 3C]).
    x, y = Checkpointer(one / "ckpt").restore(), Checkpointer(par / "ckpt").restore()
    assert x.step == y.step == 4 and x.loader == y.loader
    assert jax.tree.structure(x.tree) == jax.tree.structure(y.tree)
    assert jax.tree.map(np.shape, x.tree) == jax.tree.map(np.shape, y.tree)
    rel_close(_without_key_bias(y.tree), _without_key_bias(x.tree), 1e-3)

    status, stdout, _ = _run(capsys, "eval", "--out", par)
    assert status == 0 and f"step 4 of {par}: val loss {b[3]['val_loss']:.4f}" in stdout


def _without_key_bias(tree):
    """Every attention bias (params and moments) with its key part zeroed: see
    tests.util.without_key_bias."""
    def zero(path, x):
        if "['attn']['b']" in jax.tree_util.keystr(path):
            x = np.array(x)
            x[:, 1] = 0.0  # [L, 3, C]: q, k, v
        return x
    return jax.tree_util.tree_map_with_path(zero, tree)


# The CLI in a process of its own, with test_parallel_run_matches_one_device's tiny2h.
_CLI_WITH_TINY2H = (
    "import sys; from blujax.model import gpt2; "
    "gpt2.PRESETS['tiny2h'] = gpt2.GPT2Config(n_layer=2, n_head=2, n_embd=64, block_size=128); "
    "from blujax.cli import main; sys.exit(main(sys.argv[1:]))")


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


# The CLI's processes below run on the CPU (2 devices each) whatever the machine has: tiny2h's
# head size, 32, has no CUDA kernel, and the runs they are compared with must run there too.
_CPU_ENV = dict(JAX_PLATFORMS="cpu", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
                XLA_FLAGS="--xla_force_host_platform_device_count=2")


def _one_process(argv, timeout=240):
    """The CLI in one CPU process of its own: (returncode, stdout, stderr)."""
    p = subprocess.run([sys.executable, "-c", _CLI_WITH_TINY2H, *map(str, argv)],
                       env=dict(os.environ, **_CPU_ENV), capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def _two_processes(argv_of, timeout=240):
    """The CLI as processes 0 and 1 of one run, each with 2 CPU devices (gloo collectives);
    argv_of(i): process i's arguments. Their (returncode, stdout, stderr)."""
    env = dict(os.environ, **_CPU_ENV)
    address = f"localhost:{_free_port()}"
    procs = [subprocess.Popen(
        [sys.executable, "-c", _CLI_WITH_TINY2H, *map(str, argv_of(i)), "--coordinator",
         address, "--num-processes", "2", "--process-id", str(i)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
        return [(p.returncode, *output) for p, output in zip(procs, outputs)]
    finally:
        for p in procs:
            p.kill()


def test_two_processes_train_as_one_and_resume(corpus, tmp_path):
    """Two processes of 2 CPU devices each train one run with the losses of the same run in one
    process; process 0 alone writes. Its checkpoint (ZeRO-1's moments split over the processes)
    continues on a mesh whose "context" axis spans both, where each process feeds columns of
    every row, and samples. A process that stops with an error stops the other too.

    (No mesh here splits the vocabulary over the processes: on the CPU, gloo's all-gathers of
    arrays as large as the embedding stall for seconds after a reduce-scatter.)"""
    base = ["train", "--data", corpus, *TINY, "--model", "tiny2h", "--steps", 4,
            "--eval-every", 2, "--eval-batches", 1, "--sample-tokens", 0]
    one, run, elsewhere = tmp_path / "one", tmp_path / "run", tmp_path / "process1"
    code, _, err = _one_process([*base, "--out", one])
    assert code == 0, err

    # dp 2 (over the processes) x tp 2 (within each), ZeRO-1. Process 1 gets an --out of its
    # own, which must stay untouched.
    results = _two_processes(lambda i: [*base, "--dp", 2, "--tp", 2, "--zero", "--stop-after",
                                        2, "--out", run if i == 0 else elsewhere])
    for code, _, err in results:
        assert code == 0, err
    assert "4 x cpu (cpu) in 2 processes, dp 2 x tp 2 x cp 1, ZeRO-1" in results[0][1]
    assert "GPT-2" not in results[1][1] and "step" not in results[1][2]
    assert not elsewhere.exists()
    assert Checkpointer(run / "ckpt").steps() == [2]
    assert json.loads((run / "config.json").read_text())["device"]["processes"] == 2

    # Process 1 resuming from a folder without the run: both exit, neither waits for the other.
    results = _two_processes(lambda i: ["train", "--resume", "--out",
                                        run if i == 0 else elsewhere, "--no-progress"])
    assert [code for code, _, _ in results] == [2, 2]
    assert "process 1 of 2 stopped with an error" in results[0][2]
    assert "holds no training run" in results[1][2]

    results = _two_processes(lambda i: ["train", "--resume", "--out", run, "--dp", 1, "--tp", 1,
                                        "--cp", 4, "--sample-tokens", 8, "--no-progress"])
    for code, _, err in results:
        assert code == 0, err
    assert "resuming after step 2" in results[0][1] and "--- sample 2 ---" in results[0][1]
    assert "resuming" not in results[1][1]
    assert (run / "samples.txt").read_text().count("Hello, I'm a") == 2

    def metrics(path):
        return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]

    a, b = metrics(one), metrics(run)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert all(np.isfinite(r["loss"]) for r in b)
    for key in ("loss", "grad_norm", "val_loss"):
        np.testing.assert_allclose([r.get(key, 0.0) for r in b], [r.get(key, 0.0) for r in a],
                                   rtol=1e-4, err_msg=key)
    assert Checkpointer(run / "ckpt").steps() == [2, 4]
    x, y = Checkpointer(one / "ckpt").restore(), Checkpointer(run / "ckpt").restore()
    assert x.step == y.step == 4 and x.loader == y.loader
    rel_close(_without_key_bias(y.tree), _without_key_bias(x.tree), 1e-3)


def test_data_errors(tmp_path, capsys):
    _tokenizer()
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    status, _, err = _run(capsys, "train", "--data", empty, *TINY, "--out", tmp_path / "a")
    _assert_usage_error(status, err, f"{empty}: the file is empty")

    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be, that is the question. " * 8)  # ~90 tokens
    status, _, err = _run(capsys, "train", "--data", short, *TINY, "--out", tmp_path / "b")
    _assert_usage_error(status, err, "too few tokens for one batch: --batch 4 x --seq 32 needs "
                                     "129 tokens in one shard")


def test_run_folder_errors(trained, tmp_path, capsys):
    status, _, err = _run(capsys, "train", *TINY_MODEL, "--out", trained)
    _assert_usage_error(status, err, "already holds a run (checkpoint of step 6): --resume")
    for command in ("eval", "sample"):
        status, _, err = _run(capsys, command, "--out", tmp_path / "nothing")
        _assert_usage_error(status, err, "holds no training run (no config.json)")
    status, _, err = _run(capsys, "train", "--resume", "--out", tmp_path / "nothing")
    _assert_usage_error(status, err, "holds no training run")
    status, _, err = _run(capsys, "sample", "--out", trained, "--max-new-tokens", 200)
    _assert_usage_error(status, err, "exceed the model's block_size (128)")


def test_offline_without_the_corpus_says_what_to_do(tmp_path, monkeypatch, capsys):
    # Refused at once.
    monkeypatch.setattr(data_corpus, "CORPUS_URL", "http://127.0.0.1:9/input.txt")
    status, _, err = _run(capsys, "train", *TINY_MODEL, "--out", tmp_path / "run")
    _assert_usage_error(status, err, "could not download the default corpus")
    assert "set BLUJAX_CORPUS" in err and "--data FILE" in err and "TIKTOKEN_CACHE_DIR" in err
    monkeypatch.setenv("BLUJAX_CORPUS", str(tmp_path / "missing.txt"))
    status, _, err = _run(capsys, "train", *TINY_MODEL, "--out", tmp_path / "run")
    _assert_usage_error(status, err, "BLUJAX_CORPUS=")


def _flags(parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    return [(a.option_strings[-1], a.help or "") for a in parser._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


def test_help_explains_every_flag(capsys):
    parser = cli_parser.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    wanted = {
        "train": ["--data", "--model", "--steps", "--batch", "--seq", "--ops", "--dtype",
                  "--seed", "--out", "--lr", "--warmup", "--accum", "--eval-every",
                  "--eval-batches", "--save-every", "--resume", "--remat", "--profile",
                  "--sample-tokens", "--dp", "--tp", "--cp", "--no-zero", "--num-processes",
                  "--process-id", "--coordinator", "--init-from", "--hellaswag"],
        "eval": ["--out", "--data", "--init-from", "--seq", "--batch", "--eval-batches",
                 "--dtype", "--json", "--hellaswag"],
        "sample": ["--out", "--prompt", "--max-new-tokens", "--temperature", "--top-k",
                   "--seed", "--num-samples", "--init-from"],
        "export": ["--out", "--format", "--to", "--dtype"],
    }
    for name, sub in commands.choices.items():
        with pytest.raises(SystemExit) as exit_:
            cli.main([name, "--help"])
        assert exit_.value.code == 0
        text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
        flags = _flags(sub)
        assert set(wanted[name]) <= {f for f, _ in flags}
        for flag, help_text in flags:
            assert flag in text
            # Every flag says what it does and what it is when not given (or that it must be).
            assert len(help_text) > 15, flag
            assert "default" in help_text or "required" in help_text, flag
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    top = capsys.readouterr().out
    assert all(name in top for name in ("train", "eval", "sample", "export"))


def test_a_signal_asks_for_a_stop_after_the_step():
    import signal
    before = signal.getsignal(signal.SIGTERM)
    with loop.StopRequest() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)  # handled in this (the main) thread
        assert stop.requested
    assert signal.getsignal(signal.SIGTERM) is before
