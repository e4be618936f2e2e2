"""``python -m sparseops ...``: the same command as ``sparseops ...``."""

import sys

from sparseops.cli import main

if __name__ == "__main__":
    sys.exit(main())
