"""The training loop as a library: steps, timing, evaluations, checkpoints, signals, metrics,
several processes.

    state = train.init_state(config, tcfg, jax.random.key(0))
    step = train.make_train_step(config, tcfg)
    with data.DataLoader(shards, batch_size=8, seq_len=256) as loader, \\
            Checkpointer("run/ckpt") as ckpt:
        state, stop = loop.run(state, step, loader, loop.LoopConfig(steps=1000, save_every=200),
                               checkpointer=ckpt, sinks=[metrics.MetricsFile("run/log.jsonl")])

run() owns what goes around the jitted step: the first step is not timed (it compiles), and
each step's metrics are read back while the next one runs; a checkpoint every save_every steps
or save_seconds, and after the last; the evaluation hooks every eval_every steps and at the
last; SIGINT or SIGTERM stop after the step under way, with a checkpoint (a second Ctrl-C
aborts); a run of max_nonfinite steps in a row whose loss or gradient norm was not finite
(each skipped by the step) stops it, and so does a DataError from the batches, and a failure
of anything beside the steps (an evaluation, a sink, the profiler), each after a checkpoint;
a profile of a few steps. It returns the last state and a Stop that says why it ended. With
several processes (blujax.processes), every process calls it alike; the lead alone saves,
notes and feeds the sinks.

A checkpoint holds checkpoint_tree(state, **extras) and the loader's position; resuming is

    r = loop.restore_latest("run/ckpt", loop.checkpoint_tree(state))  # falls back past damage
    state = loop.state_of(r.tree); loader.load_state(r.loader)

after which run() continues the run bit for bit.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Callable, Iterable, Sequence

import jax
import numpy as np

from blujax import fp8
from blujax.checkpoint import (NO_MANIFEST, CheckpointError, Checkpointer, EarlierLayout,
                               Restored)
from blujax.data import DataError
from blujax.metrics import mfu
from blujax.model import family_of
from blujax.processes import Processes
from blujax.sharding.layout import map_moments
from blujax.train import TrainState

FINISHED, SIGNAL, ERROR = "finished", "signal", "error"


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    """How run() goes about the steps.

    steps: the run's length (evaluations at its last step); stop_after: this call ends after
    that step (default: steps). save_every: a checkpoint every that many steps (0: only at the
    end); save_seconds: also one once that many seconds have passed since the last (0: never
    by the clock). Saves are asynchronous (blujax.checkpoint): a step waits only for the copy
    of the state to host memory. eval_every: the evaluation hooks every that many steps and
    at the last (0: never).
    accum: the micro-batches of a step (a batch [B, T] goes in as [accum, B / accum, T]).
    max_nonfinite: skipped steps in a row that stop the run. profile: a folder for a
    jax.profiler trace of profile_steps steps, the first of them profile_after steps in.
    flops_per_token and peak_flops (of all devices together): the records' MFU. stop_poll: with
    several processes, how often (in steps) they agree whether a signal asked for a stop.
    """

    steps: int
    stop_after: int | None = None
    save_every: int = 0
    save_seconds: float = 0
    eval_every: int = 0
    accum: int = 1
    max_nonfinite: int = 10
    profile: str | Path | None = None
    profile_after: int = 3
    profile_steps: int = 3
    flops_per_token: float | None = None
    peak_flops: float | None = None
    stop_poll: int = 10

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"LoopConfig.steps must be at least 1, got {self.steps}")
        if self.stop_after is not None and not 0 <= self.stop_after <= self.steps:
            raise ValueError(f"LoopConfig.stop_after {self.stop_after} must lie in "
                             f"[0, steps {self.steps}]")
        for name in ("save_every", "save_seconds", "eval_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"LoopConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("accum", "max_nonfinite", "profile_steps", "stop_poll"):
            if getattr(self, name) < 1:
                raise ValueError(f"LoopConfig.{name} must be at least 1, got "
                                 f"{getattr(self, name)}")

    @property
    def last(self) -> int:
        """The step this call ends after."""
        return self.steps if self.stop_after is None else self.stop_after

    def traced(self, start: int) -> range:
        """The indices (steps - 1) a profile traces in a run that starts after step `start`."""
        first = start + self.profile_after
        return range(first, first + self.profile_steps)


class TrainingError(Exception):
    """An error of the loop's own, with a message for its user."""


