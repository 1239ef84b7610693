"""`python -m convert` and the `dsv41-convert` console script (see `convert.cli`)."""

import sys

from convert.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
