"""What ``gradzip bench`` times on a user's machine: kernels in one process, DDP hooks over gloo.

* :mod:`~gradzip.bench.command`: the ``gradzip bench`` command (:func:`main`).
* :mod:`~gradzip.bench.micro`: compress and decode one tensor with every compressor
  (:mod:`~gradzip.bench.replay` plays the other workers of the group).
* :mod:`~gradzip.bench.hooks`: seconds per DDP training step with each communication hook.
* :mod:`~gradzip.bench.common`: the allocator regime, a median timer, the machine's description.
* :mod:`~gradzip.bench.table`: the Markdown tables.

The figures are measurements only; the project's targets and verdicts on them live in the
repository's ``benchmarks/`` scripts, which call these functions.
"""

from gradzip.bench.command import main
from gradzip.bench.common import environment, median_seconds
from gradzip.bench.hooks import HOOK_CONFIGS, HookRow, run_hooks
from gradzip.bench.micro import MICRO_SPECS, MicroRow, run_micro
from gradzip.bench.table import format_table

__all__ = [
    "HOOK_CONFIGS",
    "MICRO_SPECS",
    "HookRow",
    "MicroRow",
    "environment",
    "format_table",
    "main",
    "median_seconds",
    "run_hooks",
    "run_micro",
]
