"""DDP hook benchmark over gloo (BENCHMARKS.md section 2); same as ``gradzip bench hooks``.

    python benchmarks/hooks.py [--json] [--workers 2 4] [--steps N] [--rounds R]
"""

import sys

from gradzip.bench import main

if __name__ == "__main__":
    sys.exit(main(["hooks", *sys.argv[1:]]))
