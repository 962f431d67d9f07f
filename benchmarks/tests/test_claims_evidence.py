"""The claims evidence script (benchmarks/claims_evidence.py) on the files of real, tiny runs of
the claims grid's smoke setting: gentle share per phase from the decision logs, the per-phase
table, the fit against gentle share, and the outputs written from a runs folder or an archive."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from benchmarks import claims
from benchmarks import claims_evidence as evidence
from gradzip.train.runner import resolve_config, run


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The smoke setting's five PowerSGD roles, seed 0, trained here (2 epochs, 64 images)."""
    root = tmp_path_factory.mktemp("claims-runs")
    planned = claims.select(claims.plan(claims.SETTINGS["smoke"], [0], root,
                                        {"limit_train": 64, "batch_size": 8}), ["/powersgd"])
    assert {p.role for p in planned} == set(evidence.LEVEL_ROLES)
    for p in planned:
        run(resolve_config(p.config))
    return root


def test_gentle_share_follows_the_logged_decisions(runs_root: Path) -> None:
    runs = {r["role"]: r for r in evidence.load_runs(runs_root)}
    assert set(runs) == set(evidence.LEVEL_ROLES)
    steps = runs["gentle"]["summary"]["steps"]
    assert evidence.gentle_per_step(runs["gentle"]) == [1.0] * steps
    assert evidence.gentle_per_step(runs["aggressive"]) == [0.0] * steps
    # The schedules: gentle in epochs 0-1 and 2-3 (critical regimes of the smoke setting, LR
    # drop at epoch 2), or the reverse.
    per_epoch = steps // 4
    cg = evidence.gentle_per_step(runs["critical-gentle"])
    ca = evidence.gentle_per_step(runs["critical-aggressive"])
    assert cg == [1.0] * per_epoch + [0.0] * per_epoch + [1.0] * per_epoch + [0.0] * per_epoch
    assert ca == [1.0 - x for x in cg]
    # Accordion's share agrees with the counts the run itself reported.
    counts = runs["accordion"]["summary"]["accordion_counts"]
    share = evidence.gentle_per_step(runs["accordion"])
    expected = counts["critical_steps"] / (counts["critical_steps"] + counts["steady_steps"])
    assert sum(share) / len(share) == pytest.approx(expected)


def test_phases_follow_the_settings_regimes_and_drops(runs_root: Path) -> None:
    run_ = evidence.load_runs(runs_root)[0]
    assert evidence.phases(run_) == [("first epoch", 0.0, 1.0),
                                     ("before the first LR drop", 1.0, 2.0),
                                     ("after LR drop 1", 2.0, 4.0)]


def test_group_analysis_fits_and_recovers(runs_root: Path) -> None:
    (group,) = evidence.analyse(evidence.load_runs(runs_root))
    roles = group["roles"]
    assert roles["gentle"]["phases"][-1]["recovered"] in (1.0, None)
    cg = roles["critical-gentle"]["phases"]
    assert [p["gentle_share"] for p in cg] == [1.0, 0.0, 0.5]
    assert cg[0]["end_value"] == roles["gentle"]["phases"][0]["end_value"]  # same first epoch
    # One epoch after the drop (epoch 3): the value of the run's third epoch.
    assert cg[2]["first_epoch_value"] == roles["critical-gentle"]["per_epoch"][2]
    assert roles["aggressive"]["phases"][2]["first_epoch_recovered"] in (0.0, None)
    assert "first_epoch_value" not in cg[0] and "first_epoch_value" not in cg[1]
    assert math.isfinite(group["fit"]["slope"]) and group["fit"]["rmse"] >= 0
    assert set(group["fit"]["off_static_line"]) == set(evidence.LEVEL_ROLES)
    assert group["fit"]["off_static_line"]["gentle"] == 0.0
    decisions = roles["accordion"]["decisions"]
    assert decisions[0]["reasons"] == {"first": decisions[0]["critical"]}
    assert all(d["eta"] == 0.5 for d in decisions)


