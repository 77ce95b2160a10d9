"""What a run reports as it trains: each step's record, and where records go.

A record is one step's dict: step, loss, lr, grad_norm, tokens_per_s (None for a process's
first step, which compiles), step_time_s, mfu (None where the peak is unknown), skipped (the
step's loss or gradient norm was not finite), and an evaluation's fields where one ran
(val_loss, HellaSwag's scores). blujax.loop hands every record to its sinks, plain callables;
those here are

    MetricsFile(path)              appends each record to a JSONL file (metrics.jsonl)
    LossPlot(path, title, records) keeps the records, redraws a loss plot at each evaluation
    Progress(start, total, ...)    a progress bar on a terminal, else a line now and then

and read_metrics() reads a JSONL file back, forgiving a torn last line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# The fields of every step's record; an evaluation adds its own.
STEP_FIELDS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mfu",
               "skipped")


class MetricsError(ValueError):
    """A metrics file or loss plot that cannot be written, or a metrics file damaged other than
    by a torn last line."""


def read_metrics(path: Path, warn=None) -> list[dict]:
    """The records of a metrics file (none if there is none). A last line cut short (a crash
    in the middle of writing it) is dropped, with a line to `warn`; a bad line before the
    last is a MetricsError."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = [(i, line) for i, line in enumerate(path.read_text(errors="replace").splitlines(),
                                                1) if line.strip()]
    records = []
    for n, (i, line) in enumerate(lines):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or "step" not in record:
                raise ValueError("not a step's record")
        except ValueError as e:
            if n < len(lines) - 1:
                raise MetricsError(f"{path}, line {i}: not a step's JSON record ({e}); only "
                                   f"the last line may be torn") from None
            if warn is not None:
                warn(f"warning: {path}: the last line (line {i}) is torn (a run stopped while "
                     f"writing it): dropped")
            break
        records.append(record)
    return records


def write_metrics(path: Path, records: list[dict]):
    """Replaces the metrics file with `records`, atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)


def append_metrics(path: Path, record: dict):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class MetricsFile:
    """A sink: appends each record to the JSONL file `path`, a line each."""

    def __init__(self, path):
        self.path = Path(path)

    def __call__(self, record: dict):
        try:
            append_metrics(self.path, record)
        except OSError as e:
            raise MetricsError(f"cannot write {self.path}: {e.strerror or e}") from None


def is_evaluation(record: dict) -> bool:
    """Whether the record carries an evaluation's fields."""
    return any(k not in STEP_FIELDS for k in record)


class LossPlot:
    """A sink: appends each record to `records` (the run's so far, say, when it resumes) and
    redraws the plot at `path` for each that carries an evaluation; draw() at the end."""

    def __init__(self, path, title: str = "", records: list | None = None):
        self.path, self.title = Path(path), title
        self.records = [] if records is None else records

    def __call__(self, record: dict):
        self.records.append(record)
        if is_evaluation(record):
            self.draw()

    def draw(self):
        try:
            plot_losses(self.records, self.path, self.title)
        except OSError as e:
            raise MetricsError(f"cannot write {self.path}: {e.strerror or e}") from None


def plot_losses(records: list[dict], path: Path, title: str = ""):
    """A PNG of the training loss of every step and the validation loss where measured (and
    HellaSwag's acc_norm, on its own axis, where scored)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no display

    path = Path(path)
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
    handles = ax.get_legend_handles_labels()[0]
    scores = [(r["step"], r["hellaswag_acc_norm"]) for r in records
              if r.get("hellaswag_acc_norm") is not None]
    if scores:  # an accuracy: its own axis, on the right
        right = ax.twinx()
        handles += right.plot(*zip(*scores), "s--", ms=4, color="tab:green",
                              label="HellaSwag acc_norm")
        right.set_ylabel("HellaSwag acc_norm")
    if handles:
        ax.legend(handles=handles)
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp)
    os.replace(tmp, path)


class Progress:
    """A sink: a tqdm bar on a terminal; elsewhere (a log file, a test) a line every `every`
    steps (default: a twentieth of the run) and at every evaluation. Shows the loss, the
    evaluation's, and throughput and MFU over the last steps (given tokens_per_step; MFU
    given flops_per_token and the peak FLOP/s too). enabled=False shows nothing.

    write(text) prints a line past the bar; close() (or the end of a with block) ends it."""

    def __init__(self, start: int, total: int, enabled: bool = True, every: int | None = None,
                 *, tokens_per_step: int | None = None, flops_per_token: float | None = None,
                 peak: float | None = None):
        self.tty = enabled and sys.stderr.isatty()
        self.enabled = enabled
        self.every = max(1, total // 20 if every is None else every)
        self.total = total
        self.tokens_per_step, self.flops_per_token, self.peak = (tokens_per_step,
                                                                 flops_per_token, peak)
        self.throughput = Throughput()
        if self.tty:
            from tqdm import tqdm
            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True,
                            file=sys.stderr)

    def __call__(self, record: dict):
        if record.get("tokens_per_s") is not None:  # a timed step
            self.throughput.add(record["step_time_s"])
        if not self.enabled:
            return
        rate = (self.throughput.tokens_per_s(self.tokens_per_step)
                if self.tokens_per_step else None)
        use = mfu(rate, self.flops_per_token, self.peak)
        parts = {"loss": f"{record['loss']:.4f}"}
        if record.get("val_loss") is not None:
            parts["val"] = f"{record['val_loss']:.4f}"
        if record.get("hellaswag_acc_norm") is not None:
            parts["hellaswag"] = f"{record['hellaswag_acc_norm']:.4f}"
        parts["tok/s"] = "-" if rate is None else f"{rate:,.0f}"
        parts["MFU"] = "n/a" if use is None else f"{100 * use:.1f}%"
        if self.tty:
            self.bar.set_postfix(parts, refresh=False)
            self.bar.update(1)
        elif (record["step"] % self.every == 0 or "val" in parts or "hellaswag" in parts
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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Throughput:
    """Tokens per second over the last `window` timed steps."""

    def __init__(self, window: int = 20):
        self.times: list[float] = []
        self.window = window

    def add(self, seconds: float):
        self.times = (self.times + [seconds])[-self.window:]

    def tokens_per_s(self, tokens_per_step: int) -> float | None:
        return tokens_per_step * len(self.times) / sum(self.times) if self.times else None


def mfu(tokens_per_s: float | None, flops_per_token: float | None,
        peak: float | None) -> float | None:
    """Model FLOPs utilization: the model's FLOPs per second over the device's peak (None where
    any of them is unknown)."""
    if tokens_per_s is None or flops_per_token is None or peak is None:
        return None
    return flops_per_token * tokens_per_s / peak
