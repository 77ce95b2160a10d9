"""`eval` and `sample`: the validation loss of a run's latest checkpoint, and text from it.
generate_text is also what `train` samples with at the end.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from blujax import data, sample
from blujax.cli import report
from blujax.cli.corpus import resolve_data, val_batches
from blujax.cli.run import load_run, restore_latest
from blujax.cli.settings import (TrainSettings, UsageError, check_number, model_preset,
                                 training_config)
from blujax.model import ops as model_ops
from blujax.train import DTYPES, make_eval_step


def cmd_eval(args) -> int:
    out = Path(args.out)
    run = load_run(out)
    s = TrainSettings(**run["settings"])
    if args.data is not None:
        s.data = args.data
    ops_name = args.ops or s.ops
    ops = model_ops.get(ops_name)
    model_config = model_preset(s.model)
    if args.batch is not None:
        if args.batch < 1:
            raise UsageError(f"--batch must be at least 1, got {args.batch}")
        s.batch = args.batch
    source = resolve_data(s.data, progress=not args.no_progress)
    if not source.val:
        raise UsageError(f"{source.description} has no validation split (shards named "
                         f"*_val_*.bin): nothing to evaluate on")
    n = s.eval_batches if args.eval_batches is None else args.eval_batches
    if n < 0:
        raise UsageError(f"--eval-batches must be >= 0, got {n}")
    batches = val_batches(source, s.batch, s.seq, n or None)
    if not batches:
        raise UsageError(f"the validation split of {source.description} is too short for one "
                         f"sequence of {s.seq} tokens")
    restored = restore_latest(out, s, ops, params_only=True, warn=report.warn)
    eval_step = make_eval_step(model_config, training_config(s), ops=ops)
    params = restored.tree["params"]
    loss = float(np.mean(jax.device_get([eval_step(params, x, y) for x, y in batches])))
    tokens = sum(int(x.size) for x, _ in batches)
    print(f"step {restored.step}: val loss {loss:.4f} ({len(batches)} batches, {tokens:,} "
          f"tokens, {ops_name} ops, {s.dtype})")
    return 0


def cmd_sample(args) -> int:
    out = Path(args.out)
    run = load_run(out)
    s = TrainSettings(**run["settings"])
    model_config = model_preset(s.model)
    ops = model_ops.get(args.ops or s.ops)
    if args.num_samples < 1:
        raise UsageError(f"--num-samples must be at least 1, got {args.num_samples}")
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    check_number("--temperature", args.temperature, low=0)
    if not 0 <= args.top_k <= model_config.vocab_size:
        raise UsageError(f"--top-k must lie in [0, {model_config.vocab_size}], got {args.top_k}")
    top_k = args.top_k or None
    prompt = encode(args.prompt)
    if not prompt:
        raise UsageError("--prompt is empty: give at least one token of text")
    if len(prompt) + args.max_new_tokens > model_config.block_size:
        raise UsageError(f"the prompt ({len(prompt)} tokens) and --max-new-tokens "
                         f"{args.max_new_tokens} exceed the model's block_size "
                         f"({model_config.block_size})")
    restored = restore_latest(out, s, ops, params_only=True, warn=report.warn)
    texts = generate_text(restored.tree["params"], model_config, ops, s.dtype, args.prompt,
                          key=jax.random.key(args.seed), max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature, top_k=top_k,
                          num_samples=args.num_samples)
    print(f"# step {restored.step} of {out}, seed {args.seed}, temperature {args.temperature}, "
          f"top-k {top_k or 'off'}")
    for i, text in enumerate(texts):
        print(f"--- sample {i + 1} ---\n{text}")
    return 0


def encode(text: str) -> list[int]:
    """GPT-2's tokens of `text`; a tokenizer that cannot load is a UsageError."""
    try:
        return data.get_encoding("gpt2").encode_ordinary(text)
    except RuntimeError as e:
        raise UsageError(str(e)) from None


def generate_text(params, model_config, ops, dtype: str, prompt: str, *, key, max_new_tokens,
                  temperature, top_k, num_samples) -> list[str]:
    """num_samples continuations of `prompt`, decoded (tokens past GPT-2's vocabulary, which
    the padded embedding allows, are dropped)."""
    enc = data.get_encoding("gpt2")
    ids = enc.encode_ordinary(prompt)
    tokens = sample.generate(params, jnp.asarray([ids] * num_samples, jnp.int32),
                             config=model_config, key=key, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_k=top_k, ops=ops,
                             dtype=DTYPES[dtype])
    return [enc.decode([t for t in row if t < enc.n_vocab]) for row in np.asarray(tokens)]
