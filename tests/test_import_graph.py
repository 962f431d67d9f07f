"""The package's modules import one another without cycles.

Every ``import`` and ``from ... import`` counts, at any depth (a function-level import that
dodges a cycle at import time is still a cycle: the two modules cannot be understood or
tested apart).
"""

from __future__ import annotations

import ast
from pathlib import Path

import gradzip

ROOT = Path(gradzip.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """``module -> the package modules it imports`` (a package's ``__init__`` is the package;
    ``from pkg import name`` counts as importing ``pkg.name`` where that is a module, else
    ``pkg``)."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                for alias in node.names:
                    full = f"{mod}.{alias.name}"
                    targets.add(full if full in modules else mod)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_function_level_and_relative_imports() -> None:
    graph = import_graph()
    assert "gradzip.compressors.base" in graph["gradzip.compressors.topk"]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_one_that_imports_it_back() -> None:
    assert find_cycles(import_graph()) == []


def test_outer_uses_the_engine_through_its_public_name_only() -> None:
    """``gradzip.outer`` is built on ``Engine``'s public API: from the engine it imports
    ``Engine`` and nothing else (no engine submodule, no underscored name), so the engine's
    internals can change under it."""
    seen = 0
    for path in (ROOT / "outer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
                assert not any(n.startswith("gradzip.engine") for n in names), (path.name, names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradzip.engine"):
                assert node.module == "gradzip.engine", (path.name, node.module)
                assert [alias.name for alias in node.names] == ["Engine"], (path.name, node.module)
                seen += 1
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradzip"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, (path.name, node.module, private)
    assert seen >= 1


def _under(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def imports_between(
    graph: dict[str, set[str]], sources: tuple[str, ...], targets: tuple[str, ...]
) -> dict[str, list[str]]:
    """``module -> the targets it imports`` for every module under ``sources`` that imports a
    module under ``targets`` (packages and modules named by their dotted names)."""
    found = {
        m: sorted(t for t in graph[m] if _under(t, targets))
        for m in graph if _under(m, sources)
    }
    return {m: t for m, t in found.items() if t}


def test_imports_between_sees_packages_and_their_modules() -> None:
    graph = {"p.a": {"q", "r.x"}, "p": {"q.b"}, "pp": {"q"}, "q": set(), "q.b": set(),
             "r.x": set()}
    assert imports_between(graph, ("p",), ("q",)) == {"p": ["q.b"], "p.a": ["q"]}
    assert imports_between(graph, ("p.a",), ("r",)) == {"p.a": ["r.x"]}


def test_the_engine_imports_nothing_from_the_controllers() -> None:
    # The compression-error meter learns a controller's levels through
    # ``Compressor.tensor_levels``: the engine runs any compressor without knowing its kind.
    assert imports_between(import_graph(), ("gradzip.engine",), ("gradzip.control",)) == {}


def test_compressors_import_nothing_from_the_engine() -> None:
    # Finiteness tests that compressors share with the engine live in ``gradzip.ops.finite``.
    engine_side = ("gradzip.engine", "gradzip.statecheck", "gradzip.checkpoint", "gradzip.ddp")
    assert imports_between(import_graph(), ("gradzip.compressors",), engine_side) == {}
