"""benchmarks/decision_syncs.py: Accordion's decision steps behind the DDP hook read the host
once (the norms), its other steps not at all, and the script writes and judges that."""

from __future__ import annotations

import json

import pytest

from benchmarks import decision_syncs


@pytest.mark.slow
def test_decision_steps_read_the_host_once_and_the_files_say_so(tmp_path) -> None:
    scheme = decision_syncs.SCHEMES[0]
    assert decision_syncs.main(["--out", str(tmp_path), "--steps", "13", "--only", scheme],
                               log=lambda _: None) == 0
    saved = json.loads((tmp_path / "decision_syncs.json").read_text())
    rows = saved["steps"][scheme]
    decided = [r["step"] for r in rows if r["decision"]]
    assert decided[-2:] == [1, 11]  # the first decision after step 0's window, then interval 10
    assert [r["host_syncs"] for r in rows if r["step"] in (1, 11)] == [1, 1]
    assert all(r["host_syncs"] == 0 for r in rows[1:] if not r["decision"])
    assert all(v["met"] for v in saved["verdicts"]) and len(saved["verdicts"]) == 2
    assert "| target |" in (tmp_path / "decision_syncs.md").read_text()


def test_verdicts_judge_decision_and_other_steps() -> None:
    rows = [{"step": 0, "host_syncs": 4, "decision": True},
            {"step": 1, "host_syncs": 2, "decision": True},
            {"step": 2, "host_syncs": 0, "decision": False}]
    found = decision_syncs.verdicts({"s": rows})
    assert [(v["value"], v["met"]) for v in found] == [(2, False), (0, True)]
    rows[2]["host_syncs"] = 1
    assert [v["met"] for v in decision_syncs.verdicts({"s": rows})] == [False, False]


def test_arguments_are_checked() -> None:
    with pytest.raises(SystemExit):
        decision_syncs.main(["--steps", "1"])
    with pytest.raises(SystemExit):
        decision_syncs.main(["--only", "gradzip:topk"])
    with pytest.raises(SystemExit):
        decision_syncs.main(["--lr-decay", "0.5"])
