"""Through the runner, with ``--outer-steps H``: ``--warmup-steps`` counts optimizer steps."""

from __future__ import annotations

from pathlib import Path

from test_resume import TINY, records

from gradzip.train.runner import RunConfig, run


def test_warmup_steps_count_optimizer_steps_under_outer_steps(tmp_path: Path) -> None:
    # H = 3 and a warm-up of 6 optimizer steps: the synchronisations after steps 3 and 6 are
    # dense (gentle `none`), every later one Top-k; not the first 6 synchronisations.
    out = tmp_path / "run"
    run(RunConfig(**TINY, epochs=3, out=str(out), outer_steps=3, warmup_steps=6,  # type: ignore[arg-type]
                  compressor="topk:ratio=0.05", log_every=1))
    wire = [(r["step"], r["wire_bytes"]) for r in records(out) if r["kind"] == "step"]
    sent = [after - before for (_, after), (_, before) in zip(wire[1:], wire, strict=False) if after > before]
    assert len(sent) >= 4, wire
    assert sent[0] == sent[1] > 5 * max(sent[2:])
