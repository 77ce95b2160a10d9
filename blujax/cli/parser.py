"""The command line's flags: `train`, `eval` and `sample`, each flag with what it does and its
default. Training flags default to None, so that settings.resolve_train_settings can tell a
flag given from one left out (which takes the default, or a resumed run's own value).
"""

from __future__ import annotations

import argparse

from blujax import evaluate
from blujax.cli.settings import SAMPLE_PROMPT, defaults
from blujax import model


def build_parser() -> argparse.ArgumentParser:
    cpu, gpu = defaults(False), defaults(True)

    def both(key, fmt="{}"):
        a, b = fmt.format(cpu[key]), fmt.format(gpu[key])
        return a if a == b else f"{a} on a CPU, {b} on a GPU"

    parser = argparse.ArgumentParser(
        prog="gpt2.py",
        description="Train GPT-2 or Llama models on blujax's kernels, evaluate them, sample "
                    "from them, export them. With no command, `train` runs with its "
                    "defaults: a small model on tinyshakespeare for a few minutes on a CPU, "
                    "GPT-2 124M in bf16 on a GPU.",
        epilog="Run `gpt2.py COMMAND --help` for each command's flags.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    t = commands.add_parser(
        "train", help="train a model (the default command)",
        description="Train a model (GPT-2 or Llama: --model). Writes config.json, "
                    "metrics.jsonl (one JSON object per step), loss.png, ckpt/ and "
                    "samples.txt into --out. Flags left out take their defaults, or with "
                    "--resume the run's own values.")
    t.add_argument("--data", metavar="PATH_OR_GLOB",
                   help="a text file (tokenized with GPT-2's encoding into FILE.tokens/ "
                        "beside it, or the user cache, once), a directory or glob of llm.c "
                        ".bin shards (split into train/val by '_train_'/'_val_' in their "
                        "names), or one .bin shard (default: tinyshakespeare, from the user "
                        "cache, else $BLUJAX_CORPUS, else downloaded)")
    t.add_argument("--model", help=f"model preset: {', '.join(_preset_names())} "
                                   f"(default: {both('model')})")
    t.add_argument("--init-from", metavar="SRC", help=INIT_FROM_HELP.format(
        what="fine-tune pretrained weights; the model's shape comes from them (no --model)",
        default="a new model of --model, randomly initialised"))
    t.add_argument("--steps", type=int, help=f"optimizer steps; the learning-rate schedule "
                                             f"spans them. With --resume, a new count extends "
                                             f"the run (its schedule then spans the new count "
                                             f"from the checkpoint on; --stop-after keeps it) "
                                             f"(default: {both('steps')})")
    t.add_argument("--batch", type=int,
                   help=f"sequences per optimizer step, over all micro-batches (default: "
                        f"{both('batch')})")
    t.add_argument("--seq", type=int, help=f"tokens per sequence, at most the model's "
                                           f"block_size (default: {both('seq')})")
    t.add_argument("--accum", type=int, help="gradient accumulation: micro-batches per step; "
                                             "must divide --batch (default: 1)")
    t.add_argument("--ops", choices=("ffi", "xla"),
                   help="ffi: blujax's kernels; xla: the same model in plain JAX (default: ffi)")
    t.add_argument("--dtype", choices=("bf16", "f32"),
                   help=f"compute dtype; parameters stay float32 (default: {both('dtype')})")
    t.add_argument("--seed", type=int, help="seed of the initialization, the data order and "
                                            "the samples (default: 0)")
    t.add_argument("--lr", type=float, help=f"peak learning rate, > 0 (default: {both('lr')})")
    t.add_argument("--min-lr-ratio", type=float,
                   help="the cosine decay ends at lr times this, in [0, 1] (default: 0.1)")
    t.add_argument("--warmup", type=int,
                   help="linear warmup steps (default: a tenth of --steps)")
    t.add_argument("--weight-decay", type=float,
                   help="AdamW weight decay of matrices and embeddings, >= 0 (default: 0.1)")
    t.add_argument("--grad-clip", type=float,
                   help="clip the gradient's global norm to this; 0: no clipping "
                        "(default: 1.0)")
    t.add_argument("--remat", action="store_const", const=True,
                   help="recompute each block's activations in the backward pass: less "
                        "memory, more compute (default: off)")
    t.add_argument("--dp", type=int,
                   help="data parallelism: each optimizer step's (micro-)batch splits over "
                        "this many devices; must divide --batch / --accum (default: 1)")
    t.add_argument("--tp", type=int,
                   help="tensor parallelism (Megatron, sequence-parallel): the heads, MLP and "
                        "vocabulary split over this many devices; must divide the model's "
                        "heads (default: 1)")
    t.add_argument("--cp", type=int,
                   help="context parallelism (ring attention): each sequence splits over "
                        "this many devices; 2 x cp must divide --seq (default: 1)")
    t.add_argument("--zero", action=argparse.BooleanOptionalAction,
                   help="ZeRO-1: split AdamW's moments over the --dp devices, each updating "
                        "its share of the parameters (default: off). The run uses the first "
                        "dp x tp x cp devices JAX sees; with --resume, a checkpoint continues "
                        "on any mesh (equal up to rounding; bit for bit on the same mesh)")
    t.add_argument("--num-processes", type=int, metavar="N",
                   help="train one run in N processes, one per host, each started with this "
                        "command and its own --process-id: the mesh then spans the devices "
                        "of all of them, and dp x tp x cp must equal their count. Every "
                        "process reads the same data (--data on each host); process 0 alone "
                        "writes --out and prints; --resume needs --out on a folder all "
                        "processes see (default: $BLUJAX_NUM_PROCESSES, else 1)")
    t.add_argument("--process-id", type=int, metavar="I",
                   help="this process's index in [0, --num-processes) (default: "
                        "$BLUJAX_PROCESS_ID, else what JAX detects under SLURM or Open MPI)")
    t.add_argument("--coordinator", metavar="HOST:PORT",
                   help="with --num-processes: the address of process 0's host and a free "
                        "port there, where every process meets (default: "
                        "$BLUJAX_COORDINATOR, else what JAX detects under SLURM or Open MPI)")
    t.add_argument("--eval-every", type=int,
                   help="measure the validation loss every this many steps, and at the end; "
                        "0: never (default: a tenth of --steps)")
    t.add_argument("--hellaswag", nargs="?", const="", metavar="FILE",
                   help="also score HellaSwag at every validation (--eval-every): the official "
                        "validation jsonl FILE, or without FILE that set downloaded once into "
                        "the user cache; into metrics.jsonl, the progress line and loss.png "
                        "(default: off)")
    t.add_argument("--eval-batches", type=int,
                   help=f"validation batches per measurement, the split's first ones "
                        f"(default: {both('eval_batches')})")
    t.add_argument("--save-every", type=int,
                   help="checkpoint every this many steps; 0: only at the end (default: 0). "
                        "The last 3 are kept")
    t.add_argument("--sample-tokens", type=int,
                   help=f"at the end, sample this many tokens after \"{SAMPLE_PROMPT}\"; 0: "
                        f"no samples (default: 64)")
    t.add_argument("--out", default="out",
                   help="folder for the run's files and checkpoints (default: out)")
    t.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its latest checkpoint, bit for bit as "
                        "if it had not stopped; settings that change the numbers must stay "
                        "the same (default: start a new run)")
    t.add_argument("--overwrite", action="store_true",
                   help="start again in an --out that already holds a run, deleting its "
                        "checkpoints and metrics (default: refuse, and say so)")
    t.add_argument("--stop-after", type=int, metavar="STEP",
                   help="end this run after step STEP (saving a checkpoint) without changing "
                        "the schedule of --steps; continue later with --resume (default: "
                        "run to --steps)")
    t.add_argument("--profile", metavar="DIR",
                   help="write a jax.profiler trace of 3 steps, after 3 warm-up steps, into "
                        "DIR (view with TensorBoard or Perfetto); with several processes, "
                        "process 0's (default: no trace)")
    t.add_argument("--no-progress", action="store_true",
                   help="no progress bar or progress lines (default: shown)")

    e = commands.add_parser(
        "eval", help="validation loss and HellaSwag score of a run or of pretrained weights",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Evaluate the latest checkpoint of a run (--out) or pretrained weights "
                    "(--init-from): a validation loss, and with --hellaswag the HellaSwag "
                    "accuracy.\n\n" + evaluate.EVAL_DEFINITION + "\n\nWithout --data, a "
                    "run is measured on its own validation batches, as its val_loss was.")
    e.add_argument("--out", help="the run's folder (default: out, unless --init-from)")
    e.add_argument("--init-from", metavar="SRC", help=INIT_FROM_HELP.format(
        what="evaluate pretrained weights instead of a run", default="the run in --out"))
    e.add_argument("--data", metavar="FILE",
                   help="evaluation tokens: a text file (all its tokens), a shard directory or "
                        "glob (its validation split) or one .bin shard (all its tokens) "
                        "(default: the run's validation split)")
    e.add_argument("--seq", type=int, help="T: tokens each row predicts (default: the run's "
                                           "--seq; pretrained: the block size, at most 1024)")
    e.add_argument("--batch", type=int, help="B: rows per batch (default: the run's --batch; "
                                             "pretrained: 8)")
    e.add_argument("--eval-batches", type=int,
                   help="K: batches to evaluate, from the start; 0: all of them (default: the "
                        "run's --eval-batches, so the loss matches its val_loss; pretrained: 0)")
    e.add_argument("--dtype", choices=("bf16", "f32"),
                   help="compute dtype (default: the run's; pretrained: bf16 on a GPU, f32 on "
                        "a CPU)")
    e.add_argument("--ops", choices=("ffi", "xla"), help="kernels (default: the run's, or ffi)")
    e.add_argument("--hellaswag", nargs="?", const="", metavar="FILE",
                   help="also score HellaSwag: the official validation jsonl FILE, or without "
                        "FILE that set downloaded once into the user cache; each ending is "
                        "scored by the sum (acc) and mean (acc_norm) of its tokens' "
                        "cross-entropy given the context, the lowest wins (default: off)")
    e.add_argument("--json", metavar="PATH",
                   help="also write the results as one JSON object to PATH (val_loss, "
                        "batches, tokens, batch, seq, hellaswag_acc, hellaswag_acc_norm, "
                        "hellaswag_n, ...) (default: printed only)")
    e.add_argument("--no-progress", action="store_true",
                   help="no progress bar while tokenizing (default: shown)")

    p = commands.add_parser(
        "sample", help="generate text from the latest checkpoint",
        description="Generate text from the latest checkpoint in --out; the same --seed "
                    "gives the same text.")
    p.add_argument("--out", help="the run's folder (default: out, unless --init-from)")
    p.add_argument("--init-from", metavar="SRC", help=INIT_FROM_HELP.format(
        what="sample from pretrained weights instead of a run", default="the run in --out"))
    p.add_argument("--dtype", choices=("bf16", "f32"),
                   help="compute dtype (default: the run's; pretrained: bf16 on a GPU, f32 on "
                        "a CPU)")
    p.add_argument("--prompt", default=SAMPLE_PROMPT,
                   help=f"text to continue (default: \"{SAMPLE_PROMPT}\")")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens to generate after the prompt (default: 64)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature; 0 picks the most likely token (default: 1.0)")
    p.add_argument("--top-k", type=int, default=40,
                   help="sample among the k most likely tokens only; 0: among all "
                        "(default: 40)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--num-samples", type=int, default=1,
                   help="independent samples of the prompt (default: 1)")
    p.add_argument("--ops", choices=("ffi", "xla"), help="kernels (default: the run's, or ffi)")

    x = commands.add_parser(
        "export", help="write a run's latest parameters for Hugging Face or llm.c",
        description="Write the latest checkpoint's parameters of the run in --out for another "
                    "tool: --format hf, a folder that transformers' "
                    "GPT2LMHeadModel.from_pretrained loads (config.json, model.safetensors, "
                    "and GPT-2's tokenizer files where they are found offline); --format llmc, "
                    "an llm.c model file that its train_gpt2 and `train --init-from` read.")
    x.add_argument("--out", default="out", help="the run's folder (default: out)")
    x.add_argument("--format", choices=("hf", "llmc"), required=True,
                   help="hf: a Hugging Face folder; llmc: an llm.c .bin model file (required)")
    x.add_argument("--to", required=True, metavar="PATH",
                   help="the folder (hf) or file (llmc) to write (required)")
    x.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="llm.c's parameter dtype: float32 (its version 3 header) or bfloat16 "
                        "(version 5) (default: float32)")
    return parser


INIT_FROM_HELP = ("{what}: a Hugging Face folder (config.json + model.safetensors of a "
                  "GPT2LMHeadModel), a hub name (gpt2, gpt2-medium, gpt2-large, gpt2-xl; "
                  "downloaded once where there is a network) or an llm.c model file "
                  "(gpt2_124M.bin, float32 or bfloat16) (default: {default})")


def _preset_names() -> list[str]:
    return list(model.presets())
