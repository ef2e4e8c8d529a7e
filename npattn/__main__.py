"""``python -m npattn``: the same as the ``npattn`` command."""

import sys

from .tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
