"""Why Accordion lands where it does: per-phase evidence from the claims grid's own run files
(BENCHMARKS.md section 4).

For every run of a level pair (``gentle``, ``aggressive``, ``accordion``, ``critical-gentle``,
``critical-aggressive``) the script reads ``summary.json``, ``metrics.jsonl`` (one record per
epoch) and ``accordion_decisions.json`` (every decision, per layer, with the norms it compared)
and reports:

* per phase of training (the first K epochs, the rest before the first learning-rate drop, and
  the epochs after each drop): the share of layer-steps at the gentle level, and the accuracy at
  the phase's end against the two static levels of the same seed (the share of their gap
  recovered there);
* per phase, the mean relative compression error of the phase's epochs
  (``sqrt(sum ||e||^2 / sum ||x||^2)``, the epoch records' ``compression_error``; with a
  controller also at the gentle and the aggressive level) where the runs recorded it;
* what the rule decided at each decision: the reasons, the levels, and the largest relative
  change of a layer's gradient norm against ``eta``;
* per seed, a least-squares fit of the final metric against the run's overall gentle share
  across the roles, and each role's distance from the straight line between the two static
  levels (0 when a gentle step helps in proportion to the number of gentle steps, whatever
  their timing; the papers' premise predicts ``critical-gentle`` far above that line and
  ``critical-aggressive`` far below it).

Outputs: ``NAME.json`` (everything), ``NAME.md`` (the tables) and ``NAME.png`` (the metric per
epoch, one panel per seed; needs matplotlib) in ``--out``; the tables and the plot are drawn by
``_evidence_report.py`` beside this file.

Usage::

    python -m benchmarks.claims_evidence                       # the archive in results/
    python -m benchmarks.claims_evidence --runs runs/claims --out /tmp/evidence
    python -m benchmarks.claims_evidence --runs A.tar.gz --runs B.tar.gz \
        --only cifar10-resnet8/powersgd --name other   # B's runs replace A's of the same key
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from gradzip.engine.error import ERROR_KEYS

from ._claims_plan import SETTINGS
from ._evidence_report import markdown, markdown_pooled, plot

HERE = Path(__file__).resolve().parent

LEVEL_ROLES = ("gentle", "aggressive", "accordion", "critical-gentle", "critical-aggressive")
#: First critical regime (epochs) of the grid's settings; other settings use their warm-up.
EARLY_EPOCHS = {name: setting.critical[0] for name, setting in SETTINGS.items()}


# -- reading ----------------------------------------------------------------------------------
def _read_json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def load_runs(root: Path) -> list[dict[str, Any]]:
    """Every finished run of a level pair under ``root`` (``SETTING/FAMILY/ROLE/seedN``).

    Returns:
        One dict per run: ``setting``, ``family``, ``role``, ``seed``, ``summary``, ``epochs``
        (the epoch records, in order) and ``decisions`` (None when the run logged none).
    """
    runs = []
    for summary_path in sorted(root.rglob("summary.json")):
        folder = summary_path.parent
        parts = folder.relative_to(root).parts
        if len(parts) < 4 or parts[-2] not in LEVEL_ROLES or not parts[-1].startswith("seed"):
            continue
        records = []
        metrics = folder / "metrics.jsonl"
        if metrics.is_file():
            for line in metrics.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    record = json.loads(line)
                    if record.get("kind") == "epoch":
                        records.append(record)
        runs.append({"setting": parts[-4], "family": parts[-3], "role": parts[-2],
                     "seed": int(parts[-1][4:]), "summary": _read_json(summary_path),
                     "epochs": records,
                     "decisions": _read_json(folder / "accordion_decisions.json")})
    return runs


def metric_values(run: dict[str, Any]) -> list[float]:
    """The metric after each epoch (accuracy in percent)."""
    metric = run["summary"]["metric"]
    scale = 100.0 if metric == "accuracy" else 1.0
    return [scale * r[metric] for r in run["epochs"]]


def final_value(run: dict[str, Any]) -> float:
    """The run's final metric from its summary (accuracy in percent)."""
    summary = run["summary"]
    scale = 100.0 if summary["metric"] == "accuracy" else 1.0
    return scale * summary[f"final_{summary['metric']}"]


# -- gentle time ------------------------------------------------------------------------------
def gentle_per_step(run: dict[str, Any]) -> list[float] | None:
    """The share of compressed layers at the gentle level at each step.

    The static levels are gentle (1) or aggressive (0) throughout; the others follow their
    decision log: a decision at step ``s`` sets the level from step ``s`` on (several at one
    step apply in order; a level schedule's decisions name the whole model). None when a run
    that switches levels logged no decision.
    """
    steps = int(run["summary"]["steps"])
    if run["role"] in ("gentle", "aggressive"):
        return [1.0 if run["role"] == "gentle" else 0.0] * steps
    if not run["decisions"]:
        return None
    levels: dict[str, str] = {}
    share = [0.0] * steps
    decisions = sorted(run["decisions"], key=lambda d: (d["step"], d["decision"]))
    i = 0
    for step in range(steps):
        while i < len(decisions) and decisions[i]["step"] <= step:
            levels[decisions[i]["name"]] = decisions[i]["level"]
            i += 1
        if levels:
            share[step] = sum(v == "critical" for v in levels.values()) / len(levels)
    return share


