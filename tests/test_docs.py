"""The documentation's promises that need no docs build: every exported name and every
integration class has an entry in the API reference, the README's links point at files that
exist, the README stays a landing page with the quick start's two commands, the code the pages
mark runnable runs as written, and the version has one source."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

import gradzip

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# A Python block that a page promises runs as written, with nothing defined outside it.
RUNNABLE = re.compile(r"^<!-- runnable -->\n```python\n(.*?)^```$", flags=re.M | re.S)
INTEGRATIONS = ("lightning", "accelerate", "transformers")

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
    quick = text[text.index("## Quick start"):text.index("## The API in ten lines")]
    commands = re.search(r"```bash\n(.*?)```", quick, flags=re.S)
    assert commands is not None
    # Two set-up commands on a fresh machine: the CPU build of torch, gradzip and the demo on
    # one line, the test tools and the fast tier of the tests on the other.
    assert commands.group(1).splitlines() == [
        "pip install torch --index-url https://download.pytorch.org/whl/cpu && "
        "pip install -e '.[demo]' && gradzip demo",
        "pip install -e '.[test,integrations]' && python -m pytest -q -m \"not slow\"",
    ]
    assert "the full suite" in quick and "`python -m pytest -q`" in quick
    assert "](docs/architecture.md)" in text
    # CI runs everything, not the fast tier.
    ci = (ROOT / ".ci" / "run").read_text()
    runs = re.findall(r"^python3 -m pytest -q.*$", ci, flags=re.M)
    assert runs and all(" -m " not in line.removeprefix("python3 -m pytest") for line in runs)


def test_no_page_installs_gradzip_from_a_package_index() -> None:
    # gradzip is installed from a clone or a wheel built from one; `pip install gradzip[...]`
    # would ask an index that does not hold it.
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]
    bad = [f"{p.relative_to(ROOT)}: {m}" for p in pages
           for m in re.findall(r"pip install [^`\n]*gradzip\[[^`\n]*", p.read_text())]
    assert bad == []


def _runnable_blocks() -> list[tuple[str, str]]:
    blocks = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for n, code in enumerate(RUNNABLE.findall(page.read_text())):
            blocks.append((f"{page.relative_to(ROOT).as_posix()}#{n}", code))
    return blocks


def test_the_pages_mark_their_first_scripts_runnable() -> None:
    names = {name for name, _ in _runnable_blocks()}
    assert {"README.md#0", "docs/getting-started.md#0", "docs/getting-started.md#1",
            "docs/concepts/outer.md#0", "docs/concepts/rules.md#0"} <= names
    readme = (ROOT / "README.md").read_text()
    guide = (ROOT / "docs" / "getting-started.md").read_text()
    assert RUNNABLE.findall(readme)[0] == RUNNABLE.findall(guide)[0]  # one API in ten lines


@pytest.mark.parametrize("name, code", _runnable_blocks(), ids=[n for n, _ in _runnable_blocks()])
def test_runnable_blocks_run_as_written(name: str, code: str, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # what a block writes stays in the test's folder
    namespace: dict[str, object] = {"__name__": "__main__"}
    exec(compile(code, name, "exec"), namespace)  # a name the block does not define fails here


def test_the_ddp_page_has_no_paragraph_in_a_table_cell() -> None:
    page = (ROOT / "docs" / "concepts" / "ddp.md").read_text()
    cells = [cell.strip() for line in page.splitlines() if line.startswith("|")
             for cell in line.strip("|").split(" | ")]
    assert [c[:60] for c in cells if len(c) > 250] == []


def _public_names(module: str) -> list[str]:
    """A module's ``__all__``, read from its source (importing the frameworks takes seconds)."""
    path = ROOT / "src" / "gradzip" / "integrations" / f"{module}.py"
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__"
                                                for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{path} has no __all__")


def test_the_api_reference_covers_the_integrations() -> None:
    page = (ROOT / "docs" / "reference" / "api.md").read_text()
    entries = set(re.findall(r"^::: (gradzip\.integrations\.[\w.]+)\s*$", page, flags=re.M))
    public = {f"gradzip.integrations.{m}.{name}" for m in INTEGRATIONS for name in _public_names(m)}
    assert public - entries == set(), "integration names missing from docs/reference/api.md"
    assert entries - public == set(), "entries the integrations do not export"


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
