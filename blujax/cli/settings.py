"""A training run's settings: what they are, their defaults, and the checks on them.

Also UsageError, the error of every problem with the flags that the user can fix, and
USER_ERRORS, every error main() says in one line (exit status 2).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import jax

from blujax import model, processes
from blujax.interop import InteropError
from blujax.loop import TrainingError
from blujax.metrics import MetricsError
from blujax.sharding.mesh import CONTEXT, DATA, TENSOR, check_batch
from blujax.train import TrainConfig

# What the samples at the end of training, and `sample` by default, continue.
SAMPLE_PROMPT = "Hello, I'm a"


class UsageError(Exception):
    """A problem the user can fix (a flag, a file, the environment): main() prints the message
    as one line and returns 2, without a traceback."""


# The errors of the user's own making, the command line's and the library's (bad data, a
# checkpoint, several processes, weights to import): main() prints them in one line and
# returns 2, and with several processes each is a process's own (Processes.fail_fast).
USER_ERRORS = (UsageError, *processes.ERRORS, TrainingError, MetricsError, InteropError)


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
    # The device mesh (blujax.sharding). Defaults here, for the config.json of runs from before
    # these settings.
    dp: int = 1
    tp: int = 1
    cp: int = 1
    zero: bool = False
    # The pretrained weights the run started from (blujax.interop.load_pretrained's SRC);
    # None: a new model of the preset `model`.
    init_from: str | None = None
    # HellaSwag at every validation: the items' file ("": the official set, downloaded).
    hellaswag: str | None = None

    @property
    def n_devices(self) -> int:
        return self.dp * self.tp * self.cp


COMPUTE_KEYS = ("model", "steps", "batch", "seq", "accum", "ops", "dtype", "seed", "lr",
                "min_lr_ratio", "warmup", "weight_decay", "grad_clip", "remat", "init_from")
# How the run is spread over devices: the same numbers up to rounding, so a resumed run keeps
# the run's values unless given, and may change them (then not bit for bit).
PARALLEL_KEYS = ("dp", "tp", "cp", "zero")
# Settings that runs of earlier versions lack (config.json): they take their defaults there.
ADDED_KEYS = (*PARALLEL_KEYS, "init_from", "hellaswag")


def on_accelerator() -> bool:
    return jax.default_backend() != "cpu"


def defaults(accelerator: bool) -> dict:
    """Defaults that depend on where JAX runs: GPT-2 124M in bf16 on a GPU; on a CPU a small
    model that trains for a few minutes. (warmup and eval_every follow --steps: see
    resolve_train_settings.)"""
    if accelerator:
        base = dict(model="gpt2", steps=200, batch=16, seq=1024, dtype="bf16", lr=6e-4,
                    eval_batches=8)
    else:
        base = dict(model="small", steps=150, batch=8, seq=64, dtype="f32", lr=1e-3,
                    eval_batches=4)
    return dict(base, data=None, accum=1, ops="ffi", seed=0, min_lr_ratio=0.1,
                weight_decay=0.1, grad_clip=1.0, remat=False, save_every=0, sample_tokens=64,
                dp=1, tp=1, cp=1, zero=False, init_from=None, hellaswag=None)


def resolve_train_settings(args, saved: dict | None) -> TrainSettings:
    """The run's settings: the flags given, else (resuming) the saved run's, else defaults.
    Resuming, a flag that would change the numbers must equal the saved value."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainSettings)
             if getattr(args, f.name, None) is not None}
    if saved is not None:
        old = saved["settings"]
        # --steps may change: it extends (or shortens) the run, whose learning-rate schedule
        # then spans the new count (cmd_train says so and records it).
        # Settings added since a run began take their defaults there.
        old = dict({k: defaults(False)[k] for k in ADDED_KEYS}, **old)
        changed = [k for k in COMPUTE_KEYS if k in given and given[k] != old[k]
                   and k != "steps"]
        if changed:
            raise UsageError(
                "--resume continues a run with the settings it started with, and these "
                "differ: " + ", ".join(f"--{k.replace('_', '-')} {given[k]} (the run has "
                                       f"{old[k]})" for k in changed))
        values = dict(old)
        values.update(given)
    else:
        if "init_from" in given and "model" in given:
            raise UsageError("--model and --init-from: the model's shape comes from the weights "
                             "--init-from names; drop --model")
        values = dict(defaults(on_accelerator()), **given)
        if "warmup" not in values:
            values["warmup"] = values["steps"] // 10
        if "eval_every" not in values:
            values["eval_every"] = max(1, values["steps"] // 10)
    values["data"] = _data_spec(values["data"])
    return TrainSettings(**{f.name: values[f.name] for f in dataclasses.fields(TrainSettings)})


def _data_spec(spec: str | None) -> str | None:
    """--data as config.json keeps it: absolute, so eval and sample find it from anywhere."""
    if spec is None or not os.path.exists(spec):
        return spec
    return str(Path(spec).absolute())


def check_settings(s: TrainSettings, model_config):
    """Refuses settings that cannot train, before anything is read or compiled."""
    for name in ("steps", "batch", "seq", "accum", "eval_batches"):
        if getattr(s, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got "
                             f"{getattr(s, name)}")
    for name in ("warmup", "eval_every", "save_every", "sample_tokens"):
        if getattr(s, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(s, name)}")
    check_number("--lr", s.lr, low=0, low_open=True)
    check_number("--min-lr-ratio", s.min_lr_ratio, low=0, high=1)
    check_number("--weight-decay", s.weight_decay, low=0)
    check_number("--grad-clip", s.grad_clip, low=0, why=" (0: no clipping)")
    if s.seq > model_config.block_size:
        raise UsageError(f"--seq {s.seq} is longer than the model's block_size "
                         f"({model_config.block_size} for {s.model})")
    if s.batch % s.accum:
        raise UsageError(f"--batch {s.batch} does not split into --accum {s.accum} equal "
                         f"micro-batches")
    try:
        training_config(s)
    except ValueError as e:
        raise UsageError(str(e)) from None
    check_parallel(s, model_config)


def check_number(flag: str, value: float, *, low: float | None = None, high: float | None = None,
                 low_open: bool = False, why: str = ""):
    """A float flag must be finite (argparse takes "inf" and "nan") and within its bounds."""
    if not math.isfinite(value):
        raise UsageError(f"{flag} must be a finite number, got {value}")
    if low is not None and (value <= low if low_open else value < low):
        raise UsageError(f"{flag} must be {'>' if low_open else '>='} {low:g}{why}, got "
                         f"{value:g}")
    if high is not None and value > high:
        raise UsageError(f"{flag} must be <= {high:g}, got {value:g}")


def check_parallel(s: TrainSettings, model_config):
    """The mesh fits the devices, the model and the batches (blujax.sharding's checks), before
    anything is compiled."""
    for name in ("dp", "tp", "cp"):
        if getattr(s, name) < 1:
            raise UsageError(f"--{name} must be at least 1, got {getattr(s, name)}")
    n, have = s.n_devices, len(jax.devices())
    if jax.process_count() > 1 and n != have:
        # Every process's devices take part: a mesh on some of them would leave a process
        # with nothing to compute.
        raise UsageError(f"--dp {s.dp} x --tp {s.tp} x --cp {s.cp} = {n} devices, but the "
                         f"{jax.process_count()} processes have {have} "
                         f"({jax.default_backend()}) together; with several processes the "
                         f"product must equal that count (the mesh spans all of them)")
    if n > have:
        raise UsageError(f"--dp {s.dp} x --tp {s.tp} x --cp {s.cp} = {n} devices, but JAX has "
                         f"{have} ({jax.default_backend()}); the product must be at most the "
                         f"device count (the run uses the first dp x tp x cp devices)")
    if n == 1:
        return
    sizes = {DATA: s.dp, TENSOR: s.tp, CONTEXT: s.cp}
    micro = s.batch // s.accum
    try:
        model.family_of(model_config).check_mesh(model_config, sizes)
        check_batch((micro, s.seq), sizes, model_config)
    except ValueError as e:
        raise UsageError(f"{str(e).removeprefix('blujax.sharding: ')} (--dp {s.dp}, --tp "
                         f"{s.tp}, --cp {s.cp}; micro-batches of {micro} x --seq {s.seq} "
                         f"tokens, {s.model} has {model_config.n_head} heads)") from None


def parallel_devices(s: TrainSettings) -> list:
    """The devices a run uses: the first dp x tp x cp of jax.devices() (all of them, with
    several processes: check_parallel)."""
    return jax.devices()[:s.n_devices]


def check_process_flags(args):
    """--num-processes, --process-id and --coordinator fit together (blujax.processes.start
    checks what it takes from the environment)."""
    count = args.num_processes
    if count is not None and count < 1:
        raise UsageError(f"--num-processes must be at least 1, got {count}")
    several = (count > 1 if count is not None
               else bool(os.environ.get(processes.ENV_NUM_PROCESSES)))
    given = [f for f, v in (("--coordinator", args.coordinator),
                            ("--process-id", args.process_id)) if v is not None]
    if given and not several:
        raise UsageError(f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} to "
                         f"a run of several processes: give --num-processes too")
    if count and args.process_id is not None and not 0 <= args.process_id < count:
        raise UsageError(f"--process-id must lie in [0, --num-processes {count}), got "
                         f"{args.process_id}")


def model_preset(name: str):
    """The preset `name`; an unknown name is a UsageError that lists the presets."""
    try:
        return model.get_config(name)
    except ValueError as e:
        raise UsageError(str(e)) from None


def run_model_config(run: dict):
    """The model of a run, from its config.json: the shape it records (a run started from
    pretrained weights has no preset), else its preset's."""
    try:
        return model.config_from_dict(run.get("model", {}))
    except ValueError:
        return model_preset(run["settings"]["model"])


def training_config(s: TrainSettings) -> TrainConfig:
    return TrainConfig(steps=s.steps, learning_rate=s.lr, min_lr_ratio=s.min_lr_ratio,
                       warmup_steps=s.warmup, weight_decay=s.weight_decay,
                       grad_clip=s.grad_clip, accum_steps=s.accum, dtype=s.dtype,
                       remat=s.remat)