class NonFiniteError(TrainingError):
    """max_nonfinite steps in a row (`steps`) had a loss or gradient norm that was not finite:
    the step skipped each (the parameters stayed those of the step before the first)."""

    def __init__(self, steps: list[int], saved: str | None):
        first, last = steps[0], steps[-1]
        super().__init__(
            f"the loss or gradient norm was not finite in {plural(len(steps), 'step')} in a "
            f"row (steps {first}-{last}; none of them updated the parameters): stopped"
            + (f", {saved} whose parameters are step {first - 1}'s" if saved else
               f" after step {last}, whose parameters are step {first - 1}'s"))
        self.steps = steps


class SideFailure(TrainingError):
    """Something beside the steps failed mid-run (`what`: an evaluation, recording the
    metrics: a sink, profiling) with `cause`; run() saved the state of `step` first, if it
    could (`saved` says where, in words; None: not saved)."""

    def __init__(self, what: str, step: int, cause: BaseException, saved: str | None):
        super().__init__(f"{what} failed after step {step} ({one_line(cause)}): stopped"
                         + (f", {saved}" if saved else ", with no checkpoint of it"))
        self.what, self.step, self.cause, self.saved = what, step, cause, saved


def one_line(e: BaseException) -> str:
    """An error in one line: the message of one with a message for its user (blujax's own, the
    OS's), else its type and the first line of its message."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    text = next((line for line in str(e).splitlines() if line.strip()), "").strip()
    if type(e).__module__.startswith("blujax") and text:
        return text
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def plural(n: int, word: str, words: str | None = None) -> str:
    """n and the word, singular for 1: plural(1, "step") is "1 step"."""
    return f"{n:,} {word if n == 1 else words or word + 's'}"


@dataclasses.dataclass(frozen=True)
class Stop:
    """Why run() ended. reason: FINISHED (after stop_after), SIGNAL (SIGINT / SIGTERM asked,
    before stop_after) or ERROR (`error`: a data.DataError from the batches, a NonFiniteError,
    or a SideFailure; the checkpointer saved the state first). step: the last step taken."""

    reason: str
    step: int
    error: Exception | None = None


def run(state: TrainState, train_step: Callable, batches: Iterable, config: LoopConfig, *,
        checkpointer: Checkpointer | None = None, extras: dict | None = None,
        checkpoint_state: Callable | None = None, checkpoint_config=None,
        evals: Sequence[Callable] = (), sinks: Sequence[Callable] = (),
        processes: Processes = Processes(), batch_sharding=None,
        note: Callable[[str], None] | None = None) -> tuple[TrainState, Stop]:
    """Steps from state.step up to config.last; the last state, and why it stopped.

    train_step(state, inputs, targets) -> (state, metrics): the jitted step (train.
    make_train_step), inputs and targets [accum, B / accum, T]; metrics holds loss, grad_norm,
    lr and skipped. batches: an iterator of data.Batch (inputs and targets [B, T], the whole
    batch on every process); a data loader's state() is saved with each checkpoint.

    checkpointer: saves checkpoint_tree(checkpoint_state(state), **extras) (extras: more arrays
    to keep, a sampling key say; checkpoint_state: the state as checkpoints keep it, e.g.
    sharding.unshard_state for a state on a mesh) with checkpoint_config as its config; the
    lead process's alone (the others pass None). evals: hooks (step, state) -> dict of fields
    for the step's record (val_loss_hook). sinks: callables given each step's record
    (blujax.metrics), on the lead. processes: this process's place in a run of several.
    batch_sharding: where the batches go (None: the default device). note(text): the loop's
    warnings and notes, on the lead (default: stderr).

    A failed checkpoint save raises its CheckpointError (at the next step). A DataError from
    the batches, a run of non-finite steps, and any error of a hook, a sink or the profiler (a
    SideFailure, after every sink has had the records read back so far) return with
    Stop.error, after a checkpoint (the caller raises it once its own files are written); with
    several processes, a SideFailure is raised (the others, in a collective, cannot save).
    """
    return _Run(train_step, batches, config, checkpointer, extras or {}, checkpoint_state,
                checkpoint_config, list(evals), list(sinks), processes, batch_sharding,
                note).run(state)


def val_loss_hook(eval_step: Callable, batches, name: str = "val_loss") -> Callable:
    """An evaluation hook: the mean of eval_step(params, inputs, targets) over `batches` (pairs
    of [B, T] arrays, placed as eval_step takes them), as the record's `name`."""
    batches = list(batches)

    def val_loss(step, state) -> dict:
        losses = [eval_step(state.params, x, y) for x, y in batches]
        return {name: float(np.mean(jax.device_get(losses)))}

    return val_loss


