"""The HSDP quality benchmark's summary and options (its runs spawn processes; not run here)."""

import pytest

from benchmarks import hsdp_quality


def _run(mode: str, spec: str, seed: int, value: float) -> dict:
    return {"mode": mode, "compressor": spec, "seed": seed, "final_perplexity": value,
            "bytes_sent_per_worker": 100 if mode == "ddp" else 40}


def test_summary_groups_by_mode_and_spec_in_the_order_run() -> None:
    runs = [_run(m, s, seed, v) for seed, v in ((0, 10.0), (1, 12.0))
            for m in hsdp_quality.MODES for s in ("topk:ratio=0.01", "none")]
    rows = hsdp_quality.summarize(runs, "perplexity")
    assert [(r["mode"], r["compressor"]) for r in rows] == [
        ("ddp", "topk:ratio=0.01"), ("ddp", "none"),
        ("hsdp 2x2", "topk:ratio=0.01"), ("hsdp 2x2", "none")]
    assert rows[0]["perplexity_mean"] == 11.0 and rows[0]["perplexity_spread"] == 2.0
    assert rows[0]["perplexity_values"] == [10.0, 12.0] and rows[2]["bytes_sent_per_worker"] == 40


def test_the_lm_task_needs_its_corpus() -> None:
    with pytest.raises(SystemExit):
        hsdp_quality.main(["--task", "lm"])
    with pytest.raises(SystemExit):
        hsdp_quality.main(["--seeds", "0"])
