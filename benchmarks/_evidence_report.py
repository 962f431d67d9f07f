"""The outputs of claims_evidence.py: its markdown tables (per seed, and pooled over seeds)
and its plot of the metric per epoch. Pure formatting of what the analysis computed; nothing
here reads run files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gradzip.bench.table import format_table


def _fmt(value: Any, pattern: str = "{:.2f}") -> str:
    return "-" if value is None else pattern.format(value)


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table in ``gradzip.bench``'s layout, as lines."""
    return format_table([dict(enumerate(r)) for r in rows], list(enumerate(head))).splitlines()


def markdown(groups: list[dict[str, Any]]) -> str:
    """The tables of ``groups`` as markdown."""
    lines: list[str] = []
    for group in groups:
        roles = group["roles"]
        title = f"{group['setting']}, {group['family']}, seed {group['seed']}"
        lines += [f"#### {title}", ""]
        names = [f"{p['phase']} ({p['epochs'][0]:g}-{p['epochs'][1]:g})"
                 for p in next(iter(roles.values()))["phases"]]
        lines += ["Gentle share of layer-steps, overall and per phase (epochs):", ""]
        lines += _table(["role", "final", "overall", *names], [
            [role, f"{entry['final']:.2f}", _fmt(entry["gentle_share"], "{:.1%}"),
             *(_fmt(p["gentle_share"], "{:.0%}") for p in entry["phases"])]
            for role, entry in roles.items()])
        lines += ["", "Metric at each phase's end (change over the phase) [share of the static "
                  "levels' gap recovered there]:", ""]
        lines += _table(["role", *names], [
            [role, *(f"{p['end_value']:.2f} ({_fmt(p.get('gain'), '{:+.2f}')}) "
                     f"[{_fmt(p.get('recovered'), '{:.0%}')}]" for p in entry["phases"])]
            for role, entry in roles.items()])
        lines += _error_table(roles, names)
        drops = [p for p in next(iter(roles.values()))["phases"] if "first_epoch_value" in p]
        if drops:
            lines += ["", "Metric one epoch after each LR drop [gap recovered there]:", ""]
            lines += _table(["role", *(f"epoch {p['epochs'][0] + 1:g}" for p in drops)], [
                [role, *(f"{p['first_epoch_value']:.2f} "
                         f"[{_fmt(p.get('first_epoch_recovered'), '{:.0%}')}]"
                         for p in entry["phases"] if "first_epoch_value" in p)]
                for role, entry in roles.items()])
        fitted = group["fit"]
        if fitted:
            lines += ["", f"Fit of the final value against gentle share: slope "
                      f"{fitted['slope']:.2f} per unit share, intercept {fitted['intercept']:.2f}, "
                      f"R^2 {_fmt(fitted['r2'], '{:.3f}')}, RMSE {fitted['rmse']:.2f}."]
            if "off_static_line" in fitted:
                lines.append("Distance from the line between the static levels: " + ", ".join(
                    f"{k} {v:+.2f}" for k, v in fitted["off_static_line"].items()) + ".")
        weights = group.get("phase_weights")
        if weights:
            lines.append(f"Share of the gap the gentle level recovers per phase (least squares, "
                         f"rank {weights['rank']} of {len(weights['phases'])}; timing-free value "
                         "in brackets): " + ", ".join(
                             f"{w['phase']} {w['weight']:.2f} ({w['timing_free']:.2f})"
                             for w in weights["phases"]) + "; residuals " + ", ".join(
                             f"{k} {v:+.2f}" for k, v in weights["residuals"].items()) + ".")
        decisions = roles.get("accordion", {}).get("decisions")
        if decisions:
            lines.append("")
            lines += _table(["decision", "step (epoch)", "reasons", "critical / steady layers",
                             "largest relative norm change (median)", "layers >= eta"], [
                [str(d["decision"]), f"{d['step']} ({d['epoch']:g})",
                 ", ".join(f"{k} {v}" for k, v in d["reasons"].items()),
                 f"{d['critical']} / {d['steady']}",
                 f"{_fmt(d['max_rel_change'], '{:.3f}')} ({_fmt(d['median_rel_change'], '{:.3f}')})",
                 f"{d['at_or_above_eta']} (eta {d['eta']})"] for d in decisions])
        lines.append("")
    return "\n".join(lines)


