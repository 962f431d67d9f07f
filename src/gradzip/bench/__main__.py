"""``python -m gradzip.bench``: the same as ``gradzip bench``."""

import sys

from gradzip.bench.command import main

if __name__ == "__main__":
    sys.exit(main())
