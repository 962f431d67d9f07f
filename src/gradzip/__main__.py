"""``python -m gradzip``: the same as the ``gradzip`` command."""

import sys

from gradzip.cli import main

if __name__ == "__main__":
    sys.exit(main())
