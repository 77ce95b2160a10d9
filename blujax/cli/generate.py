"""`eval` and `sample`: a model's validation loss and HellaSwag score, and text from it. The
model is a run's latest checkpoint (--out) or pretrained weights (--init-from).
generate_text is also what `train` samples with at the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from blujax import data, evaluate, hellaswag, interop, sample
from blujax.loop import plural
from blujax.cli import run
from blujax.cli.settings import (TrainSettings, UsageError, check_counts, check_number,
                                 defaults, on_accelerator, training_config)
from blujax.data import tokenizer as tokenizer_lib
from blujax.data.sources import TEXT
from blujax.data.tokenizer import Tokenizer
from blujax.model import family_of
from blujax.model import ops as model_ops
from blujax.train import DTYPES, make_eval_step


@dataclasses.dataclass
class Model:
    """What eval and sample run: a run's latest parameters, or pretrained ones."""

    config: Any                # a model family's config
    params: dict
    name: str                  # "step 6 of runs/a", or the pretrained source
    ops: str                   # the run's, else ffi
    dtype: str                 # the run's, else this machine's default
    tokenizer: Tokenizer | None = None      # the model's; None: it has none (token shards)
    settings: TrainSettings | None = None   # the run's; None for pretrained weights
    step: int | None = None

    def text_tokenizer(self, what: str) -> Tokenizer:
        """The tokenizer `what` (text, a prompt) reaches the model through."""
        return text_tokenizer(self.tokenizer, self.config, f"{what}: the model {self.name}")


def load_model(args) -> Model:
    """The model of `--out RUN` (its latest checkpoint that verifies, parameters only) or of
    `--init-from SRC`; --ops and --dtype where given override the run's."""
    if args.init_from is not None:
        if args.out is not None:
            raise UsageError("--out and --init-from name two models: give one")
        pre = load_pretrained(args.init_from)
        model = Model(pre.config, jax.device_put(pre.params), args.init_from, "ffi",
                      defaults(on_accelerator())["dtype"], pre.tokenizer)
    else:
        out = Path(args.out or "out")
        config, s, restored, tokenizer = run.latest_params(out)
        model = Model(config, restored.tree["params"], f"step {restored.step} of {out}", s.ops,
                      s.dtype, tokenizer, s, restored.step)
    model.ops = args.ops or model.ops
    model.dtype = args.dtype or model.dtype
    return model


def load_pretrained(src) -> interop.Pretrained:
    """--init-from SRC: pretrained weights (blujax.interop.load_pretrained), or a blujax run
    folder's latest checkpoint, its parameters (fine-tuning one's own model) and tokenizer."""
    folder = Path(src)
    if (folder / "config.json").is_file() and "settings" in _json_keys(folder / "config.json"):
        config, s, restored, tokenizer = run.latest_params(folder)
        return interop.Pretrained(
            family_of(config).NAME, config, jax.device_get(restored.tree["params"]),
            {"kind": "run", "path": str(folder), "name": s.model, "step": restored.step},
            tokenizer)
    return interop.load_pretrained(src)


def _json_keys(path: Path) -> set:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return set()  # interop says what is wrong with it
    return set(value) if isinstance(value, dict) else set()