def check_profile(folder):
    """Proves that a profile can be written into `folder` (jax.profiler writes it only as the
    trace ends): a file written there and deleted, with any folders made for it. A
    TrainingError says why not; run() calls it before step 1, and so may a program sooner."""
    folder = Path(folder)
    made = []  # deepest first
    for f in (folder, *folder.parents):
        if f.exists():
            break
        made.append(f)
    probe = folder / f".probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
    except OSError as e:
        raise TrainingError(f"cannot write a profile into {folder}: {e.strerror or e}") from None
    finally:
        for f in (probe, *made):
            try:
                f.rmdir() if f.is_dir() else f.unlink()
            except OSError:
                pass


class StopRequest:
    """SIGINT / SIGTERM ask the loop to stop after the step under way and save a checkpoint;
    a second Ctrl-C stops at once. In the main thread only (elsewhere, signals stay as they
    are)."""

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


# --------------------------------------------------------------------------------------------
# Checkpoints


def checkpoint_tree(state: TrainState, **extras) -> dict:
    """What a checkpoint holds: the state's params, opt_state and step, delayed FP8 scaling's
    amax histories where the state has them ("fp8"), and `extras`."""
    tree = {"params": state.params, "opt_state": state.opt_state, "step": state.step}
    if state.fp8 is not None:
        tree["fp8"] = state.fp8.amaxes
    return {**tree, **extras}


def state_of(tree: dict) -> TrainState:
    """The TrainState of a checkpoint_tree (an FP8 history restored past step 0 is calibrated:
    the next step scales by it, as the run that saved it would have)."""
    history = None
    if "fp8" in tree:
        history = fp8.History(tree["fp8"], calibrated=int(jax.device_get(tree["step"])) > 0)
    return TrainState(tree["step"], tree["params"], tree["opt_state"], history)


def restore_latest(directory, like: dict, *, config=None, params_only: bool = False,
                   warn: Callable[[str], None] | None = None) -> Restored:
    """The newest checkpoint in `directory` that verifies (a checkpoint.Restored: .tree,
    .step, .loader), restored into `like` (a checkpoint_tree, of arrays or of
    jax.ShapeDtypeStructs: shapes, dtypes and where they go), read without touching the folder
    (so that every process of a run may read it, and a run may be writing there).

    A newer one that is corrupt, or whose manifest.json is gone, is skipped, with one line to
    warn() for each (none if warn is None); if none verifies, CheckpointError says what was
    tried; FileNotFoundError if there is none. params_only=True restores the parameters alone
    ({"params": ...}), reading and verifying only them: what evaluating and sampling need, so
    that a damaged optimizer state does not stop them. config: the model's; with it, a
    checkpoint that an earlier blujax wrote in its family's earlier parameter layout (the
    family's legacy_params) is read too, converted (a note to warn())."""
    reader = Checkpointer(directory, read_only=True)
    if params_only:
        like = {"params": like["params"]}
    skipped = []
    restored = reader.restore(like, partial=params_only, fallback=True,
                              on_skip=lambda path, why: skipped.append((path, why)),
                              earlier=earlier_layouts(like, config))
    if warn is not None:
        for path, why in skipped:
            what = (f"{path} has {why}" if why == NO_MANIFEST
                    else f"checkpoint {path} is corrupt ({why})")
            warn(f"warning: {what}: skipped; restoring step {restored.step} instead")
        if restored.upgraded:
            warn(f"note: {restored.path} has an earlier blujax's parameter layout: converted "
                 f"as it is read")
    return restored