def _error_table(roles: dict[str, Any], names: list[str]) -> list[str]:
    """The relative compression error per role and phase (nothing for runs that did not
    record it)."""
    if not any("compression_error" in p for e in roles.values() for p in e["phases"]):
        return []
    lines = ["", "Relative compression error sqrt(sum ||e||^2 / sum ||x||^2), mean over each "
             "phase's epochs [at the gentle / aggressive level, where a run switches]:", ""]
    rows = []
    for role, entry in roles.items():
        cells = []
        for p in entry["phases"]:
            cell = _fmt(p.get("compression_error"), "{:.3f}")
            if "compression_error_gentle" in p or "compression_error_aggressive" in p:
                cell += (f" [{_fmt(p.get('compression_error_gentle'), '{:.3f}')} / "
                         f"{_fmt(p.get('compression_error_aggressive'), '{:.3f}')}]")
            cells.append(cell)
        rows.append([role, *cells])
    return lines + _table(["role", *names], rows)


def markdown_pooled(pools: list[dict[str, Any]]) -> str:
    """The seed means of :func:`pooled` as markdown."""
    lines: list[str] = []
    for pool in pools:
        lines += [f"#### {pool['setting']}, {pool['family']}, mean over seeds", ""]
        lines += _table(["role", "seeds", "mean final", "spread", "mean gap recovered"], [
            [role, ",".join(map(str, r["seeds"])), f"{r['mean_final']:.2f}", f"{r['spread']:.2f}",
             _fmt(r["mean_recovered"], "{:.0%}")] for role, r in pool["roles"].items()])
        weights = pool["phase_weights"]
        if weights:
            lines += ["", f"Phase weights over every seed's runs (rank {weights['rank']}): "
                      + ", ".join(f"{w['phase']} {w['weight']:.2f} ({w['timing_free']:.2f})"
                                  for w in weights["phases"]) + "."]
        lines.append("")
    return "\n".join(lines)


def plot(groups: list[dict[str, Any]], runs: list[dict[str, Any]],
         drops: dict[tuple[str, str, int], list[float]], path: Path) -> bool:
    """The metric per epoch of every role, one panel per setting, family and seed, with the
    LR drops marked.

    Args:
        groups: the per-seed analyses (``analyse`` in claims_evidence.py).
        runs: the runs they came from (the metric's name is read from their summaries).
        drops: the epochs at which each (setting, family, seed)'s LR drops fall.
        path: the PNG file to write.

    Returns:
        False when matplotlib is missing (nothing written), else True.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shown = [g for g in groups if len(g["roles"]) > 0]
    # One row per setting and family, one column per seed: a seed's panel sits under the
    # same seed of the other families, and the figure grows down, not sideways.
    keys = list(dict.fromkeys((g["setting"], g["family"]) for g in shown))
    seeds = sorted({g["seed"] for g in shown})
    fig, axes = plt.subplots(len(keys), len(seeds), figsize=(5.2 * len(seeds), 3.6 * len(keys)),
                             squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    for group in shown:
        ax = axes[keys.index((group["setting"], group["family"]))][seeds.index(group["seed"])]
        ax.set_visible(True)
        for role, entry in group["roles"].items():
            values = entry["per_epoch"]
            style = "-" if role in ("gentle", "aggressive") else "--"
            ax.plot(range(1, len(values) + 1), values, style, marker=".", label=role)
        key = (group["setting"], group["family"], group["seed"])
        run = next(r for r in runs if (r["setting"], r["family"], r["seed"]) == key)
        for first in drops[key]:
            ax.axvline(first, color="grey", linewidth=0.6)
        ax.set_title(f"{group['setting']} {group['family']} seed {group['seed']}", fontsize=9)
        ax.set_xlabel("epoch")
        metric = run["summary"]["metric"]
        ax.set_ylabel("test accuracy (%)" if metric == "accuracy" else f"{metric} (log scale)")
        if metric != "accuracy":
            ax.set_yscale("log")  # the first epochs' perplexities would flatten the rest
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True
