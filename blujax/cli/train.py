"""`train`: a new run, or one resumed bit for bit from its latest checkpoint, and its loop.

cmd_train settles the settings, the run folder and the data, builds or restores the state,
then _TrainLoop runs the steps: timing, metrics, validation, checkpoints, the profile and
the progress display around the jitted train step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from blujax import data, hellaswag, sharding
from blujax.checkpoint import Checkpointer
from blujax.cli import processes, report, run
from blujax.cli.lock import RunLock
from blujax.cli.corpus import resolve_data, val_batches
from blujax.cli.generate import (GPT2_VOCAB, check_gpt2_vocab, encode, generate_text,
                                 load_pretrained)
from blujax.cli.settings import (PARALLEL_KEYS, SAMPLE_PROMPT, TrainSettings, UsageError,
                                 check_settings, model_preset, parallel_devices,
                                 resolve_train_settings, run_model_config, training_config)
from blujax.model import gpt2
from blujax.model import ops as model_ops
from blujax.sharding.mesh import check_batch, mesh_sizes
from blujax.train import (TrainState, init_state, make_eval_step, make_train_step,
                          peak_flops, schedule, state_from_params)

EXIT_INTERRUPTED = 130


def cmd_train(args) -> int:
    # First of all: with several processes, jax.distributed must start before anything asks
    # JAX for its devices (the settings' defaults do).
    procs = processes.start(args)
    with contextlib.ExitStack() as held:  # the run folder's lock, until the command ends
        return _train(args, procs, held)


def _train(args, procs: processes.Processes, held: contextlib.ExitStack) -> int:
    out = Path(args.out)
    progress = not args.no_progress and procs.lead
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite contradict each other: pick one")
    source = None
    with procs.together():
        # One run per folder (the other processes share the lead's); a --resume of a folder
        # that is not there fails below without making it.
        if procs.lead and not (args.resume and not out.is_dir()):
            held.enter_context(RunLock(out))
        saved = run.load_run(out) if args.resume else None
        s = resolve_train_settings(args, saved)
        pretrained = None
        if saved is not None:
            model_config = run_model_config(saved)
        elif s.init_from is not None:  # fine-tuning: the model is the weights'
            pretrained = load_pretrained(s.init_from)
            model_config = pretrained.config
            s.model = pretrained.source.get("name") or Path(s.init_from).name
        else:
            model_config = model_preset(s.model)
        check_settings(s, model_config)
        stop_after = s.steps if args.stop_after is None else args.stop_after
        if not 1 <= stop_after <= s.steps:
            raise UsageError(f"--stop-after {stop_after} must lie in [1, --steps {s.steps}]")
        todo = _check_out_folder(out, args, s, saved, stop_after, procs.lead)
        if todo and procs.lead:  # first and alone: it may tokenize --data into a cache
            source = resolve_data(s.data, progress=progress)
    procs.same(todo, "whether there is training to do in --out (it must be one folder that "
                     "every process sees)")
    if not todo:
        return 0

    with procs.together():
        if source is None:  # the other processes, from the lead's cache
            source = resolve_data(s.data, progress=False)
        counts = [data.read_header(p) for p in source.train]
        loader = held.enter_context(_open_loader(s, source, counts, saved,
                                                 model_config.vocab_size))
        # Every shard's tokens, before step 1: a bad token hours into a run would stop it
        # where nothing can be done about it.
        if procs.lead and len(counts) > 4:
            print(f"checking the tokens of {len(counts)} training shards", flush=True)
        loader.check_all()
        fingerprint = loader.state()["shards"]
        val = (val_batches(source, s.batch, s.seq, s.eval_batches, s.dp,
                           vocab_size=model_config.vocab_size) if s.eval_every else [])
        items = None  # HellaSwag's, at every validation
        if s.hellaswag is not None and s.eval_every:
            check_gpt2_vocab(model_config, "HellaSwag")
            items = hellaswag.load_items(s.hellaswag or hellaswag.default_path(
                progress=progress))

        ops = model_ops.get(s.ops)
        train_config = training_config(s)
        devices = parallel_devices(s)
        # One device: the single-device step. Several: the sharded step over a mesh of them.
        mesh = (sharding.make_mesh(s.dp, s.tp, s.cp, devices=devices) if len(devices) > 1
                else None)
        if mesh is not None and val:
            _check_val_batches(val, mesh, model_config)
        warn = report.warn if procs.lead else None
        if args.resume:
            restored = run.restore_latest(out, s, model_config, ops, warn=warn)
            try:
                loader.load_state(restored.loader)
            except ValueError as e:
                raise UsageError(f"--resume: {e}") from None
            extension = _extension(saved, s, restored.step)
            try:  # steps after the checkpoint were lost with the run that made them
                records = [r for r in report.read_metrics(out / "metrics.jsonl", warn)
                           if r["step"] <= restored.step]
            except report.MetricsError as e:
                raise UsageError(str(e)) from None
        # Process 0 alone writes checkpoints; the others only take part in gathering them.
        # Whether it can is found out now, not at the first save.
        checkpointer = None
        if procs.lead:
            if not args.resume:
                run.clear_run(out)
            checkpointer = held.enter_context(Checkpointer(run.checkpoint_dir(out), keep=3))
            checkpointer.check_writable()
    if args.resume:
        procs.same(restored.step, "the checkpoint to resume from (--out must be one folder "
                                  "that every process sees)")
    if procs.count > 1 and val:
        val_sharding = NamedSharding(mesh, P(sharding.DATA))
        val = [(procs.global_array(np.asarray(x), val_sharding),
                procs.global_array(np.asarray(y), val_sharding)) for x, y in val]
    if args.resume:
        tree = restored.tree
        state = TrainState(tree["step"], tree["params"], tree["opt_state"])
        if mesh is not None:  # checkpoints keep the single-device layout, whatever the mesh
            state = sharding.shard_state(state, mesh, shard_optimizer=s.zero)
        if procs.lead:
            _note_mesh_change(saved["settings"], s)
            if extension:
                _note_extension(extension, saved, s)
        sample_key = tree["sample_key"]
    elif pretrained is not None:
        state = state_from_params(pretrained.params, train_config, ops)
        if mesh is not None:
            state = sharding.shard_state(state, mesh, shard_optimizer=s.zero)
        sample_key = jax.random.fold_in(jax.random.key(s.seed), 1)
        records = []
    else:
        if mesh is None:
            state = init_state(model_config, train_config, jax.random.key(s.seed), ops=ops)
        else:  # the same values, made in their shards
            state = sharding.init_sharded_state(model_config, train_config,
                                                jax.random.key(s.seed), mesh, ops,
                                                shard_optimizer=s.zero)
        sample_key = jax.random.fold_in(jax.random.key(s.seed), 1)
        records = []

    init_from = pretrained.source if pretrained else saved and saved.get("init_from")
    config = run.describe_run(s, model_config, train_config, state.params, source, sum(counts),
                              fingerprint, len(devices), procs.count, init_from=init_from)
    if args.resume:
        config["extensions"] = saved.get("extensions", []) + ([extension] if extension else [])
    device = devices[0]
    where = f"{device.device_kind} ({device.platform})"
    if mesh is not None:
        where = (f"{len(devices)} x {where}"
                 + (f" in {procs.count} processes" if procs.count > 1 else "")
                 + f", dp {s.dp} x tp {s.tp} x cp {s.cp}" + (", ZeRO-1" if s.zero else ""))
    if procs.lead:
        try:
            run.write_json(run.config_path(out), config)
            report.write_metrics(out / "metrics.jsonl", records)
        except OSError as e:
            raise UsageError(f"cannot write in {out}: {e}") from None
        print(f"GPT-2 {s.model}: {config['model']['params'] / 1e6:.1f}M parameters"
              + (f" from {s.init_from}" if s.init_from else "") + f", {s.ops} "
              f"ops, {s.dtype}, on {where}; data: {source.description}, {sum(counts):,} "
              f"training tokens; {s.batch} x {s.seq} tokens per step"
              + (f" in {s.accum} micro-batches" if s.accum > 1 else "")
              + (f"; resuming after step {int(state.step)}" if args.resume else "")
              + f"; writing to {out}", flush=True)

    peak = peak_flops(device, s.dtype)
    loop = _TrainLoop(s, model_config, train_config, ops, out, records, progress, mesh, procs,
                      peak=peak and peak * len(devices),
                      flops_per_token=gpt2.flops_per_token(model_config, s.seq),
                      hellaswag_items=items)
    with procs.fail_fast():  # an error on one process stops all of them
        state, stopped = loop.train(state, sample_key, loader, val, checkpointer, stop_after,
                                    args.profile)
        if checkpointer is not None:
            checkpointer.wait()  # the last save's error, if any, is this command's
    if procs.lead:
        report.plot_losses(records, out / "loss.png", report.plot_title(s, model_config))
    last = int(state.step)
    if stopped is not None and stopped.error is not None:
        raise stopped.error
    if last < s.steps:
        if procs.lead:
            print(f"stopped after step {last} of {s.steps}; checkpoint saved in "
                  f"{run.checkpoint_dir(out)}. Continue with: train --resume --out {out}",
                  flush=True)
        return EXIT_INTERRUPTED if stopped is not None else 0
    if procs.lead:
        _print_summary(records, last, out)
    if s.sample_tokens and model_config.vocab_size != GPT2_VOCAB:
        if procs.lead:
            report.warn(f"note: no samples: the model's vocabulary ({model_config.vocab_size} "
                        f"tokens) is not GPT-2's, whose encoding the prompt is in")
    elif s.sample_tokens:
        # Every process gathers the params (collectives); process 0 samples from its copy.
        params = state.params if mesh is None else sharding.unshard_params(state.params)
        if procs.lead:
            if procs.count > 1:  # whole on each of this process's devices: take the first
                params = jax.tree.map(lambda x: x.addressable_data(0), params)
            _write_samples(s, model_config, ops, params, sample_key, out)
    return 0


def _extension(saved: dict, s: TrainSettings, at_step: int) -> dict | None:
    """A resumed run given another --steps: the record config.json keeps of it (None if
    --steps is the run's). It must leave steps to train after the checkpoint."""
    before = saved["settings"]["steps"]
    if s.steps == before:
        return None
    if s.steps <= at_step:
        raise UsageError(f"--resume --steps {s.steps}: the run is already at step {at_step} "
                         f"(of {before}); give more steps than that to extend it")
    return {"at_step": at_step, "steps_before": before, "steps_after": s.steps}


def _note_extension(extension: dict, saved: dict, s: TrainSettings):
    """Says what a new --steps does to the learning-rate schedule, which spans --steps."""
    at, before = extension["at_step"], extension["steps_before"]
    old = schedule(dataclasses.replace(training_config(s), steps=before))
    new = schedule(training_config(s))
    # Step k's learning rate is the schedule's at k - 1 (steps taken before it).
    print(f"note: --steps {s.steps} {'extends' if s.steps > before else 'shortens'} the run "
          f"from {before} steps: the learning-rate schedule (warmup {s.warmup}, cosine decay "
          f"to {s.min_lr_ratio:g} x lr) now spans {s.steps} steps, so step {at + 1} trains at "
          f"lr {float(new(at)):.3g} where the run's schedule had {float(old(at)):.3g}; "
          f"config.json records the change", flush=True)


def _check_out_folder(out: Path, args, s: TrainSettings, saved: dict | None, stop_after: int,
                      lead: bool = True) -> bool:
    """Whether there is training to do in `out`: resuming (saved: its config.json), a
    checkpoint to continue from that is short of stop_after; starting, no earlier run there
    (unless --overwrite). Only the lead process says so."""
    existing = run.checkpoint_steps(out)
    if args.resume:
        if not existing:
            raise UsageError(f"--resume: {out} holds no checkpoint to continue from (nothing "
                             f"in {run.checkpoint_dir(out)})")
        if args.steps is not None and existing[-1] >= s.steps:
            # A --steps that extends nothing: not the run's own count, or one already reached.
            _extension(saved, s, existing[-1])
        if existing[-1] >= stop_after:
            if lead:
                print(f"{out}: the run is already at step {existing[-1]} (of {s.steps}); "
                      f"nothing to train")
            return False
    elif (existing or run.config_path(out).exists()) and not args.overwrite:
        raise UsageError(f"{out} already holds a run"
                         + (f" (checkpoint of step {existing[-1]})" if existing else "")
                         + ": --resume continues it, --overwrite starts it again, or choose "
                           "another --out")
    return True


def _open_loader(s: TrainSettings, source, counts: list[int], saved: dict | None,
                 vocab_size: int):
    """The training data loader; resuming, over the same shards as the run's."""
    need = s.batch * s.seq + 1
    if max(counts) < need:
        raise UsageError(
            f"too few tokens for one batch: --batch {s.batch} x --seq {s.seq} needs {need} "
            f"tokens in one shard, and the largest training shard has {max(counts)} "
            f"({source.description}); lower --batch or --seq, or give more text")
    # Whole batches, on every process (see _TrainLoop.train).
    loader = data.DataLoader(source.train, None, batch_size=s.batch, seq_len=s.seq,
                             seed=s.seed, process_index=0, process_count=1,
                             vocab_size=vocab_size)
    if saved is not None and saved["data"]["fingerprint"] != loader.state()["shards"]:
        loader.close()
        raise UsageError(f"--resume: the training data differs from the run's (other shard "
                         f"files or token counts); the run used {saved['data']['description']}")
    return loader


def _check_val_batches(val, mesh, model_config):
    """The validation batches split over the mesh (the last may have fewer rows)."""
    for shape in {x.shape for x, _ in val}:
        try:
            check_batch(shape, mesh_sizes(mesh), model_config)
        except ValueError as e:
            raise UsageError(f"validation batches of {shape[0]} x {shape[1]} tokens: "
                             f"{str(e).removeprefix('blujax.sharding: ')}") from None


def _note_mesh_change(old: dict, s: TrainSettings):
    was = {k: old.get(k, getattr(TrainSettings, k)) for k in PARALLEL_KEYS}
    now = {k: getattr(s, k) for k in PARALLEL_KEYS}
    if was != now:
        def fmt(d):
            return (f"dp {d['dp']} x tp {d['tp']} x cp {d['cp']}"
                    + (", ZeRO-1" if d["zero"] else ""))
        print(f"note: the run was on {fmt(was)}, it continues on {fmt(now)}: the same "
              f"numbers up to rounding, not bit for bit", flush=True)


def _print_summary(records: list[dict], last: int, out: Path):
    timed = [r["tokens_per_s"] for r in records if r.get("tokens_per_s")]
    val = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    print(f"done: step {last}, loss {records[-1]['loss']:.4f}"
          + (f", val loss {val[-1]:.4f}" if val else "")
          + (f", {np.median(timed):,.0f} tokens/s (median)" if timed else "")
          + f"; metrics.jsonl, loss.png, config.json and ckpt/ are in {out}", flush=True)


def _write_samples(s: TrainSettings, model_config, ops, params, sample_key, out: Path):
    """samples.txt: two continuations of SAMPLE_PROMPT, also printed."""
    n = min(s.sample_tokens, model_config.block_size - len(encode(SAMPLE_PROMPT)))
    texts = generate_text(params, model_config, ops, s.dtype, SAMPLE_PROMPT, key=sample_key,
                          max_new_tokens=n, temperature=1.0, top_k=40, num_samples=2)
    (out / "samples.txt").write_text("".join(f"--- sample {i + 1} ---\n{t}\n"
                                             for i, t in enumerate(texts)))
    for i, t in enumerate(texts):
        print(f"--- sample {i + 1} ---\n{t}")


@dataclasses.dataclass
class _Stopped:
    """Why a run ended before --stop-after: a signal (error None) or a fault (its error, to
    raise once the run's files are written)."""

    error: Exception | None = None


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


class _TrainLoop:
    """The steps of one process's share of a run: timing, metrics, validation, checkpoints,
    the profile and the progress display around the jitted train step."""

    PROFILE_AFTER, PROFILE_STEPS = 3, 3
    # Non-finite steps in a row (each skipped by the train step) after which the run stops.
    MAX_NONFINITE = 10
    # With several processes, how often they agree whether a signal asked for a stop.
    STOP_POLL = 10

    def __init__(self, s: TrainSettings, model_config, train_config, ops, out: Path,
                 records: list, progress: bool, mesh, procs=processes.Processes(), *, peak,
                 flops_per_token, hellaswag_items=None):
        self.s, self.model_config, self.out, self.records = s, model_config, out, records
        self.ops, self.hellaswag_items = ops, hellaswag_items
        self.progress, self.procs = progress, procs
        self.peak, self.flops_per_token = peak, flops_per_token
        self.mesh = mesh
        if mesh is None:
            self.train_step = make_train_step(model_config, train_config, ops=ops)
            self.eval_step = make_eval_step(model_config, train_config, ops=ops)
            self.batch_sharding = None  # the default device
        else:
            self.train_step = sharding.make_sharded_train_step(
                model_config, train_config, mesh, ops, shard_optimizer=s.zero)
            self.eval_step = sharding.make_sharded_eval_step(model_config, train_config, mesh,
                                                             ops)
            self.batch_sharding = sharding.batch_sharding(mesh)
        self.train_config_dtype = train_config.compute_dtype
        self.tokens_per_step = s.batch * s.seq
        self.throughput = report.Throughput()

    def train(self, state, sample_key, loader, val_batches, checkpointer, stop_after, profile):
        """Steps from state.step up to stop_after; returns the last state and a _Stopped if
        the run ended early (a signal, or a fault: its error is then set, and a checkpoint of
        the state was saved first). checkpointer: None on the processes that do not write."""
        s = self.s
        start = int(state.step)
        bar = report.Progress(start, s.steps, self.progress, every=max(1, s.steps // 20))
        self.bar = bar
        self.nonfinite = []  # the steps of the current run of non-finite steps
        trace = range(start + self.PROFILE_AFTER, start + self.PROFILE_AFTER + self.PROFILE_STEPS)
        if profile and trace.stop > stop_after:
            self._note(f"warning: --profile traces steps {trace.start + 1}-{trace.stop}, but "
                       f"this run ends after step {stop_after}: no trace")
            profile = None
        micro = s.batch // s.accum
        pending = None     # (step, metrics): dispatched, not read back yet
        timed = False      # the first step of a process compiles: it is not timed
        stopped = None     # a _Stopped, once the run ends early

        def save(step):
            # In the single-device layout, whatever the mesh; gathered on every process,
            # written by one.
            saved = state if self.mesh is None else sharding.unshard_state(state)
            if checkpointer is not None:
                checkpointer.save(step, run.checkpoint_tree(saved, sample_key),
                                  loader=loader.state(), config=dataclasses.asdict(s))

        try:
            with _StopRequest() as stop:
                t_ref = time.perf_counter()
                for index in range(start, stop_after):
                    step = index + 1
                    if checkpointer is not None:
                        checkpointer.raise_if_failed()  # a failed save stops the run now
                    try:
                        # The whole batch, on every process: each puts in the pieces its
                        # devices hold, which are not a slice of rows per process once
                        # "tensor" or "context" spans processes (or "data" does not).
                        batch = next(loader)  # the loader never writes these arrays again
                    except data.DataError as e:
                        # Unreadable data (a shard changed since it was checked): keep what
                        # is trained, then stop.
                        if pending is not None:
                            self._log(self._finish(*pending, t_ref, timed)[0])
                            pending = None
                        save(index)
                        stopped = _Stopped(data.DataError(
                            f"{e}; stopped before step {step}, with a checkpoint of step "
                            f"{index} in {run.checkpoint_dir(self.out)}"))
                        break
                    inputs = self.procs.global_array(batch.inputs.reshape(s.accum, micro, -1),
                                                     self.batch_sharding)
                    targets = self.procs.global_array(
                        batch.targets.reshape(s.accum, micro, -1), self.batch_sharding)
                    # One trace, of process 0 (the others' would share its file names).
                    if profile and index == trace.start and self.procs.lead:
                        jax.profiler.start_trace(str(profile))
                    state, metrics = self.train_step(state, inputs, targets)
                    diverged = False
                    if pending is not None:  # read the previous step while this one runs
                        record, t_ref = self._finish(*pending, t_ref, timed)
                        timed = True
                        self._log(record)
                        diverged = self._diverged(record)
                    pending = (step, metrics)
                    eval_due = (bool(val_batches or self.hellaswag_items)
                                and (step % s.eval_every == 0 or step == s.steps))
                    save_due = bool(s.save_every) and step % s.save_every == 0
                    stopping = self._stop_agreed(stop.requested, step)
                    last = step == stop_after or stopping or diverged
                    trace_end = bool(profile) and step == trace.stop
                    if not (eval_due or save_due or last or trace_end):
                        continue
                    record, _ = self._finish(*pending, t_ref, timed)
                    pending, timed = None, True
                    diverged = self._diverged(record) or diverged
                    if trace_end and self.procs.lead:
                        jax.profiler.stop_trace()
                        self._note(f"profile of steps {trace.start + 1}-{step} written to "
                                   f"{profile}")
                    if eval_due and not diverged:
                        record.update(self._evaluate(state.params, val_batches))
                    self._log(record)
                    if eval_due and self.procs.lead:
                        report.plot_losses(self.records, self.out / "loss.png",
                                           report.plot_title(s, self.model_config))
                    if save_due or last or diverged:
                        save(step)
                    if diverged:
                        first, n = self.diverged_steps[0], len(self.diverged_steps)
                        stopped = _Stopped(UsageError(
                            f"the loss or gradient norm was not finite in {n} steps in a row "
                            f"(steps {first}-{step}; none of them updated the parameters): "
                            f"stopped, with a checkpoint of step {step} in "
                            f"{run.checkpoint_dir(self.out)} whose parameters are step "
                            f"{first - 1}'s; a lower --lr or a longer --warmup may help"))
                        break
                    if stopping:
                        if step < stop_after:
                            stopped = _Stopped()
                        break
                    t_ref = time.perf_counter()  # evaluating and saving are not step time
        finally:
            bar.close()
        return state, stopped

    def _finish(self, step, metrics, t_ref, timed):
        """Reads back a step's metrics (waiting for the step to end); its record, and the
        time it was read back, which is where the next step's time starts."""
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        seconds = now - t_ref
        rate = self.tokens_per_step / seconds if timed else None
        if timed:
            self.throughput.add(seconds)
        record = {"step": step, "loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"],
                  "tokens_per_s": rate, "step_time_s": seconds,
                  "mfu": report.mfu(rate, self.flops_per_token, self.peak),
                  "skipped": bool(m.get("skipped", 0.0))}
        return record, now

    def _diverged(self, record) -> bool:
        """Counts the run of skipped (non-finite) steps; whether it reached MAX_NONFINITE."""
        if not record["skipped"]:
            self.nonfinite = []
            return False
        self.nonfinite.append(record["step"])
        if len(self.nonfinite) == 1:  # once a run of them: metrics.jsonl marks each
            self._note(f"warning: step {record['step']}: loss {record['loss']}, gradient norm "
                       f"{record['grad_norm']}: not finite, so the step was skipped (the "
                       f"parameters were not updated); {self.MAX_NONFINITE} in a row stop "
                       f"the run")
        if len(self.nonfinite) < self.MAX_NONFINITE:
            return False
        self.diverged_steps = list(self.nonfinite)
        return True

    def _note(self, text: str):
        if self.procs.lead:
            self.bar.write(text)

    def _stop_agreed(self, requested: bool, step: int) -> bool:
        """Whether to stop after this step. With several processes, a signal may reach some of
        them only, and all must stop after the same step: they agree every STOP_POLL steps
        (a collective, which waits for the step to end; not every step, so that the host
        stays a step ahead of the devices)."""
        if self.procs.count == 1:
            return requested
        return step % self.STOP_POLL == 0 and self.procs.any(requested)

    def _evaluate(self, params, val_batches) -> dict:
        """The validation loss, and HellaSwag's scores where asked for."""
        result = {}
        if val_batches:
            losses = [self.eval_step(params, x, y) for x, y in val_batches]
            result["val_loss"] = float(np.mean(jax.device_get(losses)))
        if self.hellaswag_items:
            # On one device, in the model's layout: every process scores all items itself.
            if self.mesh is not None:
                params = sharding.unshard_params(params)
                params = (jax.tree.map(lambda x: x.addressable_data(0), params)
                          if self.procs.count > 1 else jax.device_put(params, jax.devices()[0]))
            result.update(hellaswag.score(params, self.model_config, self.hellaswag_items,
                                          ops=self.ops, dtype=self.train_config_dtype))
        return result

    def _log(self, record):
        self.records.append(record)
        if self.procs.lead:
            path = self.out / "metrics.jsonl"
            try:
                report.append_metrics(path, record)
            except OSError as e:
                raise UsageError(f"cannot write {path}: {e.strerror or e}") from None
        rate = self.throughput.tokens_per_s(self.tokens_per_step)
        self.bar.update(record, report.mfu(rate, self.flops_per_token, self.peak), rate)
