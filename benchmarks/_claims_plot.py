"""The claims grid's plot (``claims.py --collect``): the final metric against the bytes each
worker sent, one panel per setting. Level pairs appear as points (mean over seeds, with a bar
from the lowest to the highest seed); the sparsifier curves (Top-k and the hard threshold at
several densities) as lines, so that one lying above the other where their byte ranges overlap
is what the threshold paper's claim predicts. ``claims.py`` imports it from beside itself."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Marker per role of a level pair.
MARKERS = {"none": "*", "gentle": "o", "aggressive": "s", "accordion": "D",
           "critical-gentle": "^", "critical-aggressive": "v"}
CURVES = ("topk", "threshold")


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean, lowest and highest final metric and mean bytes over seeds, per setting, family,
    role and spec (the input order of first appearance is kept).

    Args:
        rows: ``claims.json`` rows.

    Returns:
        One dict per group with ``setting``, ``family``, ``role``, ``spec``, ``metric``,
        ``seeds``, ``mean``, ``low``, ``high`` and ``mb`` (mean megabytes per worker).
    """
    groups: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        if row["final"] is None:
            continue
        key = (row["setting"], row["family"], row["role"], row["spec"])
        groups.setdefault(key, []).append(row)
    out = []
    for (setting, family, role, spec), items in groups.items():
        finals = [float(i["final"]) for i in items]
        out.append({"setting": setting, "family": family, "role": role, "spec": spec,
                    "metric": items[0]["metric"], "seeds": len(items),
                    "mean": sum(finals) / len(finals), "low": min(finals), "high": max(finals),
                    "mb": sum(i["wire_bytes_per_worker"] for i in items) / len(items) / 1e6})
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> bool:
    """Write the plot of ``rows`` to ``path`` (PNG).

    Args:
        rows: ``claims.json`` rows (any settings; rows without a final value are left out).
        path: the file to write.

    Returns:
        False when matplotlib is missing or no row has a final value (nothing written), else
        True.
    """
    groups = summarise(rows)
    if not groups:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return False
    settings = list(dict.fromkeys(g["setting"] for g in groups))
    # One colour per family and per curve across every panel, so that a series reads the same
    # in each setting.
    series = list(dict.fromkeys(g["family"] for g in groups if g["role"] not in CURVES))
    # (A family and a curve may share a name: the Top-k family and the Top-k curve.)
    keys = [*(("family", f) for f in series), *(("curve", c) for c in CURVES)]
    colours = {key: f"C{n}" for n, key in enumerate(keys)}
    fig, axes = plt.subplots(1, len(settings), figsize=(6.0 * len(settings), 4.4),
                             squeeze=False)
    for ax, setting in zip(axes[0], settings, strict=True):
        mine = [g for g in groups if g["setting"] == setting]
        families = list(dict.fromkeys(g["family"] for g in mine if g["role"] not in CURVES))
        for family in families:
            colour = colours[("family", family)]
            ends = {g["role"]: g for g in mine if g["family"] == family
                    and g["role"] in ("gentle", "aggressive")}
            if len(ends) == 2:
                # What any split of the steps between the static levels buys: the straight
                # line between them in bytes (drawn on the log axis, so sampled).
                lo, hi = ends["aggressive"], ends["gentle"]
                xs = [lo["mb"] + (hi["mb"] - lo["mb"]) * t / 40 for t in range(41)]
                ys = [lo["mean"] + (hi["mean"] - lo["mean"]) * t / 40 for t in range(41)]
                ax.plot(xs, ys, ":", color=colour, linewidth=1,
                        label=f"{family}: line between the static levels")
            for g in (g for g in mine if g["family"] == family):
                ax.errorbar(g["mb"], g["mean"], yerr=[[g["mean"] - g["low"]],
                                                      [g["high"] - g["mean"]]],
                            fmt=MARKERS.get(g["role"], "o"), color=colour, capsize=3,
                            label=f"{family} {g['role']} (n={g['seeds']})")
        for role in CURVES:
            curve = sorted((g for g in mine if g["role"] == role), key=lambda g: g["mb"])
            if curve:
                ax.errorbar([g["mb"] for g in curve], [g["mean"] for g in curve],
                            yerr=[[g["mean"] - g["low"] for g in curve],
                                  [g["high"] - g["mean"] for g in curve]],
                            fmt="-" if role == "threshold" else "--", marker=".",
                            color=colours[("curve", role)], capsize=3,
                            label=f"{role} (n={min(g['seeds'] for g in curve)})")
        metric = mine[0]["metric"]
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        span = max(g["mb"] for g in mine) / max(min(g["mb"] for g in mine), 1e-12)
        # Label the minor ticks only within a decade, where no major tick would show.
        ax.xaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter() if span < 10
                                     else matplotlib.ticker.NullFormatter())
        ax.set_xlabel("MB sent per worker (log)")
        ax.set_ylabel("test accuracy (%)" if metric == "accuracy"
                      else "validation perplexity (lower is better)")
        ax.set_title(setting)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6.5, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