def earlier_layouts(like: dict, config) -> tuple[EarlierLayout, ...]:
    """The layouts a checkpoint_tree like `like` was saved in by earlier versions: its
    family's legacy_params / upgrade_params (applied to the params and AdamW's moments), if it
    has them."""
    family = None if config is None else family_of(config)
    if not hasattr(family, "legacy_params"):
        return ()
    return (EarlierLayout(jax.eval_shape(partial(map_params, family.legacy_params), like),
                          partial(map_params, family.upgrade_params)),)


def map_params(f: Callable, tree: dict) -> dict:
    """A checkpoint_tree with f applied to its params and to every params-shaped part of its
    optimizer state (AdamW's moments)."""
    out = {**tree, "params": f(tree["params"])}
    if "opt_state" in tree:
        out["opt_state"] = map_moments(f, tree["opt_state"], jax.tree.structure(tree["params"]))
    return out


# --------------------------------------------------------------------------------------------
# The loop


class _Failed(Exception):
    """Something beside the steps failed (`what`: an evaluation, a sink, the profiler)."""

    def __init__(self, what: str, cause: Exception):
        super().__init__(what)
        self.what, self.cause = what, cause


class _Run:
    """One call of run(): its bookkeeping between steps. The state trained so far is
    self.state, so that a failure beside the steps (_Failed) can still save it."""

    def __init__(self, train_step, batches, config: LoopConfig, checkpointer, extras,
                 checkpoint_state, checkpoint_config, evals, sinks, procs: Processes,
                 batch_sharding, note):
        self.train_step, self.config = train_step, config
        self.batches, self.loader = iter(batches), batches
        self.checkpointer, self.extras = checkpointer, extras
        self.checkpoint_state, self.checkpoint_config = checkpoint_state, checkpoint_config
        self.evals, self.sinks, self.procs = evals, sinks, procs
        self.batch_sharding = batch_sharding
        self.note = note or (lambda text: print(text, file=sys.stderr, flush=True))
        self.tokens_per_step = None  # of the whole batch, from the first
        self.nonfinite = []  # the steps of the current run of non-finite steps
        self.pending = None  # (step, metrics): dispatched, not read back yet
        self.unlogged = None  # a record read back, not yet given to the sinks
        self.timed = False  # the first step of a process compiles: it is not timed
        self.tracing = False

    def run(self, state):
        c = self.config
        self.state, start = state, int(state.step)
        self.trace = c.traced(start) if c.profile else None
        if self.trace is not None and self.trace.stop > c.last:
            self._note(f"warning: the profile traces steps {self.trace.start + 1}-"
                       f"{self.trace.stop}, but this run ends after step {c.last}: no trace")
            self.trace = None
        if self.trace is not None and self.procs.lead:
            check_profile(c.profile)
        stop = None
        with StopRequest() as request:
            self.t_ref, self.last_save = time.perf_counter(), time.monotonic()
            for index in range(start, c.last):
                try:
                    stop = self._step(index, request)
                except _Failed as failure:
                    stop = self._failed(failure)
                if stop is not None:
                    break
        return self.state, stop or Stop(FINISHED, int(self.state.step))

    def _step(self, index: int, request: StopRequest) -> Stop | None:
        """Step index + 1, and what is due after it; a Stop if the run ends there."""
        c, step = self.config, index + 1
        if self.checkpointer is not None:
            self.checkpointer.raise_if_failed()  # a failed save stops the run now
        try:
            batch = next(self.batches)
        except (DataError, StopIteration) as e:
            return self._data_stop(index, e)
        inputs, targets = self._put(batch)
        # One trace, of the lead (the others' would share its file names).
        if self.trace is not None and index == self.trace.start and self.procs.lead:
            self._side("profiling", self._start_trace)
        self.state, metrics = self.train_step(self.state, inputs, targets)
        previous, self.pending = self.pending, (step, metrics)
        # The previous step read back while this one runs.
        diverged = previous is not None and self._read_back(*previous)
        eval_due = (bool(self.evals) and c.eval_every > 0
                    and (step % c.eval_every == 0 or step == c.steps))
        stopping, time_due = self._agree(request.requested, step)
        save_due = (c.save_every > 0 and step % c.save_every == 0) or time_due
        last = step == c.last or stopping or diverged
        trace_end = self.trace is not None and step == self.trace.stop
        if not (eval_due or save_due or last or trace_end):
            return None
        record = self._finish(*self.pending, self.t_ref, self.timed)[0]
        self.pending, self.unlogged, self.timed = None, record, True
        diverged = self._diverged(record) or diverged
        if trace_end and self.tracing:
            self._side("profiling", self._stop_trace, step)
        if eval_due and not diverged:
            for hook in self.evals:
                record.update(self._side("evaluation", hook, step, self.state))
        self._log_unlogged()
        if save_due or last or diverged:
            self._save(self.state, step)
        if diverged:
            return Stop(ERROR, step, NonFiniteError(self.diverged_steps, self._saved(step)))
        if stopping and step < c.last:
            return Stop(SIGNAL, step)
        self.t_ref = time.perf_counter()  # evaluating and saving are not step time
        return None

    def _read_back(self, step, metrics) -> bool:
        """The record of a step before the last, to the sinks; whether the run diverged."""
        record, self.t_ref = self._finish(step, metrics, self.t_ref, self.timed)
        self.unlogged, self.timed = record, True
        self._log_unlogged()
        return self._diverged(record)

    def _data_stop(self, index: int, e: Exception) -> Stop:
        """Unreadable data (a shard changed since it was checked): what is trained is kept."""
        if self.pending is not None:
            self.unlogged = self._finish(*self.pending, self.t_ref, self.timed)[0]
            self.pending = None
            self._log_unlogged()
        self._save(self.state, index)
        saved = self._saved(index)
        return Stop(ERROR, index, DataError(f"{str(e) or 'the batches ran out'}; stopped before "
                                            f"step {index + 1}" + (f", {saved}" if saved else "")))

    def _side(self, what: str, f: Callable, *args):
        """f(*args), an activity beside the steps: its failure, whatever it is, is _Failed."""
        try:
            return f(*args)
        except Exception as e:
            raise _Failed(what, e) from e

    def _failed(self, failure: _Failed) -> Stop:
        """After a failure beside the steps: the records read back so far to every sink that
        takes them, the trace ended, the steps done saved; a Stop that says what failed. With
        several processes, which cannot save unless all of them do, a SideFailure raised."""
        records = [self.unlogged] if self.unlogged is not None else []
        if self.pending is not None:
            records.append(self._finish(*self.pending, self.t_ref, self.timed)[0])
        self.unlogged = self.pending = None
        for record in records:
            try:
                self._log(record)
            except _Failed:
                pass  # the sinks that work have it
        if self.tracing:
            self.tracing = False
            try:
                jax.profiler.stop_trace()
            except Exception:
                pass
        step = int(self.state.step)
        if self.procs.count > 1:
            raise SideFailure(failure.what, step, failure.cause, None) from failure.cause
        try:
            self._save(self.state, step)
            if self.checkpointer is not None:
                self.checkpointer.wait()
            saved = self._saved(step)
        except CheckpointError as e:
            saved = f"and its checkpoint failed too ({e})"
        return Stop(ERROR, step, SideFailure(failure.what, step, failure.cause, saved))

    def _start_trace(self):
        jax.profiler.start_trace(str(self.config.profile))
        self.tracing = True

    def _stop_trace(self, step: int):
        self.tracing = False
        jax.profiler.stop_trace()
        self._note(f"profile of steps {self.trace.start + 1}-{step} written to "
                   f"{self.config.profile}")

    def _put(self, batch):
        """The batch as the step takes it: [accum, B / accum, T], where batch_sharding says.
        Every process holds the whole batch and puts in the pieces its devices hold, which are
        not a slice of rows per process once "tensor" or "context" spans processes."""
        if self.tokens_per_step is None:
            self.tokens_per_step = int(np.size(batch.inputs))
        accum = self.config.accum
        return tuple(self.procs.global_array(np.asarray(a).reshape(accum, -1, a.shape[-1]),
                                             self.batch_sharding)
                     for a in (batch.inputs, batch.targets))

    def _finish(self, step, metrics, t_ref, timed):
        """Reads back a step's metrics (waiting for the step to end); its record, and the
        time it was read back, which is where the next step's time starts."""
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        seconds = now - t_ref
        rate = self.tokens_per_step / seconds if timed else None
        record = {"step": step, "loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"],
                  "tokens_per_s": rate, "step_time_s": seconds,
                  "mfu": mfu(rate, self.config.flops_per_token, self.config.peak_flops),
                  "skipped": bool(m.get("skipped", 0.0))}
        return record, now

    def _diverged(self, record) -> bool:
        """Counts the run of skipped (non-finite) steps; whether it reached max_nonfinite."""
        if not record["skipped"]:
            self.nonfinite = []
            return False
        self.nonfinite.append(record["step"])
        n = self.config.max_nonfinite
        if len(self.nonfinite) == 1:  # once a run of them: the records mark each
            self._note(f"warning: step {record['step']}: loss {record['loss']}, gradient norm "
                       f"{record['grad_norm']}: not finite, so the step was skipped (the "
                       f"parameters were not updated); {n} in a row stop the run")
        if len(self.nonfinite) < n:
            return False
        self.diverged_steps = list(self.nonfinite)
        return True

    def _agree(self, requested: bool, step: int) -> tuple[bool, bool]:
        """Whether to stop after this step (a signal asked), and whether a save is due by the
        clock (save_seconds). With several processes, a signal may reach some of them only,
        and the clocks differ, but all must stop or save after the same step: they agree
        every stop_poll steps (a collective, which waits for the step to end; not every step,
        so that the host stays a step ahead of the devices)."""
        c = self.config
        due = c.save_seconds > 0 and time.monotonic() - self.last_save >= c.save_seconds
        if self.procs.count == 1:
            return requested, due
        if step % c.stop_poll:
            return False, False
        flags = self.procs.gather(int(requested) | 2 * int(due))
        return any(f & 1 for f in flags), any(f & 2 for f in flags)

    def _save(self, state, step: int):
        self.last_save = time.monotonic()
        if self.checkpointer is None and self.procs.count == 1:
            return
        # Gathered on every process (checkpoint_state may be a collective), written by one.
        saved = state if self.checkpoint_state is None else self.checkpoint_state(state)
        if self.checkpointer is not None and self.procs.lead:
            loader = getattr(self.loader, "state", None)
            self.checkpointer.save(step, checkpoint_tree(saved, **self.extras),
                                   loader=loader() if loader else None,
                                   config=self.checkpoint_config)

    def _saved(self, step: int) -> str | None:
        """Where the checkpoint of `step` is, in words (None: there is none)."""
        if self.checkpointer is not None:
            return f"with a checkpoint of step {step} in {self.checkpointer.directory}"
        if not self.procs.lead:
            return f"with a checkpoint of step {step} saved by process 0"
        return None

    def _note(self, text: str):
        if self.procs.lead:
            self.note(text)

    def _log_unlogged(self):
        record, self.unlogged = self.unlogged, None
        if record is not None:
            self._log(record)

    def _log(self, record):
        """The record to every sink (on the lead); a sink that fails does not keep it from
        the others, and its error is raised, _Failed, after them."""
        if not self.procs.lead:
            return
        failed = None
        for sink in self.sinks:
            try:
                sink(record)
            except Exception as e:
                failed = failed or _Failed("recording the metrics", e)
        if failed is not None:
            raise failed from failed.cause
