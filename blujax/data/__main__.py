"""`python -m blujax.data prepare ... | check ...`: see blujax.data.cli."""

import sys

from blujax.data.cli import main

if __name__ == "__main__":
    sys.exit(main())
