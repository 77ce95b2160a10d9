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

from blujax import fp8 as fp8_lib, model, processes
from blujax.interop import InteropError
from blujax.loop import TrainingError, plural
from blujax.metrics import MetricsError
from blujax.runs import RunError
from blujax.model.stack import remat_mode
from blujax.sharding.mesh import CONTEXT, DATA, FSDP, TENSOR, check_batch, mesh_devices
from blujax.train import TrainConfig

# What the samples at the end of training, and `sample` by default, continue.
SAMPLE_PROMPT = "Hello, I'm a"


class UsageError(Exception):
    """A problem the user can fix (a flag, a file, the environment): main() prints the message
    as one line and returns 2, without a traceback."""


# The errors of the user's own making, the command line's and the library's: main() prints
# them in one line and returns 2 (with several processes: Processes.fail_fast's `errors`).
USER_ERRORS = (UsageError, *processes.ERRORS, TrainingError, MetricsError, InteropError,
               RunError)


@dataclasses.dataclass
class TrainSettings:
    """Every setting of a training run, with its default on a CPU (a small model that trains
    for a few minutes; ACCELERATOR_DEFAULTS on a GPU). Those in COMPUTE_KEYS decide its
    numbers, so a resumed run must keep them; the others only say what to measure and write,
    and may change. warmup, eval_every and save_every follow steps, and save_minutes
    save_every (resolve_train_settings)."""

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
    remat: str = "none"  # blujax.model.stack.REMAT; new runs: blujax.model.default_remat
    fp8: str = "off"  # FP8 block products (blujax.fp8.MODES) and their scaling
    fp8_scaling: str = fp8_lib.DEFAULT_SCALING
    eval_every: int | None = None
    eval_batches: int = 4
    save_every: int | None = None
    save_minutes: float | None = None
    sample_tokens: int = 64
    dp: int = 1  # the device mesh (blujax.sharding)
    tp: int = 1
    cp: int = 1
    fsdp: int = 1
    zero: bool = False
    init_from: str | None = None  # pretrained weights to start from (None: a new `model`)
    # HellaSwag at every validation: the items' file ("": the official set, downloaded).
    hellaswag: str | None = None

    @property
    def n_devices(self) -> int:
        return self.dp * self.fsdp * self.tp * self.cp

    @property
    def batch_shards(self) -> int:
        """Devices over which a batch's sequences split."""
        return self.dp * self.fsdp


# GPT-2 124M in bf16.
ACCELERATOR_DEFAULTS = dict(model="gpt2", steps=200, batch=16, seq=1024, dtype="bf16",
                            lr=6e-4, eval_batches=8)
COMPUTE_KEYS = ("model", "steps", "batch", "seq", "accum", "ops", "dtype", "seed", "lr",
                "min_lr_ratio", "warmup", "weight_decay", "grad_clip", "remat", "init_from",
                "fp8", "fp8_scaling")
