"""The GPT-2 command line: train, evaluate, sample. `examples/gpt2.py` runs `main()`.

    python examples/gpt2.py                                   # train with the defaults
    python examples/gpt2.py train --data notes.txt --model small --steps 500 --out runs/a
    python examples/gpt2.py train --resume --out runs/a       # continue from the latest checkpoint
    python examples/gpt2.py eval --out runs/a                 # validation loss of the latest one
    python examples/gpt2.py sample --out runs/a --prompt "Hello, I'm a"

The program lives here, in the package, rather than in the example script, so that the tests
call `main(argv)` in-process and an installed blujax has it too (`python -m blujax.cli`).

Everything a run writes goes to --out: config.json (model, training and data settings),
metrics.jsonl (one JSON object per step), loss.png (train and validation loss), ckpt/ (the
checkpoints) and samples.txt. A resumed run continues bit for bit where the checkpoint left
off: the checkpoint holds the parameters, optimizer state, step, the data loader's position and
the sampling key, and every setting that changes the numbers must stay as it was.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

# The default corpus: the file nanoGPT and llm.c train their first models on.
CORPUS_NAME = "tinyshakespeare.txt"
CORPUS_URL = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
              "tinyshakespeare/input.txt")
CORPUS_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
# llm.c's split of it: the first 32768 tokens are the validation set.
CORPUS_VAL_TOKENS = 32768

SAMPLE_PROMPT = "Hello, I'm a"
RUN_FILES = ("config.json", "metrics.jsonl", "loss.png", "samples.txt")


class UsageError(Exception):
    """A problem the user can fix (a flag, a file, the environment): main() prints the message
    as one line and returns 2, without a traceback."""


# --------------------------------------------------------------------------------------------
# Settings and their defaults


@dataclasses.dataclass
class TrainSettings:
    """Every setting of a training run. Those in COMPUTE_KEYS decide its numbers, so a resumed
    run must keep them; the others only say what to measure and write, and may change."""

    data: str | None
    model: str
    steps: int
    batch: int
    seq: int
    accum: int
    ops: str
    dtype: str
    seed: int
    lr: float
    min_lr_ratio: float
    warmup: int
    weight_decay: float
    grad_clip: float
    remat: bool
    eval_every: int
    eval_batches: int
    save_every: int
    sample_tokens: int


COMPUTE_KEYS = ("model", "steps", "batch", "seq", "accum", "ops", "dtype", "seed", "lr",
                "min_lr_ratio", "warmup", "weight_decay", "grad_clip", "remat")


def on_accelerator() -> bool:
    import jax
    return jax.default_backend() != "cpu"


def _defaults(accelerator: bool) -> dict:
    """Defaults that depend on where JAX runs: GPT-2 124M in bf16 on a GPU; on a CPU a small
    model that trains for a few minutes."""
    if accelerator:
        base = dict(model="gpt2", steps=200, batch=16, seq=1024, dtype="bf16", lr=6e-4,
                    eval_batches=8)
    else:
        base = dict(model="small", steps=150, batch=8, seq=64, dtype="f32", lr=1e-3,
                    eval_batches=4)
    return dict(base, data=None, accum=1, ops="ffi", seed=0, min_lr_ratio=0.1,
                weight_decay=0.1, grad_clip=1.0, remat=False, save_every=0, sample_tokens=64)


def resolve_train_settings(args, saved: dict | None) -> TrainSettings:
    """The run's settings: the flags given, else (resuming) the saved run's, else defaults.
    Resuming, a flag that would change the numbers must equal the saved value."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainSettings)
             if getattr(args, f.name, None) is not None}
    if saved is not None:
        old = saved["settings"]
        changed = [k for k in COMPUTE_KEYS if k in given and given[k] != old[k]]
        if changed:
            raise UsageError(
                "--resume continues a run with the settings it started with, and these "
                "differ: " + ", ".join(f"--{k.replace('_', '-')} {given[k]} (the run has "
                                       f"{old[k]})" for k in changed))
        values = dict(old, **given)
    else:
        values = dict(_defaults(on_accelerator()), **given)
        if "warmup" not in values:
            values["warmup"] = values["steps"] // 10
        if "eval_every" not in values:
            values["eval_every"] = max(1, values["steps"] // 10)
    values["data"] = _data_spec(values["data"])
    return TrainSettings(**{f.name: values[f.name] for f in dataclasses.fields(TrainSettings)})


# --------------------------------------------------------------------------------------------
# Data: a text file, llm.c shards, or the default corpus


@dataclasses.dataclass
class DataSource:
    description: str        # what --data named, in words
    train: list[Path]
    val: list[Path]         # may be empty: no validation loss then


def user_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(root) / "blujax"


def resolve_data(spec: str | None, *, progress: bool) -> DataSource:
    """The token shards `--data` names: a text file (tokenized once into a cache), a directory
    or glob of llm.c shards (split into train and val by name), one shard file, or, with no
    --data, the default corpus."""
    if spec is None:
        # Its tokens go to the user cache even when BLUJAX_CORPUS names a file elsewhere:
        # that may be a shared, read-only data folder.
        return tokenize_text(default_corpus(progress=progress), paragraph_docs=True,
                             val_tokens=CORPUS_VAL_TOKENS, progress=progress,
                             description=f"the default corpus ({CORPUS_NAME})",
                             cache=user_cache_dir() / f"{CORPUS_NAME}.tokens")
    if any(c in spec for c in "*?[") and not os.path.exists(spec):
        paths = sorted(Path(p) for p in glob.glob(spec))
        if not paths:
            raise UsageError(f"--data {spec}: the pattern matches no files")
        not_shards = [p for p in paths if p.suffix != ".bin"]
        if not_shards:
            raise UsageError(f"--data {spec}: a pattern must name llm.c .bin token shards, but "
                             f"it matches {not_shards[0]}; pass one text file instead")
        return _split_shards(paths, spec)
    path = Path(spec)
    if path.is_dir():
        paths = sorted(path.glob("*.bin"))
        if not paths:
            raise UsageError(f"--data {spec}: the directory holds no .bin token shards")
        return _split_shards(paths, spec)
    if not path.exists():
        raise UsageError(f"--data {spec}: no such file or directory")
    if path.suffix == ".bin":
        twin = path.with_name(path.name.replace("train", "val"))
        val = [twin] if "train" in path.name and twin.is_file() else []
        return _checked(DataSource(f"token shard {path}", [path], val))
    return tokenize_text(path, paragraph_docs=False, val_tokens=None, progress=progress,
                         description=f"text file {path}")


def _split_shards(paths: list[Path], spec: str) -> DataSource:
    """llm.c names its shards `{name}_train_*.bin` and `{name}_val_*.bin`; shards named
    neither way all train, and there is no validation split."""
    train = [p for p in paths if _has_word(p, "train")]
    val = [p for p in paths if _has_word(p, "val")]
    if not train:
        if val:
            raise UsageError(f"--data {spec}: only validation shards ({val[0].name} ...), no "
                             f"shard has 'train' in its name")
        train = paths
    return _checked(DataSource(f"token shards {spec}", train, val))


def _has_word(path: Path, word: str) -> bool:
    return re.search(rf"(^|[_.\-]){word}([_.\-]|$)", path.stem) is not None


def _checked(source: DataSource) -> DataSource:
    """Reads every shard's header now, so a bad file is reported before anything compiles."""
    from blujax import data
    for p in source.train + source.val:
        data.read_header(p)  # ShardError names the file and the problem
    return source


def tokenize_text(path: Path, *, paragraph_docs: bool, val_tokens: int | None, progress: bool,
                  description: str, cache: Path | None = None) -> DataSource:
    """Tokenizes a text file with GPT-2's encoding into shards in `cache`, by default a folder
    next to it (or in the user cache, where that is not writable); a later run finds them
    there and reuses them.

    Without val_tokens the first tenth or so of the tokens (estimated from the file size, at
    most 32768 as llm.c keeps of tinyshakespeare) is the validation split."""
    from blujax import data
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--data {path}: not a file")
    if _is_blank(path):
        raise UsageError(f"--data {path}: the file is empty: there is no text to train on")
    if val_tokens is None:
        val_tokens = max(1, min(CORPUS_VAL_TOKENS, path.stat().st_size // 32))
    cache = _token_cache(path) if cache is None else cache
    small = path.stat().st_size < (64 << 20)  # worker processes only pay off on big files
    try:
        result = data.prepare([path], cache, name=path.name.split(".")[0] or "text",
                              val_tokens=val_tokens, workers=1 if small else None,
                              doc_separator="\n\n" if paragraph_docs else None,
                              progress=progress)
    except RuntimeError as e:  # the tokenizer could not load; the message says what to do
        raise UsageError(str(e)) from None
    train = [f for f in result.files if _has_word(f, "train")]
    val = [f for f in result.files if _has_word(f, "val")]
    if not train:
        raise UsageError(f"--data {path}: only {result.tokens.get('val', 0)} tokens, all of "
                         f"them needed for the validation split; give more text")
    return DataSource(description, train, val)


def _is_blank(path: Path) -> bool:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            if chunk.strip():
                return False
    return True


def _token_cache(path: Path) -> Path:
    beside = path.parent / f"{path.name}.tokens"
    if _writable(beside):
        return beside
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    fallback = user_cache_dir() / "tokens" / f"{path.name}-{digest}"
    if not _writable(fallback):
        raise UsageError(f"cannot write the tokenized copy of {path} beside it ({beside}) or "
                         f"in the user cache ({fallback}); set XDG_CACHE_HOME to a writable "
                         f"folder")
    return fallback


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
        return True
    except OSError:
        return False


def default_corpus(*, progress: bool) -> Path:
    """tinyshakespeare: from the user cache, else the file BLUJAX_CORPUS names, else downloaded
    into the user cache (checked against its known sha256)."""
    cached = user_cache_dir() / CORPUS_NAME
    if cached.is_file():
        return cached
    named = os.environ.get("BLUJAX_CORPUS")
    if named:
        if not Path(named).is_file():
            raise UsageError(f"BLUJAX_CORPUS={named}: no such file (it should name a copy of "
                             f"{CORPUS_NAME})")
        return Path(named)
    try:
        download(CORPUS_URL, cached, sha256=CORPUS_SHA256, progress=progress)
    except (OSError, urllib.error.URLError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise UsageError(
            f"could not download the default corpus from {CORPUS_URL} ({reason}). Offline, "
            f"set BLUJAX_CORPUS to a copy of {CORPUS_NAME} (or pass --data FILE), and "
            f"TIKTOKEN_CACHE_DIR to a folder holding tiktoken's gpt2 files") from None
    return cached


def download(url: str, dest: Path, *, sha256: str | None, progress: bool, timeout=30):
    """Downloads url to dest atomically, with a progress bar; checks the sha256 if given."""
    from tqdm import tqdm
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as f:
            total = int(response.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"downloading {dest.name}",
                      disable=not progress, file=sys.stderr) as bar:
                while chunk := response.read(1 << 16):
                    f.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
        if sha256 is not None and digest.hexdigest() != sha256:
            raise ValueError(f"the download's sha256 is {digest.hexdigest()}, not the "
                             f"expected {sha256}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


# --------------------------------------------------------------------------------------------
# Metrics, the loss plot, the progress display


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_metrics(path: Path, records: list[dict]):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)


def plot_losses(records: list[dict], path: Path, title: str = ""):
    """loss.png: the training loss of every step and the validation loss where measured."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no display

    fig = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if train:
        ax.plot(*zip(*train), lw=1, color="tab:blue", label="train")
    if val:
        ax.plot(*zip(*val), "o-", ms=4, color="tab:orange", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if train or val:
        ax.legend()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp)
    os.replace(tmp, path)


class Progress:
    """A tqdm bar on a terminal; elsewhere (a log file, a test) a line every `every` steps and
    at every validation."""

    def __init__(self, start: int, total: int, enabled: bool, every: int):
        self.tty = enabled and sys.stderr.isatty()
        self.enabled, self.every = enabled, max(1, every)
        self.total = total
        if self.tty:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True,
                            file=sys.stderr)

    def update(self, record: dict, mfu: float | None, tokens_per_s: float | None):
        if not self.enabled:
            return
        parts = {"loss": f"{record['loss']:.4f}"}
        if record.get("val_loss") is not None:
            parts["val"] = f"{record['val_loss']:.4f}"
        parts["tok/s"] = "-" if tokens_per_s is None else f"{tokens_per_s:,.0f}"
        parts["MFU"] = "n/a" if mfu is None else f"{100 * mfu:.1f}%"
        if self.tty:
            self.bar.set_postfix(parts, refresh=False)
            self.bar.update(1)
        elif (record["step"] % self.every == 0 or record.get("val_loss") is not None
              or record["step"] == self.total):
            print(f"step {record['step']}/{self.total} "
                  + " ".join(f"{k} {v}" for k, v in parts.items()), file=sys.stderr, flush=True)

    def write(self, text: str):
        if self.tty:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self):
        if self.tty:
            self.bar.close()


class Throughput:
    """Tokens per second over the last `window` timed steps."""

    def __init__(self, window: int = 20):
        self.times: list[float] = []
        self.window = window

    def add(self, seconds: float):
        self.times = (self.times + [seconds])[-self.window:]

    def tokens_per_s(self, tokens_per_step: int) -> float | None:
        return tokens_per_step * len(self.times) / sum(self.times) if self.times else None


# --------------------------------------------------------------------------------------------
# Runs on disk


def run_config_path(out: Path) -> Path:
    return out / "config.json"


def load_run(out: Path) -> dict:
    path = run_config_path(out)
    if not path.is_file():
        raise UsageError(f"{out} holds no training run (no config.json): train one first with "
                         f"`train --out {out}`")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise UsageError(f"{path} is not valid JSON ({e})") from None


def _write_json(path: Path, obj):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _model_config(name: str):
    from blujax.model import gpt2
    try:
        return gpt2.get_config(name)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _train_config(s: TrainSettings):
    from blujax import train
    return train.TrainConfig(steps=s.steps, learning_rate=s.lr, min_lr_ratio=s.min_lr_ratio,
                             warmup_steps=s.warmup, weight_decay=s.weight_decay,
                             grad_clip=s.grad_clip, accum_steps=s.accum, dtype=s.dtype,
                             remat=s.remat)


class _CheckpointReader:
    """Checkpoints of a run, read without tidying their directory (a Checkpointer tidies what
    an interrupted save left behind, which would break a run writing there right now)."""

    def __init__(self, directory: Path):
        from blujax.checkpoint import Checkpointer

        class Reader(Checkpointer):
            def _recover(self):
                pass

        self.directory = directory
        self._ckpt = Reader(directory, keep=None, async_save=False) if directory.is_dir() \
            else None

    def steps(self) -> list[int]:
        return self._ckpt.steps() if self._ckpt is not None else []

    def restore(self, like):
        return self._ckpt.restore(like=like)


def _checkpoint_like(model_config, train_config, ops):
    """The structure, shapes and dtypes of a checkpoint's tree, without computing it."""
    import jax
    from blujax import train

    def build(key):
        state = train.init_state(model_config, train_config, key, ops=ops)
        return _checkpoint_tree(state, key)

    return jax.eval_shape(build, jax.random.key(0))


def _checkpoint_tree(state, sample_key) -> dict:
    return {"params": state.params, "opt_state": state.opt_state, "step": state.step,
            "sample_key": sample_key}


def _restore(out: Path, run: dict, ops) -> tuple[dict, int]:
    """The latest checkpoint's tree and step."""
    s = TrainSettings(**run["settings"])
    reader = _CheckpointReader(out / "ckpt")
    if not reader.steps():
        raise UsageError(f"{out} holds no checkpoint (nothing in {out / 'ckpt'})")
    like = _checkpoint_like(_model_config(s.model), _train_config(s), ops)
    restored = reader.restore(like)
    return restored.tree, restored.step


# --------------------------------------------------------------------------------------------
# train


class _StopRequest:
    """SIGINT / SIGTERM ask the loop to stop after the step under way and save a checkpoint;
    a second Ctrl-C stops at once."""

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = True
        signal.signal(signal.SIGINT, self._previous.get(signal.SIGINT,
                                                        signal.default_int_handler))
        print(f"\n{signal.Signals(signum).name}: stopping after this step and saving a "
              f"checkpoint (Ctrl-C again to abort)", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def cmd_train(args) -> int:
    import jax

    from blujax import data, train
    from blujax.checkpoint import Checkpointer
    from blujax.model import gpt2
    from blujax.model import ops as model_ops

    out = Path(args.out)
    progress = not args.no_progress
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite contradict each other: pick one")
    saved = load_run(out) if args.resume else None
    s = resolve_train_settings(args, saved)
    model_config = _model_config(s.model)
    _check_settings(s, model_config)
    stop_after = s.steps if args.stop_after is None else args.stop_after
    if not 1 <= stop_after <= s.steps:
        raise UsageError(f"--stop-after {stop_after} must lie in [1, --steps {s.steps}]")

    ckpt_dir = out / "ckpt"
    existing = _CheckpointReader(ckpt_dir).steps()
    if args.resume:
        if not existing:
            raise UsageError(f"--resume: {out} holds no checkpoint to continue from (nothing "
                             f"in {ckpt_dir})")
        if existing[-1] >= stop_after:
            print(f"{out}: the run is already at step {existing[-1]} (of {s.steps}); nothing "
                  f"to train")
            return 0
    elif (existing or run_config_path(out).exists()) and not args.overwrite:
        raise UsageError(f"{out} already holds a run"
                         + (f" (checkpoint of step {existing[-1]})" if existing else "")
                         + ": --resume continues it, --overwrite starts it again, or choose "
                           "another --out")

    source = resolve_data(s.data, progress=progress)
    counts = [data.read_header(p) for p in source.train]
    need = s.batch * s.seq + 1
    if max(counts) < need:
        raise UsageError(
            f"too few tokens for one batch: --batch {s.batch} x --seq {s.seq} needs {need} "
            f"tokens in one shard, and the largest training shard has {max(counts)} "
            f"({source.description}); lower --batch or --seq, or give more text")
    loader = data.DataLoader(source.train, None, batch_size=s.batch, seq_len=s.seq,
                             seed=s.seed)
    fingerprint = loader.state()["shards"]
    if saved is not None and saved["data"]["fingerprint"] != fingerprint:
        loader.close()
        raise UsageError(f"--resume: the training data differs from the run's (other shard "
                         f"files or token counts); the run used {saved['data']['description']}")
    val_batches = _val_batches(source, s.batch, s.seq, s.eval_batches) if s.eval_every else []

    ops = model_ops.get(s.ops)
    train_config = _train_config(s)
    records = []
    if args.resume:
        like = _checkpoint_like(model_config, train_config, ops)
        restored = _CheckpointReader(ckpt_dir).restore(like)
        tree = restored.tree
        state = train.TrainState(tree["step"], tree["params"], tree["opt_state"])
        sample_key = tree["sample_key"]
        try:
            loader.load_state(restored.loader)
        except ValueError as e:
            loader.close()
            raise UsageError(f"--resume: {e}") from None
        # Steps after the checkpoint were lost with the run that made them: they run again.
        records = [r for r in read_metrics(out / "metrics.jsonl") if r["step"] <= restored.step]
    else:
        state = train.init_state(model_config, train_config, jax.random.key(s.seed), ops=ops)
        sample_key = jax.random.fold_in(jax.random.key(s.seed), 1)
        _clear_run(out)

    device = jax.devices()[0]
    run = {
        "settings": dataclasses.asdict(s),
        "model": dict(name=s.model, **dataclasses.asdict(model_config),
                      params=gpt2.num_params(state.params)),
        "train": dataclasses.asdict(train_config),
        "data": {"description": source.description, "spec": s.data,
                 "train": [str(p) for p in source.train], "val": [str(p) for p in source.val],
                 "train_tokens": sum(counts), "fingerprint": fingerprint},
        "device": {"platform": device.platform, "kind": device.device_kind},
        "jax": jax.__version__,
    }
    out.mkdir(parents=True, exist_ok=True)
    _write_json(run_config_path(out), run)
    write_metrics(out / "metrics.jsonl", records)
    print(f"GPT-2 {s.model}: {run['model']['params'] / 1e6:.1f}M parameters, {s.ops} ops, "
          f"{s.dtype}, on {device.device_kind} ({device.platform}); data: "
          f"{source.description}, {sum(counts):,} training tokens; {s.batch} x {s.seq} tokens "
          f"per step" + (f" in {s.accum} micro-batches" if s.accum > 1 else "")
          + (f"; resuming after step {int(state.step)}" if args.resume else "")
          + f"; writing to {out}", flush=True)

    loop = _TrainLoop(s, model_config, train_config, ops, out, records, progress,
                      peak=train.peak_flops(device, s.dtype),
                      flops_per_token=gpt2.flops_per_token(model_config, s.seq))
    with Checkpointer(ckpt_dir, keep=3) as checkpointer, loader:
        state, interrupted = loop.run(state, sample_key, loader, val_batches, checkpointer,
                                      stop_after, args.profile)
    plot_losses(records, out / "loss.png", _title(s, model_config))
    last = int(state.step)
    if last < s.steps:
        print(f"stopped after step {last} of {s.steps}; checkpoint saved in {ckpt_dir}. "
              f"Continue with: train --resume --out {out}", flush=True)
        return EXIT_INTERRUPTED if interrupted else 0
    timed = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
    val = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    print(f"done: step {last}, loss {records[-1]['loss']:.4f}"
          + (f", val loss {val[-1]:.4f}" if val else "")
          + (f", {np.median(timed):,.0f} tokens/s (median)" if timed else "")
          + f"; metrics.jsonl, loss.png, config.json and ckpt/ are in {out}", flush=True)
    if s.sample_tokens:
        n = min(s.sample_tokens, model_config.block_size - len(_encode(SAMPLE_PROMPT)))
        texts = _generate(state.params, model_config, ops, s.dtype, SAMPLE_PROMPT,
                          key=sample_key, max_new_tokens=n, temperature=1.0, top_k=40,
                          num_samples=2)
        (out / "samples.txt").write_text("".join(f"--- sample {i + 1} ---\n{t}\n"
                                                 for i, t in enumerate(texts)))
        for i, t in enumerate(texts):
            print(f"--- sample {i + 1} ---\n{t}")
    return 0


class _TrainLoop:
    """The steps of one process's share of a run: timing, metrics, validation, checkpoints,
    the profile and the progress display around the jitted train step."""

    PROFILE_AFTER, PROFILE_STEPS = 3, 3

    def __init__(self, s: TrainSettings, model_config, train_config, ops, out: Path,
                 records: list, progress: bool, *, peak, flops_per_token):
        from blujax import train
        self.s, self.model_config, self.out, self.records = s, model_config, out, records
        self.progress = progress
        self.peak, self.flops_per_token = peak, flops_per_token
        self.train_step = train.make_train_step(model_config, train_config, ops=ops)
        self.eval_step = train.make_eval_step(model_config, train_config, ops=ops)
        self.tokens_per_step = s.batch * s.seq
        self.throughput = Throughput()

    def run(self, state, sample_key, loader, val_batches, checkpointer, stop_after, profile):
        """Steps from state.step up to stop_after; returns the last state and whether a
        signal stopped it early."""
        import jax
        s = self.s
        start = int(state.step)
        bar = Progress(start, s.steps, self.progress, every=max(1, s.steps // 20))
        self.bar = bar
        trace = range(start + self.PROFILE_AFTER, start + self.PROFILE_AFTER + self.PROFILE_STEPS)
        if profile and trace.stop > stop_after:
            bar.write(f"warning: --profile traces steps {trace.start + 1}-{trace.stop}, but "
                      f"this run ends after step {stop_after}: no trace")
            profile = None
        micro = s.batch // s.accum
        pending = None     # (step, metrics): dispatched, not read back yet
        timed = False      # the first step of a process compiles: it is not timed
        interrupted = False
        try:
            with _StopRequest() as stop:
                t_ref = time.perf_counter()
                for index in range(start, stop_after):
                    step = index + 1
                    batch = next(loader)
                    # np.array copies: the loader reuses its buffers, and on the CPU
                    # device_put may alias a numpy array instead of copying it.
                    inputs = jax.device_put(np.array(batch.inputs).reshape(s.accum, micro, -1))
                    targets = jax.device_put(np.array(batch.targets).reshape(s.accum, micro, -1))
                    if profile and index == trace.start:
                        jax.profiler.start_trace(str(profile))
                    state, metrics = self.train_step(state, inputs, targets)
                    if pending is not None:  # read the previous step while this one runs
                        record, t_ref = self._finish(*pending, t_ref, timed)
                        timed = True
                        self._log(record)
                    pending = (step, metrics)
                    eval_due = bool(val_batches) and (step % s.eval_every == 0
                                                      or step == s.steps)
                    save_due = bool(s.save_every) and step % s.save_every == 0
                    last = step == stop_after or stop.requested
                    trace_end = bool(profile) and step == trace.stop
                    if not (eval_due or save_due or last or trace_end):
                        continue
                    record, _ = self._finish(*pending, t_ref, timed)
                    pending, timed = None, True
                    if trace_end:
                        jax.profiler.stop_trace()
                        bar.write(f"profile of steps {trace.start + 1}-{step} written to "
                                  f"{profile}")
                    if eval_due:
                        record["val_loss"] = self._evaluate(state.params, val_batches)
                    self._log(record)
                    if eval_due:
                        plot_losses(self.records, self.out / "loss.png",
                                    _title(s, self.model_config))
                    if save_due or last:
                        checkpointer.save(step, _checkpoint_tree(state, sample_key),
                                          loader=loader.state(), config=dataclasses.asdict(s))
                    if stop.requested:
                        interrupted = step < stop_after
                        break
                    t_ref = time.perf_counter()  # evaluating and saving are not step time
        finally:
            bar.close()
        return state, interrupted

    def _finish(self, step, metrics, t_ref, timed):
        """Reads back a step's metrics (waiting for the step to end); its record, and the
        time it was read back, which is where the next step's time starts."""
        import jax
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        seconds = now - t_ref
        rate = self.tokens_per_step / seconds if timed else None
        if timed:
            self.throughput.add(seconds)
        record = {"step": step, "loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"],
                  "tokens_per_s": rate, "step_time_s": seconds,
                  "mfu": None if rate is None or self.peak is None
                  else self.flops_per_token * rate / self.peak}
        if not math.isfinite(m["loss"]):
            self.bar.write(f"warning: the loss of step {step} is {m['loss']}")
        return record, now

    def _evaluate(self, params, val_batches) -> float:
        import jax
        losses = [self.eval_step(params, x, y) for x, y in val_batches]
        return float(np.mean(jax.device_get(losses)))

    def _log(self, record):
        self.records.append(record)
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        rate = self.throughput.tokens_per_s(self.tokens_per_step)
        mfu = None if rate is None or self.peak is None else self.flops_per_token * rate / self.peak
        self.bar.update(record, mfu, rate)


def _data_spec(spec: str | None) -> str | None:
    """--data as config.json keeps it: absolute, so eval and sample find it from anywhere."""
    if spec is None or not os.path.exists(spec):
        return spec
    return str(Path(spec).absolute())


def _title(s: TrainSettings, model_config) -> str:
    return (f"GPT-2 {s.model} ({model_config.n_layer} layers, {model_config.n_embd} wide), "
            f"{s.batch}x{s.seq} tokens/step, lr {s.lr:g}")


def _check_settings(s: TrainSettings, model_config):
    for name in ("steps", "batch", "seq", "accum", "eval_batches"):
        if getattr(s, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got "
                             f"{getattr(s, name)}")
    for name in ("warmup", "eval_every", "save_every", "sample_tokens"):
        if getattr(s, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(s, name)}")
    if not s.lr > 0:
        raise UsageError(f"--lr must be positive, got {s.lr}")
    if s.seq > model_config.block_size:
        raise UsageError(f"--seq {s.seq} is longer than the model's block_size "
                         f"({model_config.block_size} for {s.model})")
    if s.batch % s.accum:
        raise UsageError(f"--batch {s.batch} does not split into --accum {s.accum} equal "
                         f"micro-batches")
    try:
        _train_config(s)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _clear_run(out: Path):
    """What an earlier run in `out` wrote, so that a fresh run does not mix with it."""
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / "ckpt", ignore_errors=True)


def _val_batches(source: DataSource, batch: int, seq: int, max_batches: int | None):
    """The first max_batches (all if None) batches of the validation split, in order, on the
    device; fewer rows when the split is too small for a full batch; none without a split."""
    import jax
    from blujax import data
    if not source.val:
        return []
    counts = [data.read_header(p) for p in source.val]
    rows = min(batch, (max(counts) - 1) // seq)
    if rows < 1:
        print(f"warning: the validation split ({max(counts)} tokens) is shorter than one "
              f"sequence of --seq {seq}: no validation loss", file=sys.stderr)
        return []
    batches = []
    with data.DataLoader(source.val, None, batch_size=rows, seq_len=seq,
                         shuffle=False) as loader:
        n = loader.batches_per_epoch
        for _ in range(n if max_batches is None else min(n, max_batches)):
            b = next(loader)
            batches.append((jax.device_put(np.array(b.inputs)),
                            jax.device_put(np.array(b.targets))))
    return batches


# --------------------------------------------------------------------------------------------
# eval and sample


def cmd_eval(args) -> int:
    import jax
    from blujax import train
    from blujax.model import ops as model_ops

    out = Path(args.out)
    run = load_run(out)
    s = TrainSettings(**run["settings"])
    if args.data is not None:
        s.data = args.data
    ops_name = args.ops or s.ops
    ops = model_ops.get(ops_name)
    model_config = _model_config(s.model)
    if args.batch is not None:
        if args.batch < 1:
            raise UsageError(f"--batch must be at least 1, got {args.batch}")
        s.batch = args.batch
    source = resolve_data(s.data, progress=not args.no_progress)
    if not source.val:
        raise UsageError(f"{source.description} has no validation split (shards named "
                         f"*_val_*.bin): nothing to evaluate on")
    n = s.eval_batches if args.eval_batches is None else args.eval_batches
    if n < 0:
        raise UsageError(f"--eval-batches must be >= 0, got {n}")
    batches = _val_batches(source, s.batch, s.seq, n or None)
    if not batches:
        raise UsageError(f"the validation split of {source.description} is too short for one "
                         f"sequence of {s.seq} tokens")
    tree, step = _restore(out, run, ops)
    eval_step = train.make_eval_step(model_config, _train_config(s), ops=ops)
    loss = float(np.mean(jax.device_get([eval_step(tree["params"], x, y) for x, y in batches])))
    tokens = sum(int(x.size) for x, _ in batches)
    print(f"step {step}: val loss {loss:.4f} ({len(batches)} batches, {tokens:,} tokens, "
          f"{ops_name} ops, {s.dtype})")
    return 0


def cmd_sample(args) -> int:
    import jax
    from blujax.model import ops as model_ops

    out = Path(args.out)
    run = load_run(out)
    s = TrainSettings(**run["settings"])
    model_config = _model_config(s.model)
    ops = model_ops.get(args.ops or s.ops)
    if args.num_samples < 1:
        raise UsageError(f"--num-samples must be at least 1, got {args.num_samples}")
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not args.temperature >= 0:
        raise UsageError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0 <= args.top_k <= model_config.vocab_size:
        raise UsageError(f"--top-k must lie in [0, {model_config.vocab_size}], got {args.top_k}")
    top_k = args.top_k or None
    prompt = _encode(args.prompt)
    if not prompt:
        raise UsageError("--prompt is empty: give at least one token of text")
    if len(prompt) + args.max_new_tokens > model_config.block_size:
        raise UsageError(f"the prompt ({len(prompt)} tokens) and --max-new-tokens "
                         f"{args.max_new_tokens} exceed the model's block_size "
                         f"({model_config.block_size})")
    tree, step = _restore(out, run, ops)
    texts = _generate(tree["params"], model_config, ops, s.dtype, args.prompt,
                      key=jax.random.key(args.seed), max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_k=top_k,
                      num_samples=args.num_samples)
    print(f"# step {step} of {out}, seed {args.seed}, temperature {args.temperature}, "
          f"top-k {top_k or 'off'}")
    for i, text in enumerate(texts):
        print(f"--- sample {i + 1} ---\n{text}")
    return 0


def _encode(text: str) -> list[int]:
    from blujax import data
    try:
        return data.get_encoding("gpt2").encode_ordinary(text)
    except RuntimeError as e:
        raise UsageError(str(e)) from None


def _generate(params, model_config, ops, dtype: str, prompt: str, *, key, max_new_tokens,
              temperature, top_k, num_samples) -> list[str]:
    import jax.numpy as jnp
    from blujax import data, sample, train
    enc = data.get_encoding("gpt2")
    ids = enc.encode_ordinary(prompt)
    tokens = sample.generate(params, jnp.asarray([ids] * num_samples, jnp.int32),
                             config=model_config, key=key, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_k=top_k, ops=ops,
                             dtype=train.DTYPES[dtype])
    return [enc.decode([t for t in row if t < enc.n_vocab]) for row in np.asarray(tokens)]


# --------------------------------------------------------------------------------------------
# The parser


def build_parser() -> argparse.ArgumentParser:
    cpu, gpu = _defaults(False), _defaults(True)

    def both(key, fmt="{}"):
        a, b = fmt.format(cpu[key]), fmt.format(gpu[key])
        return a if a == b else f"{a} on a CPU, {b} on a GPU"

    parser = argparse.ArgumentParser(
        prog="gpt2.py",
        description="Train GPT-2 on blujax's kernels, evaluate it, sample from it. With no "
                    "command, `train` runs with its defaults: a small model on tinyshakespeare "
                    "for a few minutes on a CPU, GPT-2 124M in bf16 on a GPU.",
        epilog="Run `gpt2.py COMMAND --help` for each command's flags.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    t = commands.add_parser(
        "train", help="train a model (the default command)",
        description="Train GPT-2. Writes config.json, metrics.jsonl (one JSON object per "
                    "step), loss.png, ckpt/ and samples.txt into --out. Flags left out take "
                    "their defaults, or with --resume the run's own values.")
    t.add_argument("--data", metavar="PATH_OR_GLOB",
                   help="a text file (tokenized with GPT-2's encoding into FILE.tokens/ "
                        "beside it, or the user cache, once), a directory or glob of llm.c "
                        ".bin shards (split into train/val by '_train_'/'_val_' in their "
                        "names), or one .bin shard (default: tinyshakespeare, from the user "
                        "cache, else $BLUJAX_CORPUS, else downloaded)")
    t.add_argument("--model", help=f"model preset: {', '.join(_preset_names())} "
                                   f"(default: {both('model')})")
    t.add_argument("--steps", type=int, help=f"optimizer steps; the learning-rate schedule "
                                             f"spans them (default: {both('steps')})")
    t.add_argument("--batch", type=int,
                   help=f"sequences per optimizer step, over all micro-batches (default: "
                        f"{both('batch')})")
    t.add_argument("--seq", type=int, help=f"tokens per sequence, at most the model's "
                                           f"block_size (default: {both('seq')})")
    t.add_argument("--accum", type=int, help="gradient accumulation: micro-batches per step; "
                                             "must divide --batch (default: 1)")
    t.add_argument("--ops", choices=("ffi", "xla"),
                   help="ffi: blujax's kernels; xla: the same model in plain JAX (default: ffi)")
    t.add_argument("--dtype", choices=("bf16", "f32"),
                   help=f"compute dtype; parameters stay float32 (default: {both('dtype')})")
    t.add_argument("--seed", type=int, help="seed of the initialization, the data order and "
                                            "the samples (default: 0)")
    t.add_argument("--lr", type=float, help=f"peak learning rate (default: {both('lr')})")
    t.add_argument("--min-lr-ratio", type=float,
                   help="the cosine decay ends at lr times this (default: 0.1)")
    t.add_argument("--warmup", type=int,
                   help="linear warmup steps (default: a tenth of --steps)")
    t.add_argument("--weight-decay", type=float,
                   help="AdamW weight decay of matrices and embeddings (default: 0.1)")
    t.add_argument("--grad-clip", type=float,
                   help="clip the gradient's global norm to this (default: 1.0)")
    t.add_argument("--remat", action="store_const", const=True,
                   help="recompute each block's activations in the backward pass: less "
                        "memory, more compute (default: off)")
    t.add_argument("--eval-every", type=int,
                   help="measure the validation loss every this many steps, and at the end; "
                        "0: never (default: a tenth of --steps)")
    t.add_argument("--eval-batches", type=int,
                   help=f"validation batches per measurement, the split's first ones "
                        f"(default: {both('eval_batches')})")
    t.add_argument("--save-every", type=int,
                   help="checkpoint every this many steps; 0: only at the end (default: 0). "
                        "The last 3 are kept")
    t.add_argument("--sample-tokens", type=int,
                   help=f"at the end, sample this many tokens after \"{SAMPLE_PROMPT}\"; 0: "
                        f"no samples (default: 64)")
    t.add_argument("--out", default="out",
                   help="folder for the run's files and checkpoints (default: out)")
    t.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its latest checkpoint, bit for bit as "
                        "if it had not stopped; settings that change the numbers must stay "
                        "the same (default: start a new run)")
    t.add_argument("--overwrite", action="store_true",
                   help="start again in an --out that already holds a run, deleting its "
                        "checkpoints and metrics (default: refuse, and say so)")
    t.add_argument("--stop-after", type=int, metavar="STEP",
                   help="end this run after step STEP (saving a checkpoint) without changing "
                        "the schedule of --steps; continue later with --resume (default: "
                        "run to --steps)")
    t.add_argument("--profile", metavar="DIR",
                   help="write a jax.profiler trace of 3 steps, after 3 warm-up steps, into "
                        "DIR (view with TensorBoard or Perfetto) (default: no trace)")
    t.add_argument("--no-progress", action="store_true",
                   help="no progress bar or progress lines (default: shown)")
    t.set_defaults(func=cmd_train)

    e = commands.add_parser(
        "eval", help="validation loss of the latest checkpoint",
        description="Measure the validation loss of the latest checkpoint in --out on the "
                    "run's data (or --data).")
    e.add_argument("--out", default="out", help="the run's folder (default: out)")
    e.add_argument("--data", metavar="PATH_OR_GLOB",
                   help="evaluate on this data's validation split instead (same forms as "
                        "train --data) (default: the run's data)")
    e.add_argument("--eval-batches", type=int,
                   help="batches to evaluate, from the split's start; 0: all of it (default: "
                        "the run's --eval-batches, so the loss matches its val_loss)")
    e.add_argument("--batch", type=int, help="sequences per batch (default: the run's --batch)")
    e.add_argument("--ops", choices=("ffi", "xla"), help="kernels (default: the run's)")
    e.add_argument("--no-progress", action="store_true",
                   help="no progress bar while tokenizing (default: shown)")
    e.set_defaults(func=cmd_eval)

    p = commands.add_parser(
        "sample", help="generate text from the latest checkpoint",
        description="Generate text from the latest checkpoint in --out; the same --seed "
                    "gives the same text.")
    p.add_argument("--out", default="out", help="the run's folder (default: out)")
    p.add_argument("--prompt", default=SAMPLE_PROMPT,
                   help=f"text to continue (default: \"{SAMPLE_PROMPT}\")")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens to generate after the prompt (default: 64)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature; 0 picks the most likely token (default: 1.0)")
    p.add_argument("--top-k", type=int, default=40,
                   help="sample among the k most likely tokens only; 0: among all "
                        "(default: 40)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--num-samples", type=int, default=1,
                   help="independent samples of the prompt (default: 1)")
    p.add_argument("--ops", choices=("ffi", "xla"), help="kernels (default: the run's)")
    p.set_defaults(func=cmd_sample)
    return parser


def _preset_names() -> list[str]:
    from blujax.model import gpt2
    return list(gpt2.PRESETS)


def main(argv=None) -> int:
    """Runs the command line; returns the exit status (2: a problem the user can fix)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["train", *argv]  # no command: train
    args = build_parser().parse_args(argv)
    from blujax.checkpoint import CheckpointError
    from blujax.data import ShardError
    try:
        return args.func(args)
    except (UsageError, ShardError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
