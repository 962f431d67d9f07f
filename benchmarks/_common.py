"""Helpers shared by the benchmark scripts: the repository's paths and child-process commands.

Scripts start helper processes (a run, a worker in a network namespace) as
``python -m benchmarks.<module>``; a child finds the package through ``PYTHONPATH``, which
:func:`package_env` extends with the repository root, so it also works from a plain copy of
the repository (``PYTHONPATH=src``, nothing installed) and from any working directory.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

#: The repository root (the folder holding ``benchmarks/`` and ``src/``).
ROOT = Path(__file__).resolve().parents[1]
#: Where the scripts write their results by default.
RESULTS = ROOT / "benchmarks" / "results"


def module_command(module: str) -> list[str]:
    """The command line that runs ``benchmarks.<module>`` with this interpreter.

    Args:
        module: a module of this package, e.g. ``"netem_worker"``.

    Returns:
        ``[python, "-m", "benchmarks.<module>"]``; append the script's arguments.

    Raises:
        ValueError: ``module`` is not a module file of this package.
    """
    if (not isinstance(module, str) or not module.isidentifier()
            or not (ROOT / "benchmarks" / f"{module}.py").is_file()):
        raise ValueError(f"`module` must name a module of benchmarks/, got {module!r}")
    return [sys.executable, "-m", f"benchmarks.{module}"]


def package_env(env: Mapping[str, str] | None = None, *first: str) -> dict[str, str]:
    """A child's environment in which ``benchmarks`` imports: the root joins ``PYTHONPATH``.

    Args:
        env: the environment to extend (default: this process's).
        *first: paths placed before the root (e.g. a ``src`` checkout to test).

    Returns:
        A new dict; ``env`` is left unchanged.
    """
    out = dict(os.environ if env is None else env)
    paths = [*first, str(ROOT), *filter(None, out.get("PYTHONPATH", "").split(os.pathsep))]
    out["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return out
