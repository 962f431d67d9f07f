"""The simulated-exchange cache on disk (gradzip.plan.TrafficCache)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradzip.plan import TrafficCache, measure_traffic
from gradzip.plan import traffic_cache as module
from gradzip.plan.traffic_cache import code_digest, default_traffic_path, traffic_key

SHAPES = {"w": (16, 12), "b": (12,), "v": (40,)}


def test_a_simulation_is_written_and_read_back_without_simulating(tmp_path: Path,
                                                                   monkeypatch) -> None:
    path = tmp_path / "traffic.json"
    made = TrafficCache(path).traffic("topk:ratio=0.1", 3, SHAPES)
    assert made == measure_traffic("topk:ratio=0.1", 3, shapes=SHAPES)
    monkeypatch.setattr(module, "measure_traffic", lambda *a, **k: pytest.fail("simulated"))
    again = TrafficCache(path)  # a later run: a fresh object on the same file
    assert again.traffic("topk:ratio=0.1", 3, SHAPES) == made
    assert again.get(traffic_key("topk:ratio=0.1", 3, SHAPES)) == made


def test_the_key_names_spec_workers_shapes_and_code() -> None:
    key = traffic_key("none", 2, SHAPES)
    assert key.startswith("none|W=2|") and key.endswith(f"code {code_digest()}")
    others = {traffic_key("fp16", 2, SHAPES), traffic_key("none", 3, SHAPES),
              traffic_key("none", 2, {**SHAPES, "b": (13,)}),
              traffic_key("none", 2, dict(reversed(list(SHAPES.items()))))}
    assert key not in others and len(others) == 4


def test_the_code_digest_follows_the_source(tmp_path: Path, monkeypatch) -> None:
    """A changed source file gives another digest (so stale simulations are not read)."""
    package = tmp_path / "gradzip"
    (package / "plan").mkdir(parents=True)
    (package / "a.py").write_text("x = 1\n")
    fake = package / "plan" / "traffic_cache.py"
    fake.write_text("")
    monkeypatch.setattr(module, "__file__", str(fake))
    code_digest.cache_clear()
    try:
        before = code_digest()
        (package / "a.py").write_text("x = 2\n")
        code_digest.cache_clear()
        assert code_digest() != before
    finally:
        monkeypatch.undo()
        code_digest.cache_clear()


def test_the_file_sits_beside_the_timing_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("GRADZIP_PLAN_TIMINGS", str(tmp_path / "t" / "timings.json"))
    assert default_traffic_path() == tmp_path / "t" / "plan-traffic.json"
    assert TrafficCache().path == default_traffic_path()


@pytest.mark.parametrize("text", ["not json", '{"format": 2, "traffic": {}}',
                                  '{"format": 1, "traffic": {"k": {"workers": 2, "exact": true,'
                                  ' "calls": [["broadcast", 4, 4]]}}}',
                                  '{"format": 1, "traffic": {"k": {"workers": 0, "exact": true,'
                                  ' "calls": []}}}'])
def test_a_bad_file_is_refused_naming_it(tmp_path: Path, text: str) -> None:
    path = tmp_path / "traffic.json"
    path.write_text(text)
    with pytest.raises(ValueError, match="gradzip plan traffic file.*traffic.json"):
        TrafficCache(path)


def test_a_path_of_the_wrong_type_is_refused() -> None:
    with pytest.raises(TypeError, match="`path` must be a path, got 3"):
        TrafficCache(3)  # type: ignore[arg-type]


def test_a_file_that_cannot_be_written_is_passed_over(tmp_path: Path, caplog) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    cache = TrafficCache(blocked / "traffic.json")  # its folder is a file
    assert cache.traffic("none", 2, SHAPES) == measure_traffic("none", 2, shapes=SHAPES)
    assert "not cached" in caplog.text
