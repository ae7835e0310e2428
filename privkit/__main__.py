"""``python -m privkit``: the ``privkit`` command."""

import sys

from privkit.cli import main

if __name__ == "__main__":
    sys.exit(main())
