"""Griffe extension for the API reference: Sphinx roles in docstrings become Markdown.

gradzip's docstrings name other objects with Sphinx roles (``:class:`~gradzip.Engine```),
which Markdown would show as raw text. This turns each role into a link to the object's entry
when the reference page documents it (``gradzip.Engine`` and its public members, the names of
``gradzip.ddp``), and into inline code otherwise (private helpers and other packages have no
entry to link to; a link to them would fail the strict build). ``~`` shows the last part of
the name only, as in Sphinx.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj):`(~?)([^`<>]+?)(?:\(\))?`")


class SphinxRoles(griffe.Extension):
    """Rewrites Sphinx roles in every docstring of the loaded package (see the module)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name != "gradzip":
            return
        documented = _documented(pkg)
        for obj in _walk(pkg, set()):
            if obj.docstring is not None:
                obj.docstring.value = ROLE.sub(
                    lambda m: _replace(m, documented), obj.docstring.value)


def _replace(match: re.Match[str], documented: set[str]) -> str:
    tilde, target = match.group(1), match.group(2).strip()
    shown = target.rsplit(".", 1)[-1] if tilde else target
    if target in documented:
        return f"[`{shown}`][{target}]"
    return f"`{shown}`"


def _documented(pkg: griffe.Module) -> set[str]:
    """The identifiers the API reference page renders (``::: gradzip.X`` for X in __all__)."""
    names: set[str] = set()
    exported = [n for n in _all(pkg) if n in pkg.members]
    for name in exported:
        path = f"gradzip.{name}"
        names.add(path)
        target = pkg.members[name]
        if name == "ddp":
            for sub in _all(target):
                names.add(f"{path}.{sub}")
            continue
        for member, value in _resolved(target).members.items():
            if not member.startswith("_") and value.docstring is not None:
                names.add(f"{path}.{member}")
    return names


def _all(module: Any) -> list[str]:
    module = _resolved(module)
    exports = getattr(module, "exports", None)
    return [str(e) for e in exports] if exports else []


def _resolved(obj: Any) -> Any:
    return obj.final_target if isinstance(obj, griffe.Alias) else obj


def _walk(obj: Any, seen: set[str]) -> Any:
    if isinstance(obj, griffe.Alias) or obj.path in seen:
        return
    seen.add(obj.path)
    yield obj
    for member in obj.members.values():
        yield from _walk(member, seen)
