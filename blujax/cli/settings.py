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
from blujax.sharding.mesh import CONTEXT, DATA, TENSOR, check_batch, mesh_devices
from blujax.train import TrainConfig

# What the samples at the end of training, and `sample` by default, continue.
SAMPLE_PROMPT = "Hello, I'm a"


class UsageError(Exception):
    """A problem the user can fix (a flag, a file, the environment): main() prints the message
    as one line and returns 2, without a traceback."""


# The errors of the user's own making, the command line's and the library's: main() prints
# them in one line and returns 2 (with several processes: Processes.fail_fast's `errors`).
USER_ERRORS = (UsageError, *processes.ERRORS, TrainingError, MetricsError, InteropError)


@dataclasses.dataclass
class TrainSettings:
    """Every setting of a training run, with its default on a CPU (a small model that trains
    for a few minutes; ACCELERATOR_DEFAULTS on a GPU). Those in COMPUTE_KEYS decide its
    numbers, so a resumed run must keep them; the others only say what to measure and write,
    and may change. warmup and eval_every follow steps (resolve_train_settings)."""

    data: str | None = None
    model: str = "small"
    steps: int = 150
    batch: int = 8
    seq: int = 64
    accum: int = 1
    ops: str = "ffi"
    dtype: str = "f32"
    seed: int = 0
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int | None = None
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    remat: bool = False
    eval_every: int | None = None
    eval_batches: int = 4
    save_every: int = 0
    sample_tokens: int = 64
    dp: int = 1  # the device mesh (blujax.sharding)
    tp: int = 1
    cp: int = 1
    zero: bool = False
    init_from: str | None = None  # pretrained weights to start from (None: a new `model`)
    # HellaSwag at every validation: the items' file ("": the official set, downloaded).
    hellaswag: str | None = None

    @property
    def n_devices(self) -> int:
        return self.dp * self.tp * self.cp


# GPT-2 124M in bf16.
ACCELERATOR_DEFAULTS = dict(model="gpt2", steps=200, batch=16, seq=1024, dtype="bf16",
                            lr=6e-4, eval_batches=8)
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
    """The settings' defaults where JAX runs on an accelerator, or not."""
    cpu = {f.name: f.default for f in dataclasses.fields(TrainSettings)}
    return dict(cpu, **ACCELERATOR_DEFAULTS) if accelerator else cpu


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
        if values["warmup"] is None:
            values["warmup"] = values["steps"] // 10
        if values["eval_every"] is None:
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
    def flags(*names):
        return {f"--{name.replace('_', '-')}": getattr(s, name) for name in names}

    check_counts(flags("steps", "batch", "seq", "accum", "eval_batches", "dp", "tp", "cp"), 1)
    check_counts(flags("warmup", "eval_every", "save_every", "sample_tokens"), 0)
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


def check_counts(flags: dict, least: int):
    """Every count flag given ({flag: value or None}) is at least `least` (0 or 1)."""
    for flag, value in flags.items():
        if value is not None and value < least:
            raise UsageError(f"{flag} must be {'at least 1' if least else '>= 0'}, got {value}")


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
    flags, micro = f"--dp {s.dp}, --tp {s.tp}, --cp {s.cp}", s.batch // s.accum
    try:
        mesh_devices(s.dp, s.tp, s.cp)
        if s.n_devices > 1:
            sizes = {DATA: s.dp, TENSOR: s.tp, CONTEXT: s.cp}
            flags += (f"; micro-batches of {micro} x --seq {s.seq} tokens, {s.model} has "
                      f"{model_config.n_head} heads")
            model.family_of(model_config).check_mesh(model_config, sizes)
            check_batch((micro, s.seq), sizes, model_config)
    except ValueError as e:
        raise UsageError(f"{str(e).removeprefix('blujax.sharding: ')} ({flags})") from None


def check_process_flags(args):
    """--num-processes, --process-id and --coordinator fit together (blujax.processes.start
    checks what it takes from the environment)."""
    count = args.num_processes
    check_counts({"--num-processes": count}, 1)
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
                       grad_clip=s.grad_clip, accum_steps=s.accum, dtype=s.dtype, remat=s.remat)