# How the run is spread over devices: the same numbers up to rounding, so a resumed run keeps
# the run's values unless given, and may change them (then not bit for bit).
PARALLEL_KEYS = ("dp", "tp", "cp", "fsdp", "zero")
# Settings that runs of earlier versions lack (config.json): they take their defaults there.
ADDED_KEYS = (*PARALLEL_KEYS, "init_from", "hellaswag", "save_minutes", "fp8", "fp8_scaling")
# A run checkpoints every tenth of its steps or every SAVE_MINUTES, whichever comes first,
# unless --save-every / --save-minutes say otherwise (see _save_rule).
SAVE_MINUTES = 10.0


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
        old["remat"] = remat_mode(old.get("remat"))  # earlier runs: true / false
        changed = [k for k in COMPUTE_KEYS if k in given and given[k] != old[k]
                   and k != "steps"]
        if changed:
            raise UsageError(
                "--resume continues a run with the settings it started with, and these "
                "differ: " + ", ".join(f"--{k.replace('_', '-')} {given[k]} (the run has "
                                       f"{old[k]})" for k in changed))
        values = dict(old)
        values.update(given)
        if values["save_minutes"] is None:  # a run of earlier versions: steps only
            values["save_minutes"] = 0.0
    else:
        if "init_from" in given and "model" in given:
            raise UsageError("--model and --init-from: the model's shape comes from the weights "
                             "--init-from names; drop --model")
        values = dict(defaults(on_accelerator()), **given)
        if values["warmup"] is None:
            values["warmup"] = values["steps"] // 10
        if values["eval_every"] is None:
            values["eval_every"] = max(1, values["steps"] // 10)
    _save_rule(values, given)
    values["data"] = _data_spec(values["data"])
    return TrainSettings(**{f.name: values[f.name] for f in dataclasses.fields(TrainSettings)})


def _save_rule(values: dict, given: dict):
    """When the run checkpoints, as config.json records it. By default every tenth of --steps
    (a run of fewer than 10 steps: none) or every SAVE_MINUTES, whichever comes
    first: a crash loses a tenth of the run at most, and 10 minutes of a long one. A save
    stalls the steps only for the copy of the state to host memory (the write is
    asynchronous), under a second for GPT-2 124M: the clock's rule costs well under 1%, a
    tenth's rule ten saves a run, of which the last 3 stay on disk. --save-every N alone
    means every N steps, as it did (0: at the end only); --save-minutes M alone keeps the
    tenth's rule and sets the clock's (0: none)."""
    if "save_every" in given and "save_minutes" not in given:
        values["save_minutes"] = 0.0
    if values["save_every"] is None:
        values["save_every"] = values["steps"] // 10
    if values["save_minutes"] is None:
        values["save_minutes"] = SAVE_MINUTES


def _data_spec(spec: str | None) -> str | None:
    """--data as config.json keeps it: absolute, so eval and sample find it from anywhere."""
    if spec is None or not os.path.exists(spec):
        return spec
    return str(Path(spec).absolute())


def check_settings(s: TrainSettings, model_config):
    """Refuses settings that cannot train, before anything is read or compiled."""
    def flags(*names):
        return {f"--{name.replace('_', '-')}": getattr(s, name) for name in names}

    check_counts(flags("steps", "batch", "seq", "accum", "eval_batches", "dp", "tp", "cp", "fsdp"),
                 1)
    check_counts(flags("warmup", "eval_every", "save_every", "sample_tokens"), 0)
    check_number("--lr", s.lr, low=0, low_open=True)
    check_number("--min-lr-ratio", s.min_lr_ratio, low=0, high=1)
    check_number("--weight-decay", s.weight_decay, low=0)
    check_number("--grad-clip", s.grad_clip, low=0, why=" (0: no clipping)")
    check_number("--save-minutes", s.save_minutes, low=0, why=" (0: not by the clock)")
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


# More passes over the training tokens than this, and a run is warned that it memorizes them.
MAX_EPOCHS = 10


def setting_warnings(s: TrainSettings, model_config, *, description: str, val: bool,
                     train_tokens: int, epochs: float, prompt_tokens: int | None) -> list[str]:
    """A `warning: ...` line for each setting that trains, but not as meant: description and
    val: the data's, and whether it has a validation split; train_tokens and epochs: the
    training tokens, and how many times the run reads them; prompt_tokens: the samples'
    prompt's (None: no samples)."""
    lines = []
    if s.warmup > s.steps:  # step k trains at lr * k / warmup in the warmup
        lines.append(f"warning: --warmup {s.warmup} is longer than --steps {s.steps}: the "
                     f"learning rate never reaches --lr {s.lr:g} (the last step's is "
                     f"{s.lr * s.steps / s.warmup:.3g})")
    if s.eval_every and not val:
        lines.append(f"warning: no validation shard in {description} (none has '_val_' in "
                     f"its name): --eval-every {s.eval_every} measures no validation loss")
    room = prompt_tokens is not None and model_config.block_size - prompt_tokens
    if prompt_tokens is not None and s.sample_tokens > room:
        lines.append(f"warning: --sample-tokens {s.sample_tokens} is capped to {room}: the "
                     f"model's context ({model_config.block_size} tokens) holds the prompt's "
                     f"{plural(prompt_tokens, 'token')} and {room} more")
    if epochs > MAX_EPOCHS:
        lines.append(f"warning: the run reads its {plural(train_tokens, 'training token')} "
                     f"{epochs:.0f} times ({s.steps} steps of {s.batch} x {s.seq}): so many "
                     f"epochs learn these tokens by heart; give more data, or fewer --steps")
    return lines


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
    flags = f"--dp {s.dp}, --fsdp {s.fsdp}, --tp {s.tp}, --cp {s.cp}"
    micro = s.batch // s.accum
    try:
        mesh_devices(s.dp, s.tp, s.cp, fsdp=s.fsdp)
        if s.n_devices > 1:
            sizes = {DATA: s.dp, FSDP: s.fsdp, TENSOR: s.tp, CONTEXT: s.cp}
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
                            ("--process-id", args.process_id),
                            ("--init-timeout", args.init_timeout)) if v is not None]
    if given and not several:
        raise UsageError(f"{' and '.join(given)} {'apply' if len(given) > 1 else 'applies'} to "
                         f"a run of several processes: give --num-processes too")
    if args.init_timeout is not None:
        check_number("--init-timeout", args.init_timeout, low=0, low_open=True)
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
                       grad_clip=s.grad_clip, accum_steps=s.accum, dtype=s.dtype, remat=s.remat,
                       fp8=s.fp8, fp8_scaling=s.fp8_scaling)
