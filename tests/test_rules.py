"""Per-parameter rules and ``min_numel``: routing, several compressor families in one engine,
checkpoints, the handshake, the simulator against real gloo processes through the DDP hook,
and the CLI."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradzip
import shared_launch
from ddp_helpers import TINY_BUCKET_MB, batch, clone_tree, flat_params, mlp, train_ddp
from gradzip import Engine, EngineOptions, Rule, SimulatedGroup
from gradzip.cli import main
from gradzip.comm.header import HEADER_BYTES
from gradzip.comm.launch import run_processes
from gradzip.options import DENSE_ROUTE, MAIN_ROUTE, route

SHAPES = {
    "enc.weight": torch.Size((24, 16)),
    "enc.bias": torch.Size((24,)),
    "mid.weight": torch.Size((16, 24)),
    "mid.bias": torch.Size((16,)),
    "head.weight": torch.Size((4, 16)),
    "head.bias": torch.Size((4,)),
    "scale": torch.Size(()),
}
ACCORDION = "accordion(steady=powersgd:rank=1,critical=powersgd:rank=2,eta=0.5,interval=2)"
SCHEDULE = "schedule(gentle=none,aggressive=topk:ratio=0.2,gentle_steps=0-2,after_drop=0)"


def grads(workers: int, step: int, shapes: dict[str, torch.Size] = SHAPES) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1_000 + step)
    return {n: torch.randn((workers, *s), generator=gen) for n, s in shapes.items()}


def sim(spec: str, shapes: dict[str, torch.Size] = SHAPES, workers: int = 2, **kw: Any) -> Engine:
    return Engine(shapes, spec, collective=SimulatedGroup(workers), **kw)


def subset(names: list[str]) -> dict[str, torch.Size]:
    return {n: SHAPES[n] for n in names}


# -- routing --------------------------------------------------------------------------------
def test_route_order_min_numel_then_dense_1d_then_first_matching_rule() -> None:
    options = EngineOptions(
        rules=[("head.*", "dense"), ("*.weight", "sign"), ("enc.weight", "fp16")],
        dense_1d=True, min_numel=50,
    )
    got = route(SHAPES, options)
    assert got == {
        "enc.weight": 2,  # "*.weight" (rule 0 is head.*) comes before "enc.weight"
        "enc.bias": DENSE_ROUTE,  # fewer than 50 entries
        "mid.weight": 2,
        "mid.bias": DENSE_ROUTE,
        "head.weight": DENSE_ROUTE,  # (64 entries) the dense rule
        "head.bias": DENSE_ROUTE,
        "scale": DENSE_ROUTE,
    }
    assert route(SHAPES, EngineOptions())["enc.weight"] == MAIN_ROUTE


def test_rules_accept_pairs_strings_mappings_and_rules() -> None:
    forms = [
        [("enc.*", "sign"), ("*", "dense")],
        ["enc.*=sign", "*=dense"],
        {"enc.*": "sign", "*": "dense"},
        [Rule("enc.*", "sign"), Rule("*", "dense")],
    ]
    made = [EngineOptions(rules=f) for f in forms]
    assert all(m == made[0] for m in made)
    assert [r.describe() for r in made[0].rules] == ["enc.*=sign", "*=dense"]


@pytest.mark.parametrize(
    ("rules", "exc", "fragment"),
    [
        ("enc.*=sign", TypeError, "`rules` must be a sequence of (pattern, spec) pairs"),
        ([("enc.*",)], TypeError, "`rules` must hold (pattern, spec) pairs"),
        ([("", "sign")], TypeError, "rule `pattern` must be a non-empty glob string"),
        ([("enc.*", "topk:ratio=2")], ValueError, "rule 'enc.*': `ratio` must be in (0, 1]"),
        (["enc.*"], ValueError, "`rule` must be PATTERN=SPEC"),
    ],
)
def test_invalid_rules_are_refused_naming_the_rule(rules: Any, exc: type, fragment: str) -> None:
    with pytest.raises(exc, match=re.escape(fragment)):
        sim("topk:ratio=0.1", rules=rules)


# -- several compressors in one engine --------------------------------------------------------
@pytest.mark.parametrize("enc_spec", ["powersgd:rank=2", ACCORDION, SCHEDULE])
def test_each_rule_reduces_its_tensors_as_an_engine_of_its_own_would(enc_spec: str) -> None:
    """Two compressor families (or a controller: Accordion, a level schedule) plus the main
    one in one engine equal three engines, each on its own tensors, bit for bit, step after
    step (error feedback included); the payload is theirs together, less the two headers the
    one engine does not send."""
    steps = 4
    engine = sim("topk:ratio=0.2", rules=[("enc.*", enc_spec), ("mid.weight", "sign")])
    parts = {
        enc_spec: sim(enc_spec, subset(["enc.weight", "enc.bias"])),
        "sign": sim("sign", subset(["mid.weight"])),
        "topk:ratio=0.2": sim("topk:ratio=0.2", subset(
            ["mid.bias", "head.weight", "head.bias", "scale"])),
    }
    for step in range(steps):
        g = grads(2, step)
        out = engine.reduce(g)
        for part in parts.values():
            alone = part.reduce({n: g[n] for n in part.shapes})
            for name, value in alone.items():
                assert torch.equal(out[name], value), (step, name)
    assert set(engine.rule_states[0]) == set(parts[enc_spec].compressor_state)
    for name, residual in engine.residuals.items():
        owner = next(p for p in parts.values() if name in p.shapes)
        assert torch.equal(residual, owner.residuals[name]), name
    total = sum(p.stats["payload_bytes"][0] for p in parts.values())
    assert engine.stats["payload_bytes"][0] == total - 2 * steps * HEADER_BYTES
    assert engine.stats["dense_payload_bytes"] == [4 * steps * sum(s.numel() for s in SHAPES.values())] * 2


def test_error_feedback_follows_each_rules_compressor_unless_forced() -> None:
    rules = [("enc.*", "qsgd"), ("mid.*", "topk:ratio=0.2")]  # qsgd is unbiased: no residual
    engine = sim("none", rules=rules)
    engine.reduce(grads(2, 0))
    assert set(engine.residuals) == {"mid.weight", "mid.bias"}
    forced = sim("none", rules=rules, error_feedback=True)
    forced.reduce(grads(2, 0))
    assert set(forced.residuals) == set(SHAPES)


def test_min_numel_sends_small_tensors_exactly_without_state() -> None:
    engine = sim("topk:ratio=0.1", min_numel=20)
    small = {n for n, s in SHAPES.items() if s.numel() < 20}
    assert small == {"head.bias", "mid.bias", "scale"}
    assert engine.dense_names == frozenset(small)
    for step in range(2):
        g = grads(2, step)
        out = engine.reduce(g)
        for name in small:
            assert torch.equal(out[name], g[name].sum(0) / 2), name
    assert not small & set(engine.residuals)
    assert not small & set(engine.compressor_state.get("steps", {}))
    with pytest.raises(ValueError, match="`min_numel` must be >= 0, got -1"):
        sim("topk:ratio=0.1", min_numel=-1)


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "powersgd:rank=2", ACCORDION])
def test_dense_1d_is_the_dense_rule_on_tensors_of_at_most_one_dimension(spec: str) -> None:
    engines = [
        sim(spec, dense_1d=True),
        sim(spec, rules=[Rule("*", "dense", max_ndim=1)]),
        sim(spec, rules=[("*.bias", "dense"), ("scale", "dense")]),
    ]
    for step in range(3):
        g = grads(2, step)
        outs = [e.reduce(g) for e in engines]
        for out in outs[1:]:
            assert all(torch.equal(out[n], outs[0][n]) for n in SHAPES)
    base = engines[0]
    for other in engines[1:]:
        assert other.stats == base.stats
        assert other.residuals.keys() == base.residuals.keys()
        assert all(torch.equal(other.residuals[n], base.residuals[n]) for n in base.residuals)


def test_accordion_as_a_rule_keeps_its_own_controller() -> None:
    engine = sim("topk:ratio=0.2", rules=[("enc.*", ACCORDION)])
    for step in range(4):
        engine.reduce(grads(2, step))
    levels = gradzip.Accordion.levels(engine.rule_states[0])
    assert set(levels) == {"enc.weight", "enc.bias"}
    assert gradzip.Accordion.counts(engine.rule_states[0])["decisions"] == 3  # first + 2 ends


# -- checkpoints --------------------------------------------------------------------------------
def test_checkpoint_round_trip_continues_bit_identically() -> None:
    rules = [("enc.*", ACCORDION), ("mid.weight", SCHEDULE), ("head.bias", "dense")]
    first = sim("powersgd:rank=2", rules=rules, min_numel=2)
    for step in range(3):
        first.reduce(grads(2, step))
    saved = clone_tree(first.state_dict())
    accordion = gradzip.compressor_from_spec(ACCORDION).spec()
    schedule = gradzip.compressor_from_spec(SCHEDULE).spec()
    assert saved["rules"] == [f"enc.*={accordion}", f"mid.weight={schedule}", "head.bias=dense"]
    assert saved["min_numel"] == 2 and saved["rule_states"][2] == {}
    second = sim("powersgd:rank=2", rules=rules, min_numel=2)
    second.load_state_dict(saved)
    for step in range(3, 6):
        a, b = first.reduce(grads(2, step)), second.reduce(grads(2, step))
        assert all(torch.equal(a[n], b[n]) for n in SHAPES), step
    assert first.stats == second.stats


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"rules": [("enc.*", "sign")]}, "`rules` of the checkpoint must be ['enc.*=sign']"),
        ({"min_numel": 10}, "`min_numel` of the checkpoint must be 10, got 0"),
    ],
)
def test_checkpoint_of_other_rules_is_refused(change: dict[str, Any], fragment: str) -> None:
    engine = sim("topk:ratio=0.1")
    engine.reduce(grads(2, 0))
    saved = engine.state_dict()
    other = sim("topk:ratio=0.1", **change)
    with pytest.raises(ValueError, match=re.escape(fragment)):
        other.load_state_dict(saved)


def test_checkpoint_rule_states_are_validated() -> None:
    rules = [("enc.*", "powersgd:rank=2")]
    engine = sim("topk:ratio=0.1", rules=rules)
    engine.reduce(grads(2, 0))
    saved = engine.state_dict()
    broken = {**saved, "rule_states": [{}]}
    fresh = sim("topk:ratio=0.1", rules=rules)
    with pytest.raises(ValueError, match=r"rule_states\[0\]"):
        fresh.load_state_dict(broken)
    with pytest.raises(ValueError, match="`rule_states` of the checkpoint must list 1 states, got 0"):
        fresh.load_state_dict({**saved, "rule_states": []})
    dense = sim("topk:ratio=0.1", rules=[("enc.*", "dense")])
    with pytest.raises(ValueError, match="`rules` of the checkpoint"):
        dense.load_state_dict(saved)
    assert fresh.step == 0 and dense.step == 0  # unchanged by a refused checkpoint


def test_non_finite_gradient_rolls_back_every_rules_state() -> None:
    engine = sim("topk:ratio=0.2", rules=[("enc.*", ACCORDION)])
    engine.reduce(grads(2, 0))
    before = clone_tree(engine.state_dict())
    # What the step's beginning leaves (Accordion's decision due at step 1, from step 0's
    # window): it stands when the step is skipped, everything the step's calls did does not.
    began = sim("topk:ratio=0.2", rules=[("enc.*", ACCORDION)])
    began.reduce(grads(2, 0))
    began._begin_compressors_step()
    decided = began.state_dict()["rule_states"]
    assert decided[0]["controller"]["counts"]["decisions"] == 2  # the decision was due
    bad = grads(2, 1)
    bad["enc.weight"][1, 0, 0] = float("nan")
    out = engine.reduce(bad)
    assert torch.isnan(out["head.weight"]).all()
    after = engine.state_dict()
    assert after["skipped_steps"] == 1

    def text(tree: object) -> str:
        return json.dumps(tree, default=lambda t: t.tolist())

    for key in ("residuals", "compressor_state"):
        assert text(after[key]) == text(before[key]), key
    assert text(after["rule_states"]) == text(decided)
    assert text(decided) != text(before["rule_states"])


# -- real processes -----------------------------------------------------------------------------
def _handshake(rank: int, world: int, variant: str) -> str:
    options = {
        "rules": {"rules": [("enc.*", "sign" if rank == 0 else "fp16")]},
        "min_numel": {"min_numel": 10 * rank},
    }[variant]
    engine = Engine(SHAPES, "topk:ratio=0.1", **options)
    try:
        engine.reduce({n: g[rank] for n, g in grads(world, 0).items()})
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["rules", "min_numel"])
def test_ranks_with_different_rules_fail_naming_the_field(variant: str) -> None:
    messages = run_processes(_handshake, 2, variant, timeout=120)
    for message in messages:
        assert f"ranks disagree on `{variant}`" in message


def _options() -> EngineOptions:
    return EngineOptions(rules=[("0.*", ACCORDION), ("4.weight", "sign"), ("2.bias", "dense")],
                         min_numel=5)


def _simulated_hook(steps: int) -> dict[str, Any]:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    named = list(model.named_parameters())
    engine = Engine(named, "topk:ratio=0.2", collective=SimulatedGroup(2),
                    options=EngineOptions.build(_options(), optimizer=opt))
    for step in range(steps):
        per_worker: dict[str, list[torch.Tensor]] = {n: [] for n, _ in named}
        for w in range(2):
            model.zero_grad()
            x, y = batch(step, w)
            nn.functional.mse_loss(model(x), y).backward()
            for n, p in named:
                per_worker[n].append(p.grad.clone())
        # same_layout: as the hook, whose buckets DDP verified identical on every rank, the
        # call header rides in the first payload message.
        grads = {n: torch.stack(g) for n, g in per_worker.items()}
        for n, avg in engine.reduce(grads, same_layout=True).items():
            dict(named)[n].grad = avg
        opt.step()
    return {"params": flat_params(model), "stats": engine.stats,
            "levels": gradzip.Accordion.levels(engine.rule_states[0])}


def _hook_worker(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for label, mb in (("one", 25.0), ("tiny", TINY_BUCKET_MB)):
        run = train_ddp(rank, spec="topk:ratio=0.2", steps=4, bucket_cap_mb=mb,
                        hook_kwargs={"options": _options()})
        state = run["state"]
        out[label] = {"params": run["params"], "identical": run["identical"],
                      "stats": state.stats, "checkpoint": clone_tree(state.state_dict())}
    return out


shared_launch.register(2, "rules_hook", _hook_worker, threads=1)


@pytest.mark.slow
def test_simulator_equals_two_gloo_processes_through_the_ddp_hook(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    # Launched with the other modules' workers of this world size (see shared_launch).
    real = shared_launch.results(2, "rules_hook", tmp_path_factory)
    reference = _simulated_hook(4)
    for rank, result in enumerate(real):
        for label, run in result.items():
            torch.testing.assert_close(run["params"], reference["params"], rtol=0, atol=1e-6)
            assert all(run["identical"]), (rank, label)
            assert run["stats"]["levels"] == reference["levels"]
            checkpoint = run["checkpoint"]
            assert checkpoint["rules"] == [r.describe() for r in _options().rules]
            assert checkpoint["min_numel"] == 5
        # One bucket: one reduce per step, as in the simulator: the same messages.
        assert result["one"]["stats"]["payload_bytes"] == reference["stats"]["payload_bytes"][0]


# -- CLI ----------------------------------------------------------------------------------------
def test_cli_rules_and_min_numel_are_recorded_and_refuse_another_configuration(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "run"
    base = ["train", "--task", "digits", "--epochs", "1", "--workers", "2", "--limit-train",
            "200", "--milestones", "5", "--compressor", "topk:ratio=0.1", "--out", str(out),
            "--quiet"]
    args = [*base, "--rule", "*.bias=dense", "--rule", "classifier.*=powersgd:rank=2",
            "--min-numel", "64"]
    assert main(args) == 0, capsys.readouterr().err
    capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["rules"] == ["*.bias=dense", "classifier.*=powersgd:rank=2"]
    assert summary["config"]["min_numel"] == 64
    assert json.loads((out / "run.json").read_text())["config"]["rules"] == summary["config"]["rules"]
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    for extra, message in (
        (["--rule", "*.bias=dense"], "rules ['*.bias=dense', 'classifier.*=powersgd:rank=2'] there"),
        (["--rule", "*.bias=dense", "--rule", "classifier.*=powersgd:rank=2"], "min_numel 64 there, 0 here"),
        (["--rule", "*.bias"], "--rule: `rule` must be PATTERN=SPEC"),
        (["--rule", "x=topk:ratio=7"], "--rule: rule 'x': `ratio` must be in (0, 1]"),
    ):
        code = main([*base, *extra])
        err = capsys.readouterr().err
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == files
    # The same rules continue the run.
    assert main([*args[:4], "2", *args[5:], "--resume"]) == 0, capsys.readouterr().err
