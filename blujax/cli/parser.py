"""The command line's flags: `train`, `eval`, `sample` and `export`, each flag with what it does
and its default. A flag that several commands take is defined once, in a parent parser that
they share (_shared). Flags default to None, so that a flag given can be told from one left
out, which takes the default, a resumed run's own value, or the run's (settings.py).
"""

from __future__ import annotations

import argparse

from blujax import evaluate, fp8, interop, model, processes
from blujax.model.stack import REMAT
from blujax.cli.settings import SAMPLE_PROMPT, SAVE_MINUTES, defaults

# --dtype's values, and the other spellings it takes (llm.c's and numpy's names).
DTYPE_NAMES = {"bf16": "bf16", "f32": "f32", "bfloat16": "bf16", "float32": "f32"}


def build_parser() -> argparse.ArgumentParser:
    cpu, gpu = defaults(False), defaults(True)

    def both(key):
        a, b = cpu[key], gpu[key]
        return f"{a}" if a == b else f"{a} on a CPU, {b} on a GPU"

    titles = ", ".join(family.TITLE for family in model.FAMILIES.values())
    shared = _shared(both)
    parser = argparse.ArgumentParser(
        prog="gpt2.py",
        description=f"Train language models of blujax's families ({titles}) on its kernels, "
                    f"evaluate them, sample from them, export them. With no command, `train` "
                    f"runs with its defaults: a small model on tinyshakespeare for a few "
                    f"minutes on a CPU, GPT-2 124M in bf16 on a GPU.",
        epilog="Run `gpt2.py COMMAND --help` for each command's flags.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    def command(name, flags, **kw):
        return commands.add_parser(name, parents=[shared[f] for f in flags.split()], **kw)

    t = command("train",
                "out init_from data batch seq eval_batches ops dtype seed hellaswag progress",
                help="train a model (the default command)",
                description=f"Train a model of one of the families ({titles}: --model, or "
                            f"--init-from). Writes config.json, metrics.jsonl (one JSON object "
                            f"per step), loss.png, ckpt/ and samples.txt into --out. Flags left "
                            f"out take their defaults, or with --resume the run's own values.")
    _add_training_flags(t, both)
    _add_run_flags(t)
    e = command("eval", "out init_from data batch seq eval_batches ops dtype hellaswag progress",
                help="validation loss and HellaSwag score of a run or of pretrained weights",
                formatter_class=argparse.RawDescriptionHelpFormatter,
                description="Evaluate the latest checkpoint of a run (--out) or pretrained "
                            "weights (--init-from): a validation loss, and with --hellaswag the "
                            "HellaSwag accuracy.\n\n" + evaluate.EVAL_DEFINITION + "\n\nWithout "
                            "--data, a run is measured on its own validation batches, as its "
                            "val_loss was.")
    e.add_argument("--json", metavar="PATH",
                   help="also write the results as one JSON object to PATH (val_loss, "
                        "batches, tokens, batch, seq, hellaswag_acc, hellaswag_acc_norm, "
                        "hellaswag_n, ...) (default: printed only)")
    p = command("sample", "out init_from ops dtype seed",
                help="generate text from the latest checkpoint",
                description="Generate text from the latest checkpoint in --out, or from "
                            "pretrained weights; the same --seed gives the same text.")
    _add_sample_flags(p)
    x = command("export", "out dtype", help="write a run's latest parameters for Hugging Face "
                                           "or llm.c",
                description="Write the latest parameters of the run in --out for another tool: "
                            "--format hf, a Hugging Face folder (config.json with the family's "
                            "model_type, model.safetensors, the model's tokenizer files: "
                            "GPT-2's where found offline) that transformers' "
                            "AutoModelForCausalLM loads; --format llmc, an llm.c model file for "
                            "its train_gpt2 and `train --init-from`.")
    x.add_argument("--format", choices=("hf", "llmc"), required=True,
                   help="hf: a Hugging Face folder; llmc: an llm.c .bin model file (required)")
    x.add_argument("--to", required=True, metavar="PATH",
                   help="the folder (hf) or file (llmc) to write (required)")
    x.add_argument("--overwrite", action="store_true",
                   help="export into a folder that holds files an export does not write (they "
                        "are kept; only config.json, model.safetensors and tokenizer files are "
                        "replaced), or over a file that is not an llm.c model file; never into "
                        "a run's own folder (default: refuse those)")
    return parser


def _shared(both) -> dict[str, argparse.ArgumentParser]:
    """The flags of several commands, each in a parent parser of its own: {name: parser}."""
    def flag(*names, **kw):
        parent = argparse.ArgumentParser(add_help=False)
        parent.add_argument(*names, **kw)
        return parent

    types = ", ".join(f"{name} ({family.TITLE})" for name, family in model.FAMILIES.items())
    return {
        "out": flag("--out", help="the run's folder, which train writes and the others read "
                                  "(default: out; eval and sample: out unless --init-from)"),
        "init_from": flag("--init-from", metavar="SRC", help=(
            f"pretrained weights, which train fine-tunes (no --model: they have a shape) and "
            f"eval and sample use instead of a run: a Hugging Face folder (config.json, "
            f"model.safetensors) of a model_type blujax reads ({types}), a hub name "
            f"({', '.join(interop.HUB_NAMES)}; downloaded once), an llm.c model file "
            f"(gpt2_124M.bin, float32 or bfloat16), or another run's folder (its latest "
            f"checkpoint's parameters and tokenizer) (default: train makes a new model of "
            f"--model; eval and sample read the run in --out)")),
        "data": flag("--data", metavar="PATH_OR_GLOB", help=(
            "a text file, a directory or glob of llm.c .bin shards (split into train and val "
            "by '_train_'/'_val_' in their names), or one .bin shard. train validates on the "
            "val split (a text file is tokenized once, into FILE.tokens/ beside it or the "
            "user cache); eval reads the val split, a text file's whole text, one shard's "
            "tokens (default: train: tinyshakespeare, from the user cache, else "
            "$BLUJAX_CORPUS, else downloaded; eval: the run's validation split)")),
        "batch": flag("--batch", type=int, help=(
            f"B: sequences per step, over all micro-batches; in eval, rows per batch (default: "
            f"{both('batch')}; eval: the run's, pretrained 8)")),
        "seq": flag("--seq", type=int, help=(
            f"T: tokens per sequence, at most the model's block_size (default: {both('seq')}; "
            f"eval: the run's, pretrained the block size, at most 1024)")),
        "eval_batches": flag("--eval-batches", type=int, help=(
            f"K: validation batches per measurement, the split's first ones; in eval, 0 is all "
            f"of them (default: {both('eval_batches')}; eval: the run's, so that the loss is "
            f"its val_loss, pretrained 0)")),
        "ops": flag("--ops", choices=("ffi", "xla"),
                    help="ffi: blujax's kernels; xla: the same model in plain JAX (default: "
                         "ffi; eval and sample: the run's)"),
        "dtype": flag("--dtype", type=lambda name: DTYPE_NAMES.get(name, name),
                      choices=("bf16", "f32"), help=(
            f"bf16 (bfloat16) or f32 (float32): the compute dtype, parameters staying float32; "
            f"in export, the llm.c file's parameters (float32: its version 3 header, bfloat16: "
            f"version 5) (default: {both('dtype')}; eval and sample: the run's, pretrained "
            f"{both('dtype')}; export: f32)")),
        "seed": flag("--seed", type=int, help="seed of train's initialization, data order and "
                                              "samples, and of sample's text (default: 0)"),
        "hellaswag": flag("--hellaswag", nargs="?", const="", metavar="FILE", help=(
            "also score HellaSwag (train: at every validation): the official validation jsonl "
            "FILE, or without FILE that set, downloaded once; an ending's score is the sum "
            "(acc) or mean (acc_norm) of its tokens' cross-entropy, the lowest wins (default: "
            "off)")),
        "progress": flag("--no-progress", action="store_true",
                         help="no progress bar or progress lines (default: shown)"),
    }


def _add_training_flags(t: argparse.ArgumentParser, both):
    """train's model, optimization and measurement flags."""
    t.add_argument("--model", help=f"model preset: {', '.join(model.presets())} "
                                   f"(default: {both('model')})")
    t.add_argument("--steps", type=int,
                   help=f"optimizer steps, which the learning-rate schedule spans; with "
                        f"--resume a new count extends the run, and its schedule (default: "
                        f"{both('steps')})")
    t.add_argument("--accum", type=int, help="gradient accumulation: micro-batches per step; "
                                             "must divide --batch (default: 1)")
    t.add_argument("--lr", type=float, help=f"peak learning rate, > 0 (default: {both('lr')})")
    t.add_argument("--min-lr-ratio", type=float, help="the cosine decay ends at lr times "
                                                      "this, in [0, 1] (default: 0.1)")
    t.add_argument("--warmup", type=int, help="linear warmup steps (default: a tenth of "
                                              "--steps)")
    t.add_argument("--weight-decay", type=float, help="AdamW weight decay of matrices and "
                                                      "embeddings, >= 0 (default: 0.1)")
    t.add_argument("--grad-clip", type=float, help="clip the gradient's global norm to "
                                                   "this; 0: no clipping (default: 1.0)")
    t.add_argument("--remat", nargs="?", const="full", choices=REMAT, metavar="MODE",
                   help="recompute activations in the backward pass: less memory, more "
                        "compute. full (the flag alone): each block from its input; selective: "
                        "the norms and activations, keeping the matrix products' and "
                        "attention's outputs; none (default: selective for models of 4B "
                        "parameters or more, such as llama-8b, else none)")
    t.add_argument("--fp8", nargs="?", const="on", choices=fp8.MODES, metavar="all",
                   help="the blocks' matrix products in FP8 (float8 e4m3 operands, e5m2 "
                        "gradients, per-tensor scales): on (the flag alone) where FP8 is "
                        "measured to pay (both widths of the product at least "
                        f"{fp8.MIN_WIDTH}); all: every block product; off (default). The LM "
                        "head stays in --dtype. Recorded in config.json and kept on --resume. "
                        "On a GPU the first steps compile for minutes (XLA autotunes the FP8 "
                        "products; XLA_FLAGS=--xla_gpu_enable_triton_gemm=false: seconds, "
                        "about 3%% slower)")
    t.add_argument("--fp8-scaling", choices=fp8.SCALINGS,
                   help="how --fp8 finds each tensor's scale: delayed (from the largest "
                        "absolute value of the last 16 steps, kept in checkpoints) or dynamic "
                        f"(from the tensor itself, one more pass) (default: "
                        f"{fp8.DEFAULT_SCALING})")
    t.add_argument("--eval-every", type=int, help="validate every this many steps and at the "
                   "end; 0: never (default: a tenth of --steps)")
    t.add_argument("--save-every", type=int, help="checkpoint every this many steps and at the "
                   "end (the last 3 are kept); 0: only at the end. Saves are written in the "
                   "background: a step waits only for the state's copy to host memory (default: "
                   "every tenth of --steps (a run under 10 steps: none), or every "
                   "--save-minutes if that comes first; config.json records both)")
    t.add_argument("--save-minutes", type=float, metavar="M",
                   help=f"also checkpoint once M minutes have passed since the last checkpoint; "
                        f"0: never by the clock (default: {SAVE_MINUTES:g} unless --save-every "
                        f"is given, then 0)")
    t.add_argument("--sample-tokens", type=int,
                   help=f"at the end, sample this many tokens after \"{SAMPLE_PROMPT}\"; 0: "
                        f"no samples (default: 64)")


def _add_run_flags(t: argparse.ArgumentParser):
    """train's flags of the devices, the processes and the run folder."""
    t.add_argument("--dp", type=int, help="data parallelism: each micro-batch splits over "
                                          "this many devices (default: 1)")
    t.add_argument("--tp", type=int, help="tensor parallelism (Megatron, sequence-parallel): "
                                          "the heads, MLP and vocabulary split over this many "
                                          "devices (default: 1)")
    t.add_argument("--cp", type=int, help="context parallelism (ring attention): each sequence "
                                          "splits over this many devices (default: 1)")
    t.add_argument("--fsdp", type=int, help="fully sharded data parallelism (ZeRO-3): each "
                   "micro-batch splits over this many devices as with --dp, and so do the "
                   "parameters, gradients and AdamW's moments; each layer gathers its weights "
                   "where it runs (default: 1)")
    t.add_argument("--zero", action=argparse.BooleanOptionalAction,
                   help="ZeRO-1: split AdamW's moments over the --dp devices (default: off). "
                        "The run uses the first dp x fsdp x tp x cp devices JAX sees; --resume "
                        "continues on any mesh (bit for bit on the same one)")
    t.add_argument("--num-processes", type=int, metavar="N",
                   help=f"train one run in N processes, one per host, each with this command "
                        f"and its own --process-id, over a mesh of all their devices (dp x fsdp "
                        f"x tp x cp of them); each reads --data; process 0 writes --out, which "
                        f"--resume needs on a folder all see (default: "
                        f"${processes.ENV_NUM_PROCESSES}, else 1)")
    t.add_argument("--process-id", type=int, metavar="I",
                   help=f"this process's index in [0, --num-processes) (default: "
                        f"${processes.ENV_PROCESS_ID}, else JAX's guess under SLURM or MPI)")
    t.add_argument("--coordinator", metavar="HOST:PORT",
                   help=f"process 0's host and a free port there, where the processes meet "
                        f"(default: ${processes.ENV_COORDINATOR}, else JAX's guess under "
                        f"SLURM or MPI)")
    t.add_argument("--init-timeout", type=float, metavar="SECONDS",
                   help=f"how long the processes wait for each other at the start, each saying "
                        f"so every {processes.INIT_EVERY_S:g} s, before they give up (default: "
                        f"{processes.INIT_TIMEOUT_S:g})")
    t.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its latest checkpoint, bit for bit, "
                        "with the settings that decide its numbers (default: a new run)")
    t.add_argument("--overwrite", action="store_true", help="start again in an --out that "
                   "holds a run, deleting its checkpoints and metrics (default: refuse)")
    t.add_argument("--stop-after", type=int, metavar="STEP",
                   help="end after step STEP with a checkpoint, the schedule of --steps "
                        "unchanged, for a later --resume (default: run to --steps)")
    t.add_argument("--profile", metavar="DIR",
                   help="write process 0's jax.profiler trace of 3 steps, after 3 warm-up "
                        "steps, into DIR (default: no trace)")


def _add_sample_flags(p: argparse.ArgumentParser):
    p.add_argument("--prompt", default=SAMPLE_PROMPT,
                   help=f"text to continue (default: \"{SAMPLE_PROMPT}\")")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="tokens to generate after the prompt (default: 64)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature; 0 picks the most likely token (default: 1.0)")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k most likely "
                                                         "tokens only; 0: all (default: 40)")
    p.add_argument("--num-samples", type=int, default=1,
                   help="independent samples of the prompt (default: 1)")
