"""The GPT-2 command line: train, evaluate, sample, export. `examples/gpt2.py` runs `main()`.

    python examples/gpt2.py                                   # train with the defaults
    python examples/gpt2.py train --data notes.txt --model small --steps 500 --out runs/a
    python examples/gpt2.py train --resume --out runs/a       # continue from the latest checkpoint
    python examples/gpt2.py train --dp 2 --tp 2 --cp 2 --out runs/b   # over 8 devices
    python examples/gpt2.py train --dp 4 --tp 4 --num-processes 2 --process-id 0 \\
        --coordinator host0:12355 --out runs/c   # on host0; host1 the same with id 1
    python examples/gpt2.py eval --out runs/a                 # validation loss of the latest one
    python examples/gpt2.py sample --out runs/a --prompt "Hello, I'm a"
    python examples/gpt2.py train --init-from gpt2 --data notes.txt --out runs/ft  # fine-tune
    python examples/gpt2.py eval --init-from gpt2 --hellaswag --json gpt2.json
    python examples/gpt2.py export --out runs/ft --format hf --to runs/ft/hf

The program lives here, in the package, rather than in the example script, so that the tests
call `main(argv)` in-process and an installed blujax has it too (`python -m blujax.cli`).

Everything a run writes goes to --out: config.json (model, training and data settings),
metrics.jsonl (one JSON object per step), loss.png (train and validation loss), ckpt/ (the
checkpoints) and samples.txt. A resumed run continues bit for bit where the checkpoint left
off: the checkpoint holds the parameters, optimizer state, step, the data loader's position and
the sampling key, and every setting that changes the numbers must stay as it was.

This package is a thin shell: the loop is blujax.loop, metrics and progress blujax.metrics,
several processes blujax.processes, the step blujax.train. The modules, in the order a run
uses them:
    parser.py     the flags of each command, with their help
    settings.py   a run's settings, their defaults and checks; UsageError
    run.py        the run folder: config.json and the checkpoints in it
    lock.py       one run per folder: the lock on --out
    train.py      `train`: settings, folder and data checks, then blujax.loop.run
    report.py     warnings and the loss plot's title
    generate.py   `eval` and `sample`
    export.py     `export`
"""

from __future__ import annotations

import sys

from blujax.cli.export import cmd_export
from blujax.cli.generate import cmd_eval, cmd_sample
from blujax.cli.parser import build_parser
from blujax.cli.settings import USER_ERRORS
from blujax.cli.train import cmd_train

EXIT_USAGE = 2
COMMANDS = {"train": cmd_train, "eval": cmd_eval, "sample": cmd_sample, "export": cmd_export}


def main(argv=None) -> int:
    """Runs the command line; returns the exit status (2: a problem the user can fix)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["train", *argv]  # no command: train
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
