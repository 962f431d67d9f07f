"""``benchmarks/scaling_bytes_procs.py``: real gloo processes give the simulator's bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import scaling_bytes_procs


@pytest.mark.slow  # starts 2 + 3 processes
def test_real_processes_send_the_simulators_bytes(tmp_path: Path) -> None:
    assert scaling_bytes_procs.main(["--workers", "2", "3", "--tensors", "1", "--side", "32",
                                     "--steps", "2", "--only", "topk", "sign",
                                     "--results", str(tmp_path), "--name", "t"]) == 0
    rows = json.loads((tmp_path / "t.json").read_text())["rows"]
    assert len(rows) == 2 * 7  # none, and topk and sign with three exchanges, at W = 2 and 3
    for row in rows:
        assert row["equal"], row["label"]
        assert len(row["real_bytes"]) == row["workers"]
        assert row["real_bytes"] == row["sim_bytes"]
        assert all(b > 0 for rank in row["real_bytes"] for b in rank)
        assert all(f == row["forms"] for f in row["real_forms"])
    by = {(r["label"], r["workers"]): r for r in rows}
    for w in (2, 3):
        assert by[("topk (sharded)", w)]["forms"] == {"sharded": 1}
        assert by[("sign (sharded)", w)]["forms"] == {"sharded": 1}
        assert by[("sign (allgather)", w)]["forms"] == {"allgather": 1}
    assert "real == simulated on every rank and step: yes" in (tmp_path / "t.md").read_text()


def test_verdicts_flag_a_mismatch_and_growth_beyond_the_formula() -> None:
    def row(label: str, w: int, frac: float, equal: bool = True) -> dict[str, object]:
        return {"label": label, "spec": label, "workers": w, "fraction": frac, "equal": equal}

    # 2 (W-1) / W is 1 at W=2 and 1.75 at W=8: "a" follows it within 10%, "b" does not.
    rows = [row("none (ring)", 2, 1.0), row("none (ring)", 8, 1.75),
            row("a (sharded)", 2, 0.1), row("a (sharded)", 8, 0.19),
            row("b (sharded)", 2, 0.1), row("b (sharded)", 8, 0.195, equal=False)]
    lines = scaling_bytes_procs.verdicts(rows)
    assert lines[0].endswith("NO: b (sharded) W=8")
    assert lines[1].startswith("- a (sharded)") and lines[1].endswith(": flat")
    assert "over that factor 1.086x" in lines[1]
    assert lines[2].startswith("- b (sharded)") and lines[2].endswith(": NOT flat")


def test_specs_cover_every_exchange() -> None:
    labels = [label for label, _ in scaling_bytes_procs.specs(["qsgd"])]
    assert labels == ["none (ring)", "qsgd (sharded)", "qsgd (allgather)", "qsgd (auto)"]
    assert dict(scaling_bytes_procs.specs(["topk"]))["topk (sharded)"] == \
        "topk:ratio=0.01,exchange=sharded"
