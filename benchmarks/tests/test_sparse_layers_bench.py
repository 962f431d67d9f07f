"""The per-tensor sparsifier benchmark (benchmarks/sparse_layers.py), on the seconds-long smoke
setting: what it counts as sent must be what the compressors send."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import sparse_layers


def test_counts_per_tensor_match_the_compressors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "layers.json"
    assert sparse_layers.main(["--setting", "smoke", "--density", "0.05", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    topk, threshold = result["runs"]
    assert (topk["compressor"], threshold["compressor"]) == ("topk:ratio=0.05",
                                                            "threshold:budget=0.05")
    for run in (topk, threshold):
        assert sum(t["share_of_sent"] for t in run["tensors"]) == pytest.approx(1.0)
        assert [t["numel"] for t in run["tensors"]] == sorted(
            (t["numel"] for t in run["tensors"]), reverse=True)
    # Top-k sends exactly max(1, int(ratio * numel)) entries of every tensor, every step and
    # worker: the count read from the residuals must say so, tensor by tensor.
    for t in topk["tensors"]:
        assert t["sent"] * t["numel"] == max(1, int(0.05 * t["numel"])) * t["offered"], t
        assert 0 < t["compression_error"] < 1
    # The threshold spreads one budget unevenly: its densities differ between tensors, and
    # its run's density is near the budget (the calibration overshoots early on).
    densities = [t["density"] for t in threshold["tensors"]]
    assert max(densities) > 2 * min(densities)
    assert 0.04 < threshold["density"] < 0.09
    table = capsys.readouterr().out
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()
            if line.startswith("|")]
    assert ["classifier.1.weight", "8,192"] in [row[:2] for row in rows]
    assert f"wrote {out}" in table


def test_refuses_bad_arguments() -> None:
    with pytest.raises(SystemExit, match="--density must be in"):
        sparse_layers.main(["--density", "1.5"])
    with pytest.raises(SystemExit, match="--setting must be one of"):
        sparse_layers.main(["--setting", "nope"])
    with pytest.raises(SystemExit, match="needs --text-data"):
        sparse_layers.main(["--setting", "wikitext2-lstm"])
