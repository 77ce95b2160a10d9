"""`python -m blujax.cli`: the same program as examples/gpt2.py."""

import sys

from blujax.cli import main

sys.exit(main())
