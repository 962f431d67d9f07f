"""Kernel benchmark (BENCHMARKS.md section 1); same as ``gradzip bench micro``.

    python benchmarks/micro.py [--json] [--numel N ...] [--repeat R] [--threads T]
"""

import sys

from gradzip.bench import main

if __name__ == "__main__":
    sys.exit(main(["micro", *sys.argv[1:]]))
