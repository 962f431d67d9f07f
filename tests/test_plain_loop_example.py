"""The plain-loop example trains with a simulated group and reports real compression."""

from __future__ import annotations

from pathlib import Path

import pytest

from integrations_launch import load_script

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "plain_loop.py"


@pytest.mark.slow
def test_plain_loop_example_learns_and_compresses(capsys) -> None:
    module = load_script(EXAMPLE, "plain_loop")
    result = module.main(["--compressor", "powersgd:rank=1", "--accordion", "powersgd:rank=4",
                          "--epochs", "3", "--workers", "2"])
    assert result["accuracy"] > 0.5  # ten classes: chance is 0.1
    assert result["compression"] > 2
    assert "MiB sent per worker" in capsys.readouterr().out
