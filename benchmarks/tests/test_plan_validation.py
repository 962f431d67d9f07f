"""The cost model's validation script: its inputs are solved from the records, its table says
met or missed per row."""

from __future__ import annotations

from benchmarks import plan_validation
from gradzip.plan import measure_traffic


def test_the_lm_shapes_are_solved_from_the_measured_fp32_exchange() -> None:
    shapes = plan_validation._outer_shapes(6_129_834, 4)
    assert measure_traffic("none", 4, shapes=shapes).wire_bytes == 6_129_834


def test_the_table_says_met_or_missed_per_row() -> None:
    rows = [plan_validation._row("a.json", "none", 40.0, 110.0, 100.0, compute_ms=50.0,
                                 predicted_wire_bytes=10, measured_wire_bytes=None),
            plan_validation._row("a.json", "topk", 40.0, 130.0, 100.0, compute_ms=50.0,
                                 predicted_wire_bytes=None, measured_wire_bytes=12.0)]
    assert [r["met"] for r in rows] == [True, False]
    text = plan_validation.markdown(rows, {"cpu": "x", "loadavg_start": [1.0]})
    assert "1 of 2 rows within 25%" in text
    assert "| a.json | none | 40 | 50.0 | 110.0 | 100.0 | +10.0% | met | 10 / - |" in text
    assert "| +30.0% | MISSED | - / 12 |" in text


def test_every_level_auto_records_has_a_spec_to_price() -> None:
    from gradzip import Auto, compressor_from_spec

    auto = Auto()
    for label, level in zip(auto.labels, auto.levels, strict=True):
        assert compressor_from_spec(plan_validation.AUTO_LEVELS[label]) == level, label
