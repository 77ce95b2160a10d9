"""What a run reports as it trains: metrics.jsonl, the loss plot, the progress display, and
throughput and MFU.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def warn(text: str):
    """A warning line, on stderr, at once."""
    print(text, file=sys.stderr, flush=True)


class MetricsError(ValueError):
    """metrics.jsonl is damaged other than by a torn last line."""


def read_metrics(path: Path, warn=None) -> list[dict]:
    """The records of metrics.jsonl. A last line cut short (a crash in the middle of writing
    it) is dropped, with a line to `warn`; a bad line before the last is a MetricsError."""
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
    """Replaces metrics.jsonl with `records`, atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    os.replace(tmp, path)


def append_metrics(path: Path, record: dict):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def plot_title(s, model_config) -> str:
    return (f"GPT-2 {s.model} ({model_config.n_layer} layers, {model_config.n_embd} wide), "
            f"{s.batch}x{s.seq} tokens/step, lr {s.lr:g}")


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
        if record.get("hellaswag_acc_norm") is not None:
            parts["hellaswag"] = f"{record['hellaswag_acc_norm']:.4f}"
        parts["tok/s"] = "-" if tokens_per_s is None else f"{tokens_per_s:,.0f}"
        parts["MFU"] = "n/a" if mfu is None else f"{100 * mfu:.1f}%"
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


class Throughput:
    """Tokens per second over the last `window` timed steps."""

    def __init__(self, window: int = 20):
        self.times: list[float] = []
        self.window = window

    def add(self, seconds: float):
        self.times = (self.times + [seconds])[-self.window:]

    def tokens_per_s(self, tokens_per_step: int) -> float | None:
        return tokens_per_step * len(self.times) / sum(self.times) if self.times else None


def mfu(tokens_per_s: float | None, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilization: the model's FLOPs per second over the device's peak (None where
    either is unknown)."""
    if tokens_per_s is None or peak is None:
        return None
    return flops_per_token * tokens_per_s / peak
