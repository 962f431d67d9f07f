"""The before/after engine benchmark (benchmarks/engine_ab.py): the other revision's package
extracted under its own name, the arguments, and a tiny run of a revision against itself
(its agreement, never its timings)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from benchmarks import engine_ab


def test_the_other_revision_is_a_package_of_its_own(tmp_path) -> None:
    root = engine_ab.extract("HEAD", tmp_path)
    package = root / engine_ab.BEFORE
    sources = {p: p.read_text() for p in package.rglob("*.py")}
    assert package / "engine" / "core.py" in sources
    # No module of it imports the installed package: both revisions stay apart in one process.
    own = re.compile(r"^\s*(from gradzip[. ]|import gradzip\b)", re.MULTILINE)
    assert not [p for p, text in sources.items() if own.search(text)]
    assert any("from gradzip_before." in text for text in sources.values())
    # Loaded in a process of its own (this one keeps its modules as they are).
    code = ("import sys, pathlib; from benchmarks import engine_ab; "
            "m = engine_ab.load(pathlib.Path(sys.argv[1])); "
            "import gradzip_before.engine.core as c; print(m.__name__, c.Engine.__module__)")
    out = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True,
                         check=True, cwd=engine_ab.ROOT)
    assert out.stdout.split() == ["gradzip_before", "gradzip_before.engine.core"]


def test_arguments_are_validated() -> None:
    with pytest.raises(SystemExit):
        engine_ab.main([])  # --before is required
    with pytest.raises(SystemExit):
        engine_ab.main(["--before", "HEAD", "--rounds", "0"])
    with pytest.raises(SystemExit):
        engine_ab.main(["--before", "HEAD", "--only", "ddp"])
    with pytest.raises(SystemExit):
        engine_ab.main(["--before", "no-such-revision-anywhere"])


def test_the_table_shows_every_scheme_and_a_disagreement() -> None:
    rows = [{"scheme": "gradzip:sign", "before_min_ms": 2.0, "before_median_ms": 2.5,
             "now_min_ms": 1.5, "now_median_ms": 2.0, "ratio_min": 0.75, "same_bits": True},
            {"scheme": "gradzip-fused:none", "before_min_ms": 1.0, "before_median_ms": 1.0,
             "now_min_ms": 1.0, "now_median_ms": 1.0, "ratio_min": 1.0, "same_bits": False}]
    text = engine_ab.table(rows)
    assert "| `gradzip:sign` | 2.000 | 2.500 | 1.500 | 2.000 | 0.750 | yes |" in text
    assert text.rstrip().endswith("| NO |")


@pytest.mark.slow
def test_a_revision_against_itself_gives_the_same_bits(tmp_path) -> None:
    code = engine_ab.main(["--before", "HEAD", "--out", str(tmp_path), "--rounds", "2",
                           "--steps", "2", "--warmup", "1", "--width", "1",
                           "--only", "gradzip:sign", "--only", "gradzip-fused:topk:ratio=0.01"])
    assert code == 0
    saved = json.loads((tmp_path / "engine_ab.json").read_text())
    assert saved["meta"]["before"] == "HEAD"
    assert [r["scheme"] for r in saved["rows"]] == ["gradzip:sign", "gradzip-fused:topk:ratio=0.01"]
    for row in saved["rows"]:
        assert row["same_bits"] is True
        assert row["before_min_ms"] > 0 and row["now_min_ms"] > 0
