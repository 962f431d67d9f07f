"""Per-parameter rules in a run's records: a rule's compressor reports its density, an
Accordion or schedule given as a rule its levels, critical fraction, counts and decisions,
under the rule's text, beside the main compressor's own fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import gradzip
from gradzip.cli import main
from gradzip.train.metrics import read_metrics
from gradzip.train.rule_records import new_rule_decisions, rule_counts, rule_fields

SHAPES = {
    "enc.weight": torch.Size((24, 16)),
    "enc.bias": torch.Size((24,)),
    "head.weight": torch.Size((4, 16)),
    "head.bias": torch.Size((4,)),
}
ACCORDION = "accordion(steady=topk:ratio=0.05,critical=topk:ratio=0.5,interval=2)"


def run(steps: int) -> gradzip.Engine:
    engine = gradzip.Engine(SHAPES, "none", collective=gradzip.SimulatedGroup(2),
                            rules=[("enc.*", ACCORDION), ("head.weight", "topk:ratio=0.25"),
                                   ("*.bias", "dense")])
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        scale = 1.0 if step < 3 else 0.01  # the norms change: the Accordion switches
        engine.reduce({n: scale * torch.randn(2, *s, generator=gen) for n, s in SHAPES.items()})
    return engine


def test_each_rule_reports_under_its_text() -> None:
    engine = run(6)
    marks: dict[str, object] = {}
    fields = rule_fields(engine, marks)["rules"]
    accordion = f"enc.*={gradzip.compressor_from_spec(ACCORDION).spec()}"
    assert set(fields) == {accordion, "head.weight=topk:ratio=0.25"}  # dense rule: nothing
    assert fields["head.weight=topk:ratio=0.25"] == {"density": 0.25}
    acc = fields[accordion]
    assert set(acc["levels"]) == {"enc.weight", "enc.bias"}
    counts = rule_counts(engine)["rule_counts"][accordion]
    assert acc["critical_fraction"] == counts["critical_steps"] / (
        counts["critical_steps"] + counts["steady_steps"])
    assert 0 < acc["critical_fraction"] < 1  # both levels were used in these steps
    assert acc["density"] == pytest.approx(
        (0.05 * counts["steady_steps"] + 0.5 * counts["critical_steps"])
        / (counts["steady_steps"] + counts["critical_steps"]))
    # The next span starts from the marks: no step since, so no fraction of a new span.
    assert rule_fields(engine, marks)["rules"][accordion]["critical_fraction"] == 0
    decisions = new_rule_decisions(engine, marks)
    assert len({r["decision"] for r in decisions}) == counts["decisions"]
    assert {r["rule"] for r in decisions} == {accordion}
    assert new_rule_decisions(engine, marks) == []  # each record once


def test_engines_without_rules_add_nothing() -> None:
    engine = gradzip.Engine(SHAPES, ACCORDION, collective=gradzip.SimulatedGroup(2))
    assert rule_fields(engine, {}) == {} and rule_counts(engine) == {}
    assert new_rule_decisions(engine, {}) == [] and rule_fields(None, {}) == {}


@pytest.mark.slow
def test_a_run_records_an_accordion_given_as_a_rule(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    rule = "classifier.*=accordion(steady=topk:ratio=0.05,critical=topk:ratio=0.5,interval=3)"

    def train(where: Path, epochs: int, *extra: str) -> None:
        code = main(["train", "--task", "digits", "--epochs", str(epochs), "--workers", "2",
                     "--limit-train", "200", "--milestones", "1", "--compressor",
                     "topk:ratio=0.1", "--rule", rule, "--out", str(where), "--quiet", *extra])
        assert code == 0, capsys.readouterr().err

    train(out, 2)
    text = gradzip.options.Rule.parse(rule).describe()
    epochs = read_metrics(out)
    assert len(epochs) == 2
    for record in epochs:
        fields = record["rules"][text]
        assert fields["levels"] and all(n.startswith("classifier.") for n in fields["levels"])
        assert 0 <= fields["critical_fraction"] <= 1 and 0 < fields["density"] <= 0.5
        assert record["density"] == pytest.approx(0.1, abs=0.01)  # the main compressor's
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rule_counts"][text]["decisions"] >= 2
    decisions = json.loads((out / "rule_decisions.json").read_text())
    assert {r["rule"] for r in decisions} == {text}
    assert len({r["decision"] for r in decisions}) == summary["rule_counts"][text]["decisions"]
    assert not (out / "accordion_decisions.json").exists()  # the main compressor decides nothing
    # A run stopped after one epoch and resumed records the same per-rule fields and decisions.
    resumed = tmp_path / "resumed"
    train(resumed, 1)
    train(resumed, 2, "--resume")
    assert [r["rules"] for r in read_metrics(resumed)] == [r["rules"] for r in epochs]
    assert json.loads((resumed / "rule_decisions.json").read_text()) == decisions
    assert json.loads((resumed / "summary.json").read_text())["rule_counts"] == summary["rule_counts"]
