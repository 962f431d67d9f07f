"""Each integration module names the missing framework and the pip extra in one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

import gradzip.integrations

MODULES = {"lightning": "lightning", "accelerate": "accelerate", "transformers": "transformers"}

# In a fresh interpreter, each framework is made unimportable (a None entry in sys.modules is
# how Python marks a module as not importable) before its integration module is imported.
PROBE = """
import importlib, sys
for module, package in {modules!r}.items():
    sys.modules[package] = None
    try:
        importlib.import_module("gradzip.integrations." + module)
    except ImportError as error:
        print(type(error).__name__, error)
    else:
        print("imported", module)
"""


@pytest.mark.slow  # starts a process
def test_missing_framework_raises_one_line_import_error() -> None:
    assert gradzip.integrations.__all__ == []  # the package itself imports no framework
    result = subprocess.run([sys.executable, "-c", PROBE.format(modules=MODULES)],
                            capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.splitlines() == [
        f"ImportError gradzip.integrations.{module} needs the `{package}` package: "
        f"pip install {package} (or the `integrations` extra: pip install -e '.[integrations]' "
        "in gradzip's source tree)"
        for module, package in MODULES.items()
    ]