def test_compression_error_per_role_and_phase(runs_root: Path) -> None:
    runs = evidence.load_runs(runs_root)
    (group,) = evidence.analyse(runs)
    roles = group["roles"]
    for role, entry in roles.items():
        for phase in entry["phases"]:
            assert 0.0 < phase["compression_error"] < 1.0, (role, phase)
    # critical-gentle: the gentle level alone in the first epoch, the aggressive one in the
    # second; each phase reports the level it ran. The overall ratio also counts the tensors
    # both levels send dense (biases under PowerSGD: nothing unsent), so it is lower.
    first, second, _ = roles["critical-gentle"]["phases"]
    assert "compression_error_aggressive" not in first
    assert first["compression_error"] < first["compression_error_gentle"]
    assert "compression_error_gentle" not in second
    assert second["compression_error"] < second["compression_error_aggressive"]
    # The mean over a phase's epochs, from the records themselves.
    run_ = next(r for r in runs if r["role"] == "accordion")
    last = roles["accordion"]["phases"][-1]
    values = [r["compression_error"] for r in run_["epochs"][2:4]]
    assert last["compression_error"] == round(sum(values) / len(values), 4)
    text = evidence.markdown([group])
    assert "Relative compression error" in text
    # Runs recorded before the key existed: no error entries, no table.
    for r in runs:
        for rec in r["epochs"]:
            for key in evidence.ERROR_KEYS:
                rec.pop(key, None)
    (old,) = evidence.analyse(runs)
    assert not any(k in p for e in old["roles"].values() for p in e["phases"]
                   for k in evidence.ERROR_KEYS)
    assert "Relative compression error" not in evidence.markdown([old])


def test_fit_on_known_points() -> None:
    def role(share: float, final: float) -> dict[str, object]:
        return {"gentle_share": share, "final": final, "phases": []}

    roles = {"gentle": role(1.0, 76.0), "aggressive": role(0.0, 67.0),
             "accordion": role(0.5, 71.5), "critical-gentle": role(0.25, 69.25)}
    fitted = evidence.fit(roles)
    assert fitted is not None
    assert fitted["slope"] == pytest.approx(9.0) and fitted["intercept"] == pytest.approx(67.0)
    assert fitted["r2"] == 1.0 and fitted["rmse"] == 0.0
    assert fitted["off_static_line"]["accordion"] == pytest.approx(0.0)
    assert fitted["recovered"]["critical-gentle"] == pytest.approx(0.25)
    above = evidence.fit({**roles, "accordion": role(0.5, 72.5)})
    assert above is not None and above["r2"] < 1.0
    assert above["off_static_line"]["accordion"] == pytest.approx(1.0)
    assert above["recovered"]["accordion"] == pytest.approx(5.5 / 9, abs=1e-3)
    assert evidence.fit({"gentle": role(1.0, 76.0), "aggressive": role(0.0, 67.0)}) is None


def test_phase_weights_recover_known_weights() -> None:
    def role(final: float, shares: list[float]) -> dict[str, object]:
        phases = [{"phase": f"p{i}", "epochs": [2 * i, 2 * i + 2], "gentle_share": s}
                  for i, s in enumerate(shares)]
        return {"gentle_share": sum(shares) / len(shares), "final": final, "phases": phases}

    # Recovered share = 0.6 * s0 + 0.4 * s1 + 0 * s2 on a 10-point gap.
    truth = (0.6, 0.4, 0.0)
    roles = {name: role(60 + 10 * sum(w * s for w, s in zip(truth, shares, strict=True)), shares)
             for name, shares in (("gentle", [1, 1, 1]), ("aggressive", [0, 0, 0]),
                                  ("a", [1, 0, 1]), ("b", [0, 1, 0]), ("c", [1, 0, 0]))}
    weights = evidence.phase_weights(roles)
    assert weights is not None and weights["rank"] == 3
    assert [w["weight"] for w in weights["phases"]] == pytest.approx(list(truth), abs=1e-3)
    assert [w["timing_free"] for w in weights["phases"]] == pytest.approx([1 / 3] * 3, abs=1e-3)


def test_phase_weights_leave_nearly_equal_phases_undetermined() -> None:
    # The last two phases differ only by one run's 0.02 (one layer kept gentle a little
    # longer), and that run ends 1.4 points above its twin (seed noise): an exact fit would
    # put weights about 7 apart on them. They are reported as one undetermined pair instead.
    def role(final: float, shares: list[float]) -> dict[str, object]:
        phases = [{"phase": f"p{i}", "epochs": [2 * i, 2 * i + 2], "gentle_share": s}
                  for i, s in enumerate(shares)]
        return {"gentle_share": sum(shares) / len(shares), "final": final, "phases": phases}

    roles = {"gentle": role(80.0, [1, 1, 1, 1]), "aggressive": role(70.0, [0, 0, 0, 0]),
             "a": role(76.0, [1, 0.3, 0.5, 0.52]), "d": role(74.6, [1, 0.3, 0.5, 0.5]),
             "b": role(72.0, [1, 0, 0.5, 0.5]),
             "c": role(77.0, [0, 1, 0.5, 0.5])}
    weights = evidence.phase_weights(roles)
    assert weights is not None and weights["rank"] == 3  # of 4 exactly, in exact arithmetic
    last = [w["weight"] for w in weights["phases"][2:]]
    assert last[0] == pytest.approx(last[1], abs=0.1) and abs(last[0]) < 1.0


