"""Train GPT-2 on blujax's kernels, evaluate it, sample from it: the main job.

    python examples/gpt2.py                       # train with the defaults (see --help)
    python examples/gpt2.py train --help          # every training flag, with its default
    python examples/gpt2.py eval --out out        # validation loss of the latest checkpoint
    python examples/gpt2.py sample --out out --prompt "Hello, I'm a"

The program is `blujax.cli` (importable, so the tests run it in-process); this script only
calls it.
"""

import sys

from blujax.cli import main

if __name__ == "__main__":
    sys.exit(main())
