"""The benchmarks behind ``gradzip bench``: kernels in one process, DDP hooks over gloo.

:mod:`gradzip.bench` is the entry point; this package holds the measurements.
"""

from gradzip.benchmarks_impl.common import environment, format_table, median_seconds
from gradzip.benchmarks_impl.hooks import HOOK_CONFIGS, HookRow, run_hooks
from gradzip.benchmarks_impl.micro import MICRO_SPECS, MicroRow, run_micro

__all__ = [
    "HOOK_CONFIGS",
    "MICRO_SPECS",
    "HookRow",
    "MicroRow",
    "environment",
    "format_table",
    "median_seconds",
    "run_hooks",
    "run_micro",
]