def cmd_eval(args) -> int:
    model = load_model(args)
    ops = model_ops.get(model.ops)
    s = model.settings
    check_counts({"--batch": args.batch, "--seq": args.seq}, 1)
    check_counts({"--eval-batches": args.eval_batches}, 0)
    if args.data is None and s is None and args.hellaswag is None:
        raise UsageError("nothing to evaluate: give --data FILE (a validation loss) or "
                         "--hellaswag [FILE] with --init-from")
    seq = args.seq or (s.seq if s else min(model.config.block_size, 1024))
    if seq > model.config.block_size:
        raise UsageError(f"--seq {seq} is longer than the model's context (block_size "
                         f"{model.config.block_size})")
    result = {"model": model.name, "ops": model.ops, "dtype": model.dtype}
    if model.step is not None:
        result["step"] = model.step
    if args.data is not None:
        # Whatever the model: all of --data unless --eval-batches says otherwise, so that the
        # same weights give the same number from a run and from its export.
        batch, k = args.batch or (s.batch if s else 8), args.eval_batches or 0
        tokens, description = data.eval_tokens(
            args.data, tokenizer=data_tokenizer(args.data, model.tokenizer, model.config,
                                                f"--data {args.data}: the model {model.name}"),
            progress=not args.no_progress)
        try:
            loss = evaluate.evaluate_loss(model.params, model.config, tokens, batch=batch,
                                          seq=seq, max_batches=k or None, ops=ops,
                                          dtype=DTYPES[model.dtype])
        except ValueError as e:
            raise UsageError(f"--data {args.data}: {e}") from None
        result.update(loss, data=description,
                      which=("every batch" if not k else "the first batch" if k == 1
                             else f"the first {k:,} batches"))
    elif s is not None:  # the run's own validation batches: what its val_loss measured
        result.update(_run_val_loss(model, ops, args), data=s.data)
    if args.hellaswag is not None:
        items = hellaswag_items(model.text_tokenizer("HellaSwag"), args.hellaswag,
                                progress=not args.no_progress)
        result.update(hellaswag.score(model.params, model.config, items, ops=ops,
                                      dtype=DTYPES[model.dtype]))
    parts = [f"{model.name}:"]
    if "val_loss" in result:
        parts.append(f"val loss {result['val_loss']:.4f} ({result['which']}: "
                     f"{plural(result['batches'], 'batch', 'batches')} of {result['batch']} x "
                     f"{result['seq']}, {plural(result['tokens'], 'token')})")
    if "hellaswag_acc" in result:
        parts.append(f"HellaSwag acc {result['hellaswag_acc']:.4f}, acc_norm "
                     f"{result['hellaswag_acc_norm']:.4f} ({result['hellaswag_n']} items)")
    print(" ".join(parts) + f"; {model.ops} ops, {model.dtype}")
    if args.json is not None:
        write_atomic(Path(args.json), json.dumps(result, indent=1) + "\n", "--json")
    return 0


def write_atomic(path: Path, text: str, flag: str):
    """text into path whole or not at all (a full disk leaves no empty file), written through
    a symbolic link; a UsageError naming the flag otherwise."""
    target = path.resolve() if path.is_symlink() else path
    tmp = target.with_name(f".{target.name}.tmp")
    try:
        if target.exists() and not target.is_file():
            raise UsageError(f"{flag} {path}: not a regular file")
        tmp.write_text(text)
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UsageError(f"cannot write {flag} {path}: {e.strerror or e}") from None


def _run_val_loss(model: Model, ops, args) -> dict:
    """A run's validation loss as it measured it during training (its split, batch and seq
    unless --batch / --seq / --eval-batches say otherwise)."""
    s = dataclasses.replace(model.settings, dtype=model.dtype)
    s.batch, s.seq = args.batch or s.batch, args.seq or s.seq  # seq checked by cmd_eval
    source = data.resolve(s.data, progress=not args.no_progress, tokenizer=data_tokenizer(
        s.data, model.tokenizer, model.config, f"the run's data: the model {model.name}"))
    if not source.val:
        raise UsageError(f"{source.description} has no validation split (shards named "
                         f"*_val_*.bin): nothing to evaluate on")
    n = s.eval_batches if args.eval_batches is None else args.eval_batches
    batches = data.val_batches(source.val, batch=s.batch, seq=s.seq, max_batches=n or None,
                               vocab_size=model.config.vocab_size)
    if not batches:
        raise UsageError(f"the validation split of {source.description} is too short for one "
                         f"sequence of {s.seq} tokens")
    eval_step = make_eval_step(model.config, training_config(s), ops=ops)
    loss = float(np.mean(jax.device_get([eval_step(model.params, x, y) for x, y in batches])))
    which = (f"the run's validation batches, --eval-batches {n}" if n
             else "the run's validation split, every batch")
    return {"val_loss": loss, "which": which, "batches": len(batches),
            "batch": int(batches[0][0].shape[0]),
            "seq": s.seq, "tokens": sum(int(x.size) for x, _ in batches)}