def phases(run: dict[str, Any]) -> list[tuple[str, float, float]]:
    """``(name, first epoch, end epoch)``: the first K epochs, the rest before the first LR
    drop, and the epochs after each drop (epochs counted from 0; the end is exclusive)."""
    config = run["summary"]["config"]
    epochs = float(run["summary"]["epochs"])
    early = EARLY_EPOCHS.get(run["setting"], float(config.get("warmup_epochs") or 1))
    drops = sorted(m * epochs if m < 1 else float(m) for m in config.get("milestones") or [])
    bounds = [0.0, min(early, epochs)] + [d for d in drops if early < d < epochs] + [epochs]
    first = "first epoch" if early == 1 else f"first {early:g} epochs"
    names = [first, "before the first LR drop"] + [
        f"after LR drop {n + 1}" for n in range(len(bounds) - 3)]
    if len(drops) == 0 or bounds[1] >= bounds[2]:
        names[1] = "after the first epochs"
    return [(names[n], bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]


def _epoch_steps(run: dict[str, Any]) -> list[int]:
    """Cumulative steps at the end of each epoch (0 first)."""
    return [0] + [int(r["step"]) for r in run["epochs"]]


def _recovered(value: float, gentle: float, aggressive: float) -> float | None:
    """The share of the aggressive-to-gentle gap recovered (None when the gap is under 0.1)."""
    gap = gentle - aggressive
    return None if abs(gap) < 0.1 else (value - aggressive) / gap


# -- analysis ---------------------------------------------------------------------------------
def analyse_group(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Phases, decisions and the fit for the runs of one setting, family and seed."""
    by_role = {r["role"]: r for r in runs}
    gentle, aggressive = by_role.get("gentle"), by_role.get("aggressive")
    out: dict[str, Any] = {"roles": {}}
    for role in LEVEL_ROLES:
        run = by_role.get(role)
        if run is None:
            continue
        values, per_step, ends = metric_values(run), gentle_per_step(run), _epoch_steps(run)
        share = None if per_step is None else sum(per_step) / len(per_step)
        final = final_value(run)
        entry: dict[str, Any] = {
            "final": round(final, 3), "gentle_share": None if share is None else round(share, 4),
            "wire_bytes_per_worker": run["summary"]["bytes_sent_per_worker"],
            "per_epoch": [round(v, 3) for v in values], "phases": []}
        for name, first, end in phases(run):
            a, b = int(first), int(math.ceil(end))
            if b > len(values):
                break
            lo, hi = ends[a], ends[b]
            phase: dict[str, Any] = {
                "phase": name, "epochs": [first, end], "end_value": round(values[b - 1], 3),
                "gentle_share": None if per_step is None or hi <= lo
                else round(sum(per_step[lo:hi]) / (hi - lo), 4)}
            if gentle is not None and aggressive is not None and b <= min(
                    len(gentle["epochs"]), len(aggressive["epochs"])):
                g, w = metric_values(gentle)[b - 1], metric_values(aggressive)[b - 1]
                phase["static_gap"] = round(g - w, 3)
                rec = _recovered(values[b - 1], g, w)
                phase["recovered"] = None if rec is None else round(rec, 3)
            phase.update(phase_errors(run["epochs"][a:b]))
            if entry["phases"]:
                phase["gain"] = round(values[b - 1] - entry["phases"][-1]["end_value"], 3)
            if len(entry["phases"]) >= 2 and a < len(values):  # a phase opened by an LR drop
                phase["first_epoch_value"] = round(values[a], 3)
                if gentle is not None and aggressive is not None and a < min(
                        len(gentle["epochs"]), len(aggressive["epochs"])):
                    rec = _recovered(values[a], metric_values(gentle)[a],
                                     metric_values(aggressive)[a])
                    phase["first_epoch_recovered"] = None if rec is None else round(rec, 3)
            entry["phases"].append(phase)
        if run["decisions"] and role == "accordion":
            entry["decisions"] = decision_table(run)
        out["roles"][role] = entry
    out["fit"] = fit(out["roles"])
    out["phase_weights"] = phase_weights(out["roles"])
    return out


def phase_errors(records: list[dict[str, Any]]) -> dict[str, float]:
    """The mean of each compression-error key over a phase's epoch records, for the keys some
    record of the phase holds a value for (none for runs recorded before the key existed)."""
    out = {}
    for key in ERROR_KEYS:
        values = [r[key] for r in records if r.get(key) is not None]
        if values:
            out[key] = round(sum(values) / len(values), 4)
    return out


def decision_table(run: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per decision: step, epoch, reasons, levels and the relative norm changes."""
    eta = run["summary"]["config"].get("eta")
    per_epoch = _epoch_steps(run)[1] or 1
    rows: dict[int, dict[str, Any]] = {}
    for d in run["decisions"]:
        row = rows.setdefault(d["decision"], {
            "decision": d["decision"], "step": d["step"],
            "epoch": round(d["step"] / per_epoch, 2), "reasons": {}, "critical": 0, "steady": 0,
            "rel_changes": []})
        row["reasons"][d["reason"]] = row["reasons"].get(d["reason"], 0) + 1
        row["critical" if d["level"] == "critical" else "steady"] += 1
        if d.get("rel_change") is not None:
            row["rel_changes"].append(d["rel_change"])
    table = []
    for row in rows.values():
        changes = sorted(row.pop("rel_changes"))
        row["max_rel_change"] = round(changes[-1], 4) if changes else None
        row["median_rel_change"] = round(changes[len(changes) // 2], 4) if changes else None
        row["at_or_above_eta"] = (sum(c >= eta for c in changes)
                                  if changes and eta is not None else 0)
        row["eta"] = eta
        table.append(row)
    return table


def fit(roles: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Final metric against gentle share: least squares over the roles, and each role's
    distance from the line through the two static levels (None with under 3 roles)."""
    points = [(r["gentle_share"], r["final"], name) for name, r in roles.items()
              if r["gentle_share"] is not None]
    if len(points) < 3:
        return None
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    slope = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx if sxx else 0.0
    intercept = my - slope * mx
    ss_res = sum((p[1] - intercept - slope * p[0]) ** 2 for p in points)
    ss_tot = sum((p[1] - my) ** 2 for p in points)
    result: dict[str, Any] = {"slope": round(slope, 3), "intercept": round(intercept, 3),
                              "r2": round(1 - ss_res / ss_tot, 4) if ss_tot else None,
                              "rmse": round(math.sqrt(ss_res / n), 3)}
    if "gentle" in roles and "aggressive" in roles:
        g, w = roles["gentle"]["final"], roles["aggressive"]["final"]
        result["off_static_line"] = {
            name: round(value - (w + share * (g - w)), 3) for share, value, name in points}
        result["recovered"] = {name: None if (rec := _recovered(value, g, w)) is None
                               else round(rec, 3) for share, value, name in points}
    return result


RCOND = 0.01  # relative singular value below which a combination of phases is not determined


def phase_weights(roles: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """How much a phase's gentle time is worth: least squares of each role's final recovered
    share against its gentle share per phase, ``recovered = sum_p w_p * share_p``.

    ``w_p`` is the share of the whole gap that the gentle level throughout phase ``p`` recovers
    (timing-free: ``w_p`` = the phase's share of the run's steps). Phases whose gentle shares
    are equal in every role, or nearly (``RCOND``), cannot be told apart: the minimum-norm
    split is reported, and ``rank`` says how many combinations the runs determine. None
    without both static levels and at least two other roles.
    """
    fitted = fit(roles)
    if not fitted or "recovered" not in fitted:
        return None
    rows = [(n, [p["gentle_share"] for p in roles[n]["phases"]], fitted["recovered"][n])
            for n in roles if n != "aggressive" and fitted["recovered"].get(n) is not None]
    return _solve(rows, next(iter(roles.values()))["phases"])


def _solve(rows: list[tuple[str, list[float | None], float]],
           phases_: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Least squares ``recovered = shares @ w`` over ``rows`` ``(name, shares, recovered)``."""
    import numpy as np

    rows = [r for r in rows if len(r[1]) == len(phases_) and None not in r[1]]
    if len(rows) < 3:
        return None
    a = np.array([r[1] for r in rows], dtype=float)
    b = np.array([r[2] for r in rows], dtype=float)
    # Why a cut-off: one layer of 29 kept gentle for two more epochs after the second drop
    # makes the two post-drop phases differ by 0.02 in one run's share, and an exact fit
    # then splits the gap between them as +-2, fitting noise. A direction the shares span
    # by less than RCOND of the largest is left undetermined instead.
    w, _, rank, _ = np.linalg.lstsq(a, b, rcond=RCOND)
    total = phases_[-1]["epochs"][1] - phases_[0]["epochs"][0]
    return {"rank": int(rank), "residuals": {r[0]: round(float(x), 3) for r, x in
                                             zip(rows, b - a @ w, strict=True)},
            "phases": [{"phase": p["phase"], "weight": round(float(x), 3),
                        "per_epoch": round(float(x) / (p["epochs"][1] - p["epochs"][0]), 4),
                        "timing_free": round((p["epochs"][1] - p["epochs"][0]) / total, 3)}
                       for p, x in zip(phases_, w, strict=True)]}


def pooled(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setting and family with two or more seeds: each role's mean final value and mean
    recovered share over the seeds that ran it, and the phase weights over every seed's rows."""
    by_key: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for group in groups:
        by_key.setdefault((group["setting"], group["family"]), []).append(group)
    out = []
    for (setting, family), items in sorted(by_key.items()):
        if len(items) < 2:
            continue
        roles: dict[str, dict[str, Any]] = {}
        rows: list[tuple[str, list[float | None], float]] = []
        for group in items:
            recovered = (group["fit"] or {}).get("recovered", {})
            for name, entry in group["roles"].items():
                role = roles.setdefault(name, {"seeds": [], "finals": [], "recovered": []})
                role["seeds"].append(group["seed"])
                role["finals"].append(entry["final"])
                if recovered.get(name) is not None:
                    role["recovered"].append(recovered[name])
                    if name != "aggressive":
                        rows.append((f"{name}/seed{group['seed']}",
                                     [p["gentle_share"] for p in entry["phases"]],
                                     recovered[name]))
        summary = {name: {"seeds": r["seeds"],
                          "mean_final": round(sum(r["finals"]) / len(r["finals"]), 3),
                          "spread": round(max(r["finals"]) - min(r["finals"]), 3),
                          "mean_recovered": round(sum(r["recovered"]) / len(r["recovered"]), 3)
                          if r["recovered"] else None} for name, r in roles.items()}
        first = next(iter(items[0]["roles"].values()))["phases"]
        out.append({"setting": setting, "family": family, "roles": summary,
                    "phase_weights": _solve(rows, first)})
    return out


def analyse(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`analyse_group` for every setting, family and seed, in that order."""
    groups: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["setting"], run["family"], run["seed"]), []).append(run)
    return [{"setting": s, "family": f, "seed": seed, **analyse_group(items)}
            for (s, f, seed), items in sorted(groups.items())]


def lr_drops(runs: list[dict[str, Any]]) -> dict[tuple[str, str, int], list[float]]:
    """The epochs of the LR drops for every setting, family and seed (from its first run)."""
    drops: dict[tuple[str, str, int], list[float]] = {}
    for run in runs:
        drops.setdefault((run["setting"], run["family"], run["seed"]),
                         [first for _, first, _ in phases(run)[2:]])
    return drops


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", action="append", metavar="FOLDER_OR_ARCHIVE",
                   help="a runs folder or an archive written by claims.py --pack (default "
                        "results/claims-runs.tar.gz); repeatable: a run of a later source "
                        "replaces the same setting, family, role and seed of an earlier one")
    p.add_argument("--only", action="append", metavar="SETTING/FAMILY",
                   help="keep the runs of this setting and family (repeatable; default all)")
    p.add_argument("--out", default=str(HERE / "results"), help="where the outputs go")
    p.add_argument("--name", default="claims_evidence", help="output file stem")
    args = p.parse_args(argv)
    sources = [Path(r) for r in args.runs or [str(HERE / "results" / "claims-runs.tar.gz")]]
    for source in sources:
        if not source.exists():
            raise SystemExit(f"--runs must be a runs folder or archive, got {str(source)!r}")
    for only in args.only or []:
        if only.count("/") != 1 or "" in only.split("/"):
            raise SystemExit(f"--only must be SETTING/FAMILY, got {only!r}")
    by_key: dict[tuple[str, str, str, int], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, source in enumerate(sources):
            root = source
            if source.is_file():
                root = Path(tmp) / str(i)
                with tarfile.open(source, "r:*") as tar:
                    tar.extractall(root, filter="data")
            for run in load_runs(root):
                by_key[(run["setting"], run["family"], run["role"], run["seed"])] = run
    runs = [by_key[k] for k in sorted(by_key)
            if not args.only or f"{k[0]}/{k[1]}" in args.only]
    if not runs:
        raise SystemExit("no finished runs of a level pair in --runs "
                         + ", ".join(str(s) for s in sources)
                         + (f" for --only {', '.join(args.only)}" if args.only else ""))
    groups = analyse(runs)
    pools = pooled(groups)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(
        json.dumps({"per_seed": groups, "pooled": pools}, indent=1) + "\n", encoding="utf-8")
    text = markdown(groups) + ("\n" + markdown_pooled(pools) if pools else "")
    (out / f"{args.name}.md").write_text(text, encoding="utf-8")
    plotted = plot(groups, runs, lr_drops(runs), out / f"{args.name}.png")
    print(text)
    print(f"wrote {out / args.name}.json, .md" + (", .png" if plotted else " (no matplotlib)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
