"""The command line: train, evaluate, sample and export models of every family blujax has
(blujax.model.FAMILIES). `examples/gpt2.py` runs `main()`, and so does `python -m blujax.cli`;
the tests call `main(argv)` in-process. The README shows it at work, `COMMAND --help` every
flag.

It is flags, settings and printing over the library: the data blujax.data, the run folder
blujax.runs, the state to start from blujax.startup, the step blujax.train, the loop
blujax.loop, metrics and progress blujax.metrics, several processes blujax.processes. The
modules, in the order a run uses them:
    parser.py     the flags of each command, with their help
    settings.py   a run's settings, their defaults and checks; the errors main() reports
    run.py        what it settles about the run folder (--out; the folder itself is
                  blujax.runs): the state to evaluate, config.json's record, what to train
    train.py      `train`: settings, folder, data, state, then blujax.loop.run
    report.py     what a run prints: its first and last lines, notes, the loss plot's title
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