def data_tokenizer(spec, tokenizer: Tokenizer | None, config, where: str) -> Tokenizer | None:
    """The tokenizer the data `spec` names must be made with: text (and the default corpus,
    None) is tokenized with the model's, or GPT-2's where it has none (tokenizer_lib.for_text);
    token shards are checked against the model's tokenizer, if it has one."""
    if spec is None or data.locate(spec)[0] == TEXT:
        return text_tokenizer(tokenizer, config, where)
    return tokenizer


def text_tokenizer(tokenizer: Tokenizer | None, config, where: str) -> Tokenizer:
    """tokenizer_lib.for_text, its refusal a UsageError."""
    try:
        return tokenizer_lib.for_text(tokenizer, config.vocab_size, where)
    except data.DataError as e:
        raise UsageError(str(e)) from None


def hellaswag_items(tokenizer: Tokenizer, path: str, *, progress: bool) -> list:
    """HellaSwag's items in `path` ("": the official validation set, downloaded once),
    tokenized with the model's tokenizer."""
    return hellaswag.load_items(path or hellaswag.default_path(progress=progress),
                                tokenizer=tokenizer)


def cmd_sample(args) -> int:
    check_counts({"--num-samples": args.num_samples}, 1)
    check_counts({"--max-new-tokens": args.max_new_tokens}, 0)
    check_number("--temperature", args.temperature, low=0)
    model = load_model(args)
    config = model.config
    tokenizer = model.text_tokenizer("--prompt")
    if not 0 <= args.top_k <= config.vocab_size:
        raise UsageError(f"--top-k must lie in [0, {config.vocab_size}], got {args.top_k}")
    top_k = args.top_k or None
    prompt = encode(tokenizer, args.prompt)
    if not prompt:
        raise UsageError("--prompt is empty: give at least one token of text")
    if len(prompt) + args.max_new_tokens > config.block_size:
        raise UsageError(f"the prompt ({plural(len(prompt), 'token')}) and --max-new-tokens "
                         f"{args.max_new_tokens} exceed the model's block_size "
                         f"({config.block_size})")
    seed = 0 if args.seed is None else args.seed
    texts = generate_text(model.params, config, tokenizer, model_ops.get(model.ops),
                          model.dtype, args.prompt, key=jax.random.key(seed),
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_k=top_k, num_samples=args.num_samples)
    print(f"# {model.name}, seed {seed}, temperature {args.temperature}, "
          f"top-k {top_k or 'off'}")
    for i, text in enumerate(texts):
        print(f"--- sample {i + 1} ---\n{text}")
    return 0


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """The tokens of `text`; a tokenizer that cannot load is a UsageError."""
    try:
        return tokenizer.encode(text)
    except data.DataError as e:
        raise UsageError(str(e)) from None


def generate_text(params, model_config, tokenizer: Tokenizer, ops, dtype: str, prompt: str, *,
                  key, max_new_tokens, temperature, top_k, num_samples) -> list[str]:
    """num_samples continuations of `prompt`, decoded: each ends before the first of the
    tokenizer's stop tokens it generates (tokens past the tokenizer's vocabulary, which the
    padded embedding allows, are dropped)."""
    ids = encode(tokenizer, prompt)
    tokens = sample.generate(params, jnp.asarray([ids] * num_samples, jnp.int32),
                             config=model_config, key=key, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_k=top_k, ops=ops, dtype=DTYPES[dtype])
    return [tokenizer.decode(until_stop(row, len(ids), tokenizer.stop_tokens))
            for row in np.asarray(tokens).tolist()]


def until_stop(row: list[int], start: int, stop_tokens) -> list[int]:
    """row up to (not including) the first stop token at or after `start`."""
    for i in range(start, len(row)):
        if row[i] in stop_tokens:
            return row[:i]
    return row
