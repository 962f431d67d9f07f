"""``benchmarks/scaling_bytes_quant.py``: a seconds-long run, and its verdicts on fixed rows."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import scaling_bytes_quant


def test_a_small_run_writes_the_table_and_flat_sharded_bytes(tmp_path: Path) -> None:
    out = tmp_path / "bytes"
    assert scaling_bytes_quant.main(["--workers", "2", "8", "16", "--tensors", "2", "--side", "32",
                                     "--quantisers", "sign", "--out", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    by = {(r["label"], r["workers"]): r for r in rows}
    assert by[("sign (auto)", 16)]["exchange"] == {"allgather": 0, "sharded": 2, "dense": 0}
    # The all-gather grows with W; the sharded form stays below it and below the dense ring.
    assert by[("sign (allgather)", 16)]["fraction"] > 1.5 * by[("sign (allgather)", 8)]["fraction"]
    assert by[("sign (auto)", 16)]["fraction"] < by[("none", 16)]["fraction"]
    assert "sign (auto): W=16" in out.with_suffix(".md").read_text()


def test_verdicts_on_fixed_rows() -> None:
    rows = [{"label": "none", "workers": 8, "fraction": 1.75},
            {"label": "none", "workers": 512, "fraction": 2.0},
            {"label": "q (auto)", "workers": 8, "fraction": 0.2},
            {"label": "q (auto)", "workers": 512, "fraction": 0.3},
            {"label": "b (auto)", "workers": 8, "fraction": 0.2},
            {"label": "b (auto)", "workers": 512, "fraction": 0.31},
            {"label": "q (allgather)", "workers": 512, "fraction": 80.0}]
    lines = scaling_bytes_quant.verdicts(rows, 512)
    assert lines == [
        "- b (auto): W=512 0.310 vs W=8 0.200 (1.55x, target <= 1.5x), dense ring 2.000: missed",
        "- q (auto): W=512 0.300 vs W=8 0.200 (1.50x, target <= 1.5x), dense ring 2.000: met",
    ]
