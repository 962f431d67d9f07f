"""The documentation's promises that need no docs build: every exported name has an entry in
the API reference, the README's links point at files that exist, the README stays a landing
page with the quick start's two commands, and the version has one source."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import gradzip

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = None


def test_every_exported_name_has_an_api_reference_entry() -> None:
    page = (ROOT / "docs" / "reference" / "api.md").read_text()
    entries = set(re.findall(r"^::: gradzip\.(\w+)\s*$", page, flags=re.M))
    exported = set(gradzip.__all__) - {"__version__"}
    assert exported - entries == set(), "exported names missing from docs/reference/api.md"
    assert entries - exported == set(), "entries in docs/reference/api.md that gradzip does not export"


def test_links_point_at_files_that_exist_in_the_repository() -> None:
    # Read in the repository, the README and every page link by real paths (the site's build
    # maps those to where it serves BENCHMARKS.md and the other root files).
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    missing = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert missing == []
    readme = (ROOT / "README.md").read_text()
    assert "](docs/getting-started.md)" in readme and "](BENCHMARKS.md)" in readme


def test_readme_is_a_landing_page_with_the_quick_start_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 250
    assert "pip install -e '.[demo]' && gradzip demo" in text
    assert "pip install -e '.[test,integrations]' && python -m pytest -q" in text
    assert "](docs/architecture.md)" in text


def test_every_docs_page_is_in_the_site_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert {p for p in pages if f": {p}" not in nav} == set()


def test_the_version_has_one_source() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    if tomllib is not None:
        project = tomllib.loads(text)
        assert "version" not in project["project"]
        assert project["project"]["dynamic"] == ["version"]
        assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gradzip.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", gradzip.__version__)


def test_links_into_the_api_reference_name_documented_objects() -> None:
    # MkDocs checks links between pages, but not anchors that the API reference generates:
    # each `reference/api.md#gradzip.X[.member]` must name an exported object (or its member).
    anchors = set()
    for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        anchors.update(re.findall(r"reference/api\.md#([\w.]+)\)", page.read_text()))
    assert anchors, "the concept pages link into the API reference"
    for anchor in sorted(anchors):
        first, name, *members = anchor.split(".")
        assert first == "gradzip" and name in gradzip.__all__, anchor
        obj = getattr(gradzip, name)
        for member in members:
            obj = getattr(obj, member)
