"""``gradzip train --compressor auto``: decisions and levels reach the run's records."""

from __future__ import annotations

import json
from pathlib import Path

from test_resume import TINY

from gradzip.train.runner import RunConfig, run


def test_auto_decisions_reach_the_records(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run(RunConfig(**{**TINY, "epochs": 2, "out": str(out),  # type: ignore[arg-type]
                     "compressor": "auto(every=3,warmup=2)", "eval_every": 4}))
    decisions = json.loads((out / "accordion_decisions.json").read_text())
    # 12 steps: decisions at the start of steps 2, 5, 8 and 11, whatever real time says.
    assert [r["step"] for r in decisions] == [2, 5, 8, 11]
    assert [r["reason"] for r in decisions][0] == "first" and decisions[0]["critical"]
    for r in decisions:
        assert set(r["predicted_ms"]) == {"none", "fp16", "powersgd-r4", "powersgd-r2",
                                          "powersgd-r1", "topk-1%"}
        assert r["bandwidth_mbit"] > 0 and r["compute_ms"] >= 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if r["kind"] == "epoch"]
    # Each evaluation names the level in use and the steps run at each level so far.
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [4, 8]
    for r in evals:
        assert r["level"] in r["level_steps"] and sum(r["level_steps"].values()) == r["step"]
    assert len(epochs) == 2 and all(len(set(r["levels"].values())) == 1 for r in epochs)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["accordion_counts"]["decisions"] == 4
    assert sum(summary["accordion_counts"]["steps"].values()) == 12
