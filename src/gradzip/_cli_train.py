"""What ``gradzip train`` prints: before training (where a run resumes from, an outer-step
run's header), after it (the result), and when interrupted (how to continue)."""

from __future__ import annotations

import os
import shlex
from typing import Any

from gradzip.train.auto_outer import switch_line
from gradzip.train.metrics import format_bytes
from gradzip.train.rundir import read_manifest

__all__ = ["announce", "interrupted_hint", "result_lines"]


def announce(line: str) -> None:
    """Print what a run does before it trains (where it resumes from, its header)."""
    print(f"gradzip train: {line}", flush=True)


def interrupted_hint(argv: list[str], out: str, overwrite: bool) -> str:
    """What an interrupted ``gradzip train`` left in ``out``, and the exact command that
    continues it.

    Args:
        argv: the command's arguments (after ``gradzip``).
        out: the run directory.
        overwrite: whether the run was starting over (``--overwrite``).

    Returns:
        One sentence, without a final period.
    """
    if overwrite:
        return (f"the results in {out} are unchanged (a start over replaces them only once "
                "finished); run the same command again to start over")
    command = "gradzip " + shlex.join([a for a in argv if a != "--resume"] + ["--resume"])
    try:
        manifest = read_manifest(out)
    except (ValueError, OSError):
        manifest = None
    if manifest is None:
        return f"no checkpoint in {out} yet; resume (from the beginning) with: {command}"
    return f"{out} holds the checkpoint of epoch {manifest.epoch}; resume with: {command}"


def result_lines(summary: dict[str, Any], cfg: Any) -> list[str]:
    """The lines printed after a finished run: what ran, the result, the files written."""
    metric = summary["metric"]
    value = summary[f"final_{metric}"]
    if value is None:
        shown = "-"
    else:
        shown = f"{100 * value:.2f}%" if metric == "accuracy" else f"{value:.2f}"
    comp = summary["compression"]
    lines = [
        f"{summary['task']}: {summary['workers']} workers ({summary['launcher']}), "
        f"{summary['compressor']}"
        + (f" <-> {summary['accordion']} (Accordion)" if summary["accordion"] else "")
        + (f" <-> {cfg.gentle or 'none'} (schedule)"
           if cfg.level_schedule or cfg.warmup_steps else "")
        + (", global batch {} <-> {} (Accordion)".format(*summary["accordion_batch"])
           if summary.get("accordion_batch") else "")
        + f", {summary['epochs']} epochs, {summary['steps']} steps",
        f"final {metric} {shown}; sent per worker {format_bytes(summary['bytes_sent_per_worker'])}"
        f" ({comp:.1f}x less than dense); {summary['wall_seconds']:.1f} s"
        if comp else f"final {metric} {shown}; {summary['wall_seconds']:.1f} s",
    ]
    dense_step = summary.get("dense_step_bytes_per_worker")
    if dense_step and summary["steps"] and summary["bytes_sent_per_worker"]:
        per_step = summary["bytes_sent_per_worker"] / summary["steps"]
        lines.append(f"outer-step training (H={cfg.outer_steps}): per optimizer step "
                     f"{format_bytes(per_step)} sent per worker vs {format_bytes(dense_step)} "
                     f"for per-step dense averaging ({dense_step / per_step:.1f}x less)")
    if summary.get("auto_outer") is not None:  # --auto-outer: whether it switched, and why
        lines.append(switch_line(summary["auto_outer"]))
    lines.append(f"wrote {os.path.join(cfg.out, 'metrics.jsonl')} and "
                 f"{os.path.join(cfg.out, 'summary.json')}"
                 + (f"; tensorboard --logdir {os.path.join(cfg.out, 'tensorboard')}"
                    if cfg.tensorboard else ""))
    return lines
