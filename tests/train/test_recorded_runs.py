"""Summaries of a few tiny digits runs, recorded before the package was reorganised.

Reorganising modules must not change a single number: accuracy, losses, bytes and steps of
each run equal the values recorded on the code before the change (same machine, CPU, one
thread). Byte counts were updated once since, when the engine's call header started riding in
the first payload message of each call (accuracy and losses unchanged). Densities recorded then are compared too; runs that reported none then (Accordion,
schedules, QSGD) may report one now.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradzip.train.runner import RunConfig, run

BASE = dict(task="digits", workers=2, epochs=1, limit_train=200)

#: name -> (run options, summary values, per-epoch density recorded, None where none was logged)
RECORDED = {
    "none": (dict(compressor="none"),
        dict(final_accuracy=0.08635097493036212, final_test_loss=2.313858414758879,
             final_train_loss=2.319748123486837, bytes_sent_per_worker=329112,
             payload_bytes_per_worker=329112, steps=6),
        [None]),
    "topk": (dict(compressor="topk:ratio=0.05"),
        dict(final_accuracy=0.0807799442896936, final_test_loss=2.3174698598537606,
             final_train_loss=2.322359283765157, bytes_sent_per_worker=32880,
             payload_bytes_per_worker=32880, steps=6),
        [0.05]),
    "threshold": (dict(compressor="threshold:budget=0.05"),
        dict(final_accuracy=0.08635097493036212, final_test_loss=2.316132186847145,
             final_train_loss=2.3211379845937095, bytes_sent_per_worker=48520,
             payload_bytes_per_worker=44872, steps=6),
        [0.06399265528479012]),
    "qsgd": (dict(compressor="qsgd:levels=4"),
        dict(final_accuracy=0.08913649025069638, final_test_loss=2.313911714261621,
             final_train_loss=2.3200987180074057, bytes_sent_per_worker=41334,
             payload_bytes_per_worker=41334, steps=6),
        [None]),
    "powersgd_accordion": (dict(compressor="powersgd:rank=1", accordion="powersgd:rank=4", epochs=2, interval_epochs=1.0),
        dict(final_accuracy=0.14484679665738162, final_test_loss=2.2958453930188023,
             final_train_loss=2.283812483151754, bytes_sent_per_worker=97996,
             payload_bytes_per_worker=97996, steps=12),
        [None, None]),
    "topk_schedule": (dict(compressor="topk:ratio=0.02", warmup_steps=3),
        dict(final_accuracy=0.08635097493036212, final_test_loss=2.314267894351715,
             final_train_loss=2.3198586106300354, bytes_sent_per_worker=171132,
             payload_bytes_per_worker=171132, steps=6),
        [None]),
}


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_summary_equals_the_recorded_one(tmp_path: Path, name: str) -> None:
    options, want, density = RECORDED[name]
    summary = run(RunConfig(**{**BASE, **options, "out": str(tmp_path)}))  # type: ignore[arg-type]
    assert {k: summary[k] for k in want} == want
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in rows if r.get("kind") == "epoch"]
    assert len(epochs) == len(density)
    for row, recorded in zip(epochs, density, strict=True):
        if recorded is not None:
            assert row["density"] == recorded
    if name == "topk_schedule":  # a controller reports density through its levels now
        assert all(0.02 < r["density"] < 1 for r in epochs)
