"""`train`: a new run, or one resumed bit for bit from its latest checkpoint.

cmd_train settles the settings and the run folder, opens the data (blujax.data), takes the
state to train from (blujax.startup), builds the steps, the evaluation hooks and the sinks of
the records (metrics.jsonl, loss.png, the progress display), and blujax.loop runs the steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from blujax import (data, hellaswag, loop, metrics, model, processes, runs, sharding,
                    startup)
from blujax.checkpoint import Checkpointer
from blujax.cli import report, run
from blujax.cli.generate import (data_tokenizer, encode, generate_text, hellaswag_items,
                                 load_pretrained, text_tokenizer)
from blujax.cli.settings import (SAMPLE_PROMPT, USER_ERRORS, TrainSettings, UsageError,
                                 check_process_flags, check_settings, model_preset,
                                 resolve_train_settings, run_model_config, setting_warnings,
                                 training_config)
from blujax.data import tokenizer as tokenizer_lib
from blujax.model import ops as model_ops
from blujax.train import (batch_sharding, gather, local_copy, make_eval_step, make_train_step,
                          peak_flops)

EXIT_INTERRUPTED = 130


@dataclasses.dataclass
class _Run:
    """What the set-up settles."""

    out: Path
    s: TrainSettings
    saved: dict | None          # the config.json of the run resumed
    model_config: Any
    pretrained: Any             # the interop.Pretrained fine-tuned, or None
    stop_after: int
    tokenizer: Any = None       # the model's (blujax.data.Tokenizer); None: it has none
    data_tokenizer: Any = None  # what --data is tokenized with or checked against
    source: data.DataSource | None = None
    loader: data.DataLoader | None = None
    val: list = dataclasses.field(default_factory=list)
    items: list | None = None   # HellaSwag's, at every validation
    mesh: Any = None
    checkpointer: Checkpointer | None = None
    folder: runs.RunFolder | None = None  # the lead's hold on --out
    description: dict | None = None  # config.json's content (the lead's), which every
    #                                  checkpoint keeps too, so a lost config.json comes back


def cmd_train(args) -> int:
    try:
        return _train(args)
    except KeyboardInterrupt:  # Ctrl-C in the set-up, or a second one in the loop: at once
        out = Path(args.out or "out")
        try:
            where = runs.where_it_stands(out)
        except OSError:
            where = f"see {out}"
        report.warn(f"interrupted: {where}")
        return EXIT_INTERRUPTED


def _train(args) -> int:
    check_process_flags(args)
    # First of all: with several processes, jax.distributed must start before anything asks
    # JAX for its devices (the settings' defaults do).
    procs = processes.start(args.coordinator, args.num_processes, args.process_id,
                            errors=USER_ERRORS, init_timeout=args.init_timeout)
    with contextlib.ExitStack() as held:  # the folder's lock and the loader, until the end
        r = _settle(args, procs, held)
        if r is None:
            return 0
        with procs.together():
            _open_data(r, args, procs, held)
        start = startup.initial_state(
            r.model_config, training_config(r.s), key=jax.random.key(r.s.seed),
            ops=model_ops.get(r.s.ops), mesh=r.mesh, shard_optimizer=r.s.zero,
            checkpoints=runs.checkpoint_dir(r.out) if args.resume else None,
            params=r.pretrained and r.pretrained.params, processes=procs,
            extras={"sample_key": jax.random.fold_in(jax.random.key(r.s.seed), 1)},
            warn=report.warn if procs.lead else None)
        with procs.together():
            records = _continue(r, start, report.warn if procs.lead else None) \
                if args.resume else []
        _open_checkpoints(r, args, procs, held)
        _write_config(r, start, records, procs)
        state, stop = _loop(r, start, records, args, procs)
        return _finish(r, state, stop, start.extras["sample_key"], records, procs)


def _settle(args, procs: processes.Processes, held: contextlib.ExitStack) -> _Run | None:
    """The settings, the model and the run folder; None when there is nothing to train."""
    out = Path(args.out or "out")
    if args.resume and args.overwrite:
        raise UsageError("--resume and --overwrite contradict each other: pick one")
    with procs.together():
        # One run per folder (the other processes share the lead's); a --resume of a folder
        # that is not there fails below without making it.
        folder = None
        if procs.lead and not (args.resume and not out.is_dir()):
            folder = held.enter_context(runs.RunFolder(out))
        saved = runs.load_run(out, warn=report.warn) if args.resume else None
        s = resolve_train_settings(args, saved)
        pretrained = None
        if saved is not None:
            model_config = run_model_config(saved)
            tokenizer = runs.run_tokenizer(out, saved, model_config)
        elif s.init_from is not None:  # fine-tuning: the model is the weights'
            pretrained = load_pretrained(s.init_from)
            model_config, tokenizer = pretrained.config, pretrained.tokenizer
            s.model = pretrained.source.get("name") or Path(s.init_from).name
        else:
            model_config, tokenizer = model_preset(s.model), tokenizer_lib.gpt2()
        if saved is None and args.remat is None:  # large models recompute by default
            s.remat = model.default_remat(model_config)
        check_settings(s, model_config)
        stop_after = s.steps if args.stop_after is None else args.stop_after
        if not 1 <= stop_after <= s.steps:
            raise UsageError(f"--stop-after {stop_after} must lie in [1, --steps {s.steps}]")
        if args.profile and procs.lead:
            loop.check_profile(args.profile)
        r = _Run(out, s, saved, model_config, pretrained, stop_after, tokenizer, folder=folder)
        r.data_tokenizer = data_tokenizer(s.data, tokenizer, model_config,
                                          f"--data {s.data or '(the default corpus)'}: the "
                                          f"model {s.model}")
        todo = run.has_steps_to_train(out, args, s, saved, stop_after, procs.lead)
        if todo and procs.lead:  # first and alone: it may tokenize --data into a cache
            r.source = data.resolve(s.data, tokenizer=r.data_tokenizer,
                                    progress=_progress(args, procs))
    procs.same(todo, "whether there is training to do in --out (it must be one folder that "
                     "every process sees)")
    return r if todo else None


def _open_data(r: _Run, args, procs: processes.Processes, held: contextlib.ExitStack):
    """The training loader (every shard's tokens checked), the validation batches, HellaSwag's
    items and the mesh."""
    s, vocab = r.s, r.model_config.vocab_size
    if r.data_tokenizer is not None:
        # A model larger than its tokenizer (llama-8b's 128256 rows on GPT-2's 50257 tokens):
        # shards with ids past the tokenizer's were made by another one.
        vocab = min(vocab, r.data_tokenizer.vocab_size)
    if r.source is None:  # the other processes, from the lead's cache
        r.source = data.resolve(s.data, tokenizer=r.data_tokenizer)
    r.loader = held.enter_context(_open_loader(s, r.source, r.saved, vocab))
    # Every shard's tokens, before step 1: a bad token hours into a run would stop it where
    # nothing can be done about it.
    if procs.lead and len(r.loader.counts) > 4:
        print(f"checking the tokens of {len(r.loader.counts)} training shards", flush=True)
    r.loader.check_all()
    # One device: the single-device step. Several: the sharded step over a mesh of them.
    devices = sharding.mesh_devices(s.dp, s.tp, s.cp, fsdp=s.fsdp)
    r.mesh = (sharding.make_mesh(s.dp, s.tp, s.cp, devices=devices, fsdp=s.fsdp)
              if len(devices) > 1 else None)
    if s.eval_every:
        val = data.val_batches(r.source.val, batch=s.batch, seq=s.seq,
                               max_batches=s.eval_batches, rows_multiple=s.batch_shards,
                               vocab_size=vocab)
        if r.source.val and not val and procs.lead:
            report.warn(f"warning: the validation split of {r.source.description} is shorter "
                        f"than {loop.plural(s.batch_shards, 'sequence')} of --seq {s.seq}: no "
                        f"validation loss")
        where = None if r.mesh is None else NamedSharding(r.mesh, P(sharding.BATCH_AXES))
        r.val = [tuple(procs.global_array(a, where) for a in b) for b in val]
    if s.hellaswag is not None and s.eval_every:
        r.items = hellaswag_items(text_tokenizer(r.tokenizer, r.model_config,
                                                 f"HellaSwag: the model {s.model}"), s.hellaswag,
                                  progress=_progress(args, procs))
    if procs.lead:
        for line in _warnings(r):
            report.warn(line)


def _warnings(r: _Run) -> list[str]:
    """The warnings of settings that would train, but not as meant."""
    s, prompt = r.s, None
    try:
        prompt = len(encode(tokenizer_lib.for_text(r.tokenizer, r.model_config.vocab_size,
                                                   "the model"), SAMPLE_PROMPT))
    except (data.DataError, UsageError):
        pass  # no samples: _finish says so
    return setting_warnings(s, r.model_config, description=r.source.description,
                            val=bool(r.source.val), train_tokens=sum(r.loader.counts),
                            epochs=s.steps / r.loader.batches_per_epoch, prompt_tokens=prompt)


def _open_checkpoints(r: _Run, args, procs: processes.Processes, held: contextlib.ExitStack):
    """A new run's folder cleared of an earlier run's files (--overwrite), once nothing in the
    set-up can fail any more, and (the lead's) checkpointer. Process 0 alone writes
    checkpoints (the others only take part in gathering them), and finds out now whether it
    can, not at the first save."""
    if procs.lead:
        if not args.resume:
            r.folder.start_fresh()
        r.checkpointer = held.enter_context(Checkpointer(runs.checkpoint_dir(r.out), keep=3))
        r.checkpointer.check_writable()


def _open_loader(s: TrainSettings, source: data.DataSource, saved: dict | None,
                 vocab_size: int) -> data.DataLoader:
    """The training data loader; resuming, over the same shards as the run's."""
    counts, need = [data.read_header(p) for p in source.train], s.batch * s.seq + 1
    if max(counts) < need:
        raise UsageError(
            f"too few tokens for one batch: --batch {s.batch} x --seq {s.seq} needs {need} "
            f"tokens in one shard, and the largest training shard has {max(counts)} "
            f"({source.description}); lower --batch or --seq, or give more text")
    # Whole batches, on every process (see loop.run).
    loader = data.DataLoader(source.train, None, batch_size=s.batch, seq_len=s.seq,
                             seed=s.seed, process_index=0, process_count=1, vocab_size=vocab_size)
    if saved is not None and not loader.same_shards(saved["data"]["fingerprint"]):
        loader.close()
        raise UsageError(f"--resume: the training data differs from the run's (other tokens, "
                         f"under any file names); the run used {saved['data']['description']}")
    return loader


def _continue(r: _Run, start: startup.Start, warn) -> list[dict]:
    """A resumed run: the loader where the checkpoint left it, the records up to it."""
    if start.restored is None:  # deleted since it was found
        raise UsageError(f"--resume: {r.out} holds no checkpoint to continue from")
    try:
        r.loader.load_state(start.restored.loader)
    except ValueError as e:
        raise UsageError(f"--resume: {e}") from None
    # Steps after the checkpoint were lost with the run that made them.
    return [rec for rec in metrics.read_metrics(r.out / "metrics.jsonl", warn)
            if rec["step"] <= start.restored.step]


def _write_config(r: _Run, start: startup.Start, records: list[dict], procs: processes.Processes):
    """config.json and metrics.jsonl (the records so far), and the line that says what trains
    where."""
    s, resumed = r.s, start.restored
    extension = resumed and run.extension(r.saved, s, resumed.step)
    if not procs.lead:
        return
    init_from = r.pretrained.source if r.pretrained else r.saved and r.saved.get("init_from")
    config = run.describe_run(s, r.model_config, training_config(s), start.state.params,
                              r.source, r.loader, procs.count, init_from=init_from,
                              tokenizer=r.tokenizer)
    if resumed:
        config["extensions"] = r.saved.get("extensions", []) + ([extension] if extension else [])
        report.note_mesh_change(r.saved["settings"], s)
        if extension:
            report.note_extension(extension, s)
    r.description = config
    try:
        runs.save_tokenizer(r.out, r.tokenizer)
        runs.write_json(runs.config_path(r.out), config)
        metrics.write_metrics(r.out / "metrics.jsonl", records)
    except OSError as e:
        raise runs.write_error(r.out, e) from None
    print(report.header(s, r.model_config, config, r.source, sum(r.loader.counts),
                        procs.count, resumed and resumed.step, r.out), flush=True)


def _loop(r: _Run, start: startup.Start, records: list[dict], args, procs: processes.Processes):
    """blujax.loop.run over the steps, with the evaluations and the sinks: (state, stop)."""
    s, config, mesh = r.s, r.model_config, r.mesh
    ops, tcfg = model_ops.get(s.ops), training_config(s)
    evals = [loop.val_loss_hook(make_eval_step(config, tcfg, ops, mesh), r.val)] if r.val else []
    if r.items:  # on one device in the model's layout; every process scores all items itself
        evals.append(lambda step, state: hellaswag.score(
            local_copy(state.params, mesh), config, r.items, ops=ops, dtype=tcfg.compute_dtype))
    peak = peak_flops(jax.devices()[0], s.dtype)
    settings = loop.LoopConfig(
        steps=s.steps, stop_after=r.stop_after, save_every=s.save_every,
        save_seconds=s.save_minutes * 60,
        eval_every=s.eval_every, accum=s.accum, profile=args.profile,
        flops_per_token=model.family_of(config).flops_per_token(config, s.seq),
        peak_flops=peak and peak * s.n_devices)
    bar = metrics.Progress(int(start.state.step), s.steps, _progress(args, procs),
                           every=max(1, s.steps // 20), tokens_per_step=s.batch * s.seq,
                           flops_per_token=settings.flops_per_token, peak=settings.peak_flops)
    plot = metrics.LossPlot(r.out / "loss.png", report.plot_title(s, config), records)
    with procs.fail_fast():  # an error on one process stops all of them
        with bar:
            state, stop = loop.run(
                start.state, make_train_step(config, tcfg, ops, mesh, shard_optimizer=s.zero),
                r.loader, settings, checkpointer=r.checkpointer, extras=start.extras,
                # Checkpoints keep the single-device layout, whatever the mesh.
                checkpoint_state=None if mesh is None else gather,
                checkpoint_config=r.description, evals=evals,
                sinks=[metrics.MetricsFile(r.out / "metrics.jsonl"), bar, plot],
                processes=procs, batch_sharding=batch_sharding(mesh), note=bar.write)
        if r.checkpointer is not None:
            r.checkpointer.wait()  # the last save's error, if any, is this command's
    if procs.lead and stop.error is None:
        _after_steps(r, int(state.step), "drawing loss.png", plot.draw)
    elif procs.lead and not isinstance(stop.error, loop.SideFailure):
        with contextlib.suppress(Exception):  # the error under way is the one to tell
            plot.draw()
    return state, stop


def _finish(r: _Run, state, stop: loop.Stop, sample_key, records: list[dict],
            procs: processes.Processes) -> int:
    """The run's end: its error, where to continue, or a summary and samples."""
    s, last = r.s, int(state.step)
    if isinstance(stop.error, loop.NonFiniteError):
        raise UsageError(f"{stop.error}; a lower --lr or a longer --warmup may help")
    if isinstance(stop.error, loop.SideFailure):
        raise UsageError(f"{stop.error}; " + (f"continue with: train --resume --out {r.out}"
                                              if stop.error.saved else
                                              runs.where_it_stands(r.out)))
    if stop.error is not None:
        raise stop.error
    if last < s.steps:
        if procs.lead:
            print(f"stopped after step {last} of {s.steps}; checkpoint saved in "
                  f"{runs.checkpoint_dir(r.out)}. Continue with: train --resume --out {r.out}",
                  flush=True)
        return EXIT_INTERRUPTED if stop.reason == loop.SIGNAL else 0
    if procs.lead:
        print(report.summary(records, last, r.out), flush=True)
    if not s.sample_tokens:
        return 0
    try:
        tokenizer = tokenizer_lib.for_text(r.tokenizer, r.model_config.vocab_size, "the model")
    except data.DataError as e:
        if procs.lead:
            report.warn(f"note: no samples: {e}")
        return 0
    params = local_copy(state.params, r.mesh)  # a collective: every process gathers them
    if procs.lead:
        n = min(s.sample_tokens,
                r.model_config.block_size - len(encode(tokenizer, SAMPLE_PROMPT)))
        _after_steps(r, last, "sampling", _sample, r, params, tokenizer, n, sample_key)
    return 0


def _sample(r: _Run, params, tokenizer, n: int, sample_key):
    """Two samples of n tokens after SAMPLE_PROMPT, printed and in samples.txt."""
    texts = generate_text(params, r.model_config, tokenizer, model_ops.get(r.s.ops), r.s.dtype,
                          SAMPLE_PROMPT, key=sample_key, max_new_tokens=n, temperature=1.0,
                          top_k=40, num_samples=2)
    text = "".join(f"--- sample {i + 1} ---\n{t}\n" for i, t in enumerate(texts))
    (r.out / "samples.txt").write_text(text)
    print(text, end="")


def _after_steps(r: _Run, last: int, what: str, f, *args):
    """f(*args), after the last step and its checkpoint: its failure, whatever it is, is one
    line that says so and where the run stands."""
    try:
        return f(*args)
    except Exception as e:
        raise UsageError(f"{what} failed after step {last} ({loop.one_line(e)}); "
                         f"{runs.where_it_stands(r.out)}") from None


def _progress(args, procs: processes.Processes) -> bool:  # on the lead's terminal only
    return not args.no_progress and procs.lead
