"""The plain-loop example trains with a simulated group and reports real compression."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "plain_loop.py"


def test_plain_loop_example_learns_and_compresses(capsys) -> None:
    spec = importlib.util.spec_from_file_location("plain_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--compressor", "powersgd:rank=1", "--accordion", "powersgd:rank=4",
                          "--epochs", "3", "--workers", "2"])
    assert result["accuracy"] > 0.5  # ten classes: chance is 0.1
    assert result["compression"] > 2
    assert "MiB sent per worker" in capsys.readouterr().out