def test_script_writes_json_markdown_and_plot(runs_root: Path, tmp_path: Path) -> None:
    archive = tmp_path / "runs.tar.gz"
    assert claims.pack(runs_root, archive) == 5
    out = tmp_path / "out"
    assert evidence.main(["--runs", str(archive), "--out", str(out), "--name", "ev"]) == 0
    written = json.loads((out / "ev.json").read_text())
    groups = written["per_seed"]
    assert [(g["setting"], g["family"], g["seed"]) for g in groups] == [("smoke", "powersgd", 0)]
    assert written["pooled"] == []  # one seed: nothing to pool
    text = (out / "ev.md").read_text()
    assert "| critical-aggressive |" in text and "largest relative norm change" in text
    png = out / "ev.png"
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size < 300_000
    # The same from the folder itself.
    assert evidence.main(["--runs", str(runs_root), "--out", str(tmp_path / "o2")]) == 0
    assert json.loads((tmp_path / "o2" / "claims_evidence.json").read_text()) == written
    with pytest.raises(SystemExit, match="--runs"):
        evidence.main(["--runs", str(tmp_path / "missing")])


def test_later_sources_replace_runs_and_only_filters(runs_root: Path, tmp_path: Path) -> None:
    # A second source holding one re-run of Accordion (here: the same files, its final
    # accuracy edited): it replaces the first source's run, the other roles stay.
    other = tmp_path / "other"
    rel = Path("smoke/powersgd/accordion/seed0")
    shutil.copytree(runs_root / rel, other / rel)
    summary = json.loads((other / rel / "summary.json").read_text())
    summary["final_accuracy"] = 0.987
    (other / rel / "summary.json").write_text(json.dumps(summary))
    archive = tmp_path / "runs.tar.gz"
    claims.pack(runs_root, archive)
    out = tmp_path / "out"
    assert evidence.main(["--runs", str(archive), "--runs", str(other), "--out", str(out),
                          "--only", "smoke/powersgd"]) == 0
    (group,) = json.loads((out / "claims_evidence.json").read_text())["per_seed"]
    assert set(group["roles"]) == set(evidence.LEVEL_ROLES)
    assert group["roles"]["accordion"]["final"] == pytest.approx(98.7)
    # In the other order the first source's run wins.
    assert evidence.main(["--runs", str(other), "--runs", str(archive), "--out", str(out)]) == 0
    (group,) = json.loads((out / "claims_evidence.json").read_text())["per_seed"]
    assert group["roles"]["accordion"]["final"] != pytest.approx(98.7)
    with pytest.raises(SystemExit,
                       match=r"no finished runs .* in --runs .*runs\.tar\.gz for --only smoke/topk$"):
        evidence.main(["--runs", str(archive), "--out", str(out), "--only", "smoke/topk"])
    with pytest.raises(SystemExit, match="--only must be SETTING/FAMILY, got 'smoke'"):
        evidence.main(["--runs", str(archive), "--out", str(out), "--only", "smoke"])


def test_pooled_means_and_weights_over_seeds() -> None:
    def group(seed: int, finals: dict[str, float]) -> dict[str, object]:
        shares = {"gentle": [1, 1], "aggressive": [0, 0], "a": [1, 0], "b": [0, 1]}
        roles = {name: {"final": final, "gentle_share": sum(shares[name]) / 2,
                        "phases": [{"phase": f"p{i}", "epochs": [i, i + 1], "gentle_share": x}
                                   for i, x in enumerate(shares[name])]}
                 for name, final in finals.items()}
        return {"setting": "s", "family": "f", "seed": seed, "roles": roles,
                "fit": evidence.fit(roles)}

    groups = [group(0, {"gentle": 80.0, "aggressive": 70.0, "a": 77.0, "b": 73.0}),
              group(1, {"gentle": 82.0, "aggressive": 72.0, "a": 79.0, "b": 75.0}),
              group(2, {"gentle": 81.0, "aggressive": 71.0})]
    (pool,) = evidence.pooled(groups)
    assert pool["roles"]["a"] == {"seeds": [0, 1], "mean_final": 78.0, "spread": 2.0,
                                  "mean_recovered": 0.7}
    assert pool["roles"]["gentle"]["seeds"] == [0, 1, 2]
    weights = pool["phase_weights"]
    assert [w["weight"] for w in weights["phases"]] == pytest.approx([0.7, 0.3], abs=1e-3)
    assert "mean over seeds" in evidence.markdown_pooled([pool])
    assert evidence.pooled(groups[:1]) == []
