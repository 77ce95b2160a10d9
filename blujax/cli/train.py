"""`train`: a new run, or one resumed bit for bit from its latest checkpoint.

cmd_train settles the settings, the run folder and the data, builds or restores the state,
the steps, the evaluation hooks and the sinks of the records (metrics.jsonl, loss.png, the
progress display), then blujax.loop runs the steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from blujax import data, hellaswag, loop, metrics, model, processes, sharding
from blujax.checkpoint import Checkpointer
from blujax.cli import report, run
from blujax.cli.lock import RunLock
from blujax.cli.generate import (GPT2_VOCAB, check_gpt2_vocab, encode, generate_text,
                                 load_pretrained)
from blujax.cli.settings import (PARALLEL_KEYS, SAMPLE_PROMPT, USER_ERRORS, TrainSettings,
                                 UsageError, check_process_flags, check_settings, model_preset,
                                 parallel_devices, resolve_train_settings, run_model_config,
                                 training_config)
from blujax.model import ops as model_ops
from blujax.sharding.mesh import check_batch, mesh_sizes
from blujax.train import (batch_sharding, gather, init_state, make_eval_step, make_train_step,
                          peak_flops, place_state, schedule, state_from_params)

EXIT_INTERRUPTED = 130


def cmd_train(args) -> int:
    # First of all: with several processes, jax.distributed must start before anything asks
    # JAX for its devices (the settings' defaults do).
    check_process_flags(args)
    procs = processes.start(args.coordinator, args.num_processes, args.process_id,
                            errors=USER_ERRORS)
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
            source = data.resolve(s.data, progress=progress)
    procs.same(todo, "whether there is training to do in --out (it must be one folder that "
                     "every process sees)")
    if not todo:
        return 0

    with procs.together():
        if source is None:  # the other processes, from the lead's cache
            source = data.resolve(s.data)
        counts = [data.read_header(p) for p in source.train]
        loader = held.enter_context(_open_loader(s, source, counts, saved,
                                                 model_config.vocab_size))
        # Every shard's tokens, before step 1: a bad token hours into a run would stop it
        # where nothing can be done about it.
        if procs.lead and len(counts) > 4:
            print(f"checking the tokens of {len(counts)} training shards", flush=True)
        loader.check_all()
        fingerprint = loader.state()["shards"]
        val = (data.val_batches(source.val, batch=s.batch, seq=s.seq,
                                max_batches=s.eval_batches, rows_multiple=s.dp,
                                vocab_size=model_config.vocab_size) if s.eval_every else [])
        if s.eval_every and source.val and not val and procs.lead:
            report.warn(f"warning: the validation split of {source.description} is shorter "
                        f"than {s.dp} sequence(s) of --seq {s.seq}: no validation loss")
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
                records = [r for r in metrics.read_metrics(out / "metrics.jsonl", warn)
                           if r["step"] <= restored.step]
            except metrics.MetricsError as e:
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
        state = loop.state_of(tree)
        if mesh is not None:  # checkpoints keep the single-device layout, whatever the mesh
            state = place_state(state, model_config, mesh, shard_optimizer=s.zero)
        if procs.lead:
            _note_mesh_change(saved["settings"], s)
            if extension:
                _note_extension(extension, saved, s)
        sample_key = tree["sample_key"]
    elif pretrained is not None:
        state = state_from_params(model_config, pretrained.params, train_config, ops)
        if mesh is not None:
            state = place_state(state, model_config, mesh, shard_optimizer=s.zero)
        sample_key = jax.random.fold_in(jax.random.key(s.seed), 1)
        records = []
    else:
        # On a mesh, the same values, made in their shards.
        state = init_state(model_config, train_config, jax.random.key(s.seed), ops, mesh,
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
            metrics.write_metrics(out / "metrics.jsonl", records)
        except OSError as e:
            raise UsageError(f"cannot write in {out}: {e}") from None
        print(f"{model.family_of(model_config).TITLE} {s.model}: "
              f"{config['model']['params'] / 1e6:.1f}M parameters"
              + (f" from {s.init_from}" if s.init_from else "") + f", {s.ops} "
              f"ops, {s.dtype}, on {where}; data: {source.description}, {sum(counts):,} "
              f"training tokens; {s.batch} x {s.seq} tokens per step"
              + (f" in {s.accum} micro-batches" if s.accum > 1 else "")
              + (f"; resuming after step {int(state.step)}" if args.resume else "")
              + f"; writing to {out}", flush=True)

    train_step, eval_step, batches_on = _steps(model_config, train_config, ops, mesh, s)
    evals = []
    if val:
        evals.append(loop.val_loss_hook(eval_step, val))
    if items:
        evals.append(_hellaswag_hook(items, model_config, ops, train_config.compute_dtype,
                                     mesh, procs))
    peak = peak_flops(device, s.dtype)
    settings = loop.LoopConfig(
        steps=s.steps, stop_after=stop_after, save_every=s.save_every, eval_every=s.eval_every,
        accum=s.accum, profile=args.profile,
        flops_per_token=model.family_of(model_config).flops_per_token(model_config, s.seq),
        peak_flops=peak and peak * len(devices))
    start = int(state.step)
    bar = metrics.Progress(start, s.steps, progress, every=max(1, s.steps // 20),
                           tokens_per_step=s.batch * s.seq,
                           flops_per_token=settings.flops_per_token, peak=settings.peak_flops)
    trace = settings.traced(start)
    if args.profile and trace.stop > stop_after:  # said here, in the flag's words
        if procs.lead:
            bar.write(f"warning: --profile traces steps {trace.start + 1}-{trace.stop}, but "
                      f"this run ends after step {stop_after}: no trace")
        settings = dataclasses.replace(settings, profile=None)
    plot = metrics.LossPlot(out / "loss.png", report.plot_title(s, model_config), records)
    with procs.fail_fast():  # an error on one process stops all of them
        with bar:
            state, stop = loop.run(
                state, train_step, loader, settings, checkpointer=checkpointer,
                extras={"sample_key": sample_key},
                # Checkpoints keep the single-device layout, whatever the mesh.
                checkpoint_state=None if mesh is None else gather,
                checkpoint_config=dataclasses.asdict(s), evals=evals,
                sinks=[metrics.MetricsFile(out / "metrics.jsonl"), bar, plot],
                processes=procs, batch_sharding=batches_on, note=bar.write)
        if checkpointer is not None:
            checkpointer.wait()  # the last save's error, if any, is this command's
    if procs.lead:
        plot.draw()
    last = int(state.step)
    if isinstance(stop.error, loop.NonFiniteError):
        raise UsageError(f"{stop.error}; a lower --lr or a longer --warmup may help")
    if stop.error is not None:
        raise stop.error
    if last < s.steps:
        if procs.lead:
            print(f"stopped after step {last} of {s.steps}; checkpoint saved in "
                  f"{run.checkpoint_dir(out)}. Continue with: train --resume --out {out}",
                  flush=True)
        return EXIT_INTERRUPTED if stop.reason == loop.SIGNAL else 0
    if procs.lead:
        _print_summary(records, last, out)
    if s.sample_tokens and model_config.vocab_size != GPT2_VOCAB:
        if procs.lead:
            report.warn(f"note: no samples: the model's vocabulary ({model_config.vocab_size} "
                        f"tokens) is not GPT-2's, whose encoding the prompt is in")
    elif s.sample_tokens:
        # Every process gathers the params (collectives); process 0 samples from its copy.
        params = state.params if mesh is None else gather(state.params)
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
    # Whole batches, on every process (see loop.run).
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


def _steps(model_config, train_config, ops, mesh, s: TrainSettings):
    """The jitted train and eval steps, and where a batch goes (None: the default device):
    the single-device steps, or the sharded ones over `mesh`."""
    return (make_train_step(model_config, train_config, ops, mesh, shard_optimizer=s.zero),
            make_eval_step(model_config, train_config, ops, mesh), batch_sharding(mesh))


def _hellaswag_hook(items, model_config, ops, dtype, mesh, procs: processes.Processes):
    """An evaluation hook: HellaSwag's scores of the params, on one device in the model's
    layout (every process scores all items itself)."""
    def hellaswag_scores(step, state) -> dict:
        params = state.params
        if mesh is not None:
            params = gather(params)
            params = (jax.tree.map(lambda x: x.addressable_data(0), params)
                      if procs.count > 1 else jax.device_put(params, jax.devices()[0]))
        return hellaswag.score(params, model_config, items, ops=ops, dtype=dtype)

    return hellaswag_scores
