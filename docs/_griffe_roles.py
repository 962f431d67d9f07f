"""Griffe extension for the API reference: Sphinx roles in docstrings become Markdown.

gradzip's docstrings name other objects with Sphinx roles (``:class:`~gradzip.Engine```),
which Markdown would show as raw text. This turns each role into a link to the object's entry
when the reference page documents it (``gradzip.Engine`` and its public members, the names of
``gradzip.ddp``; a name is looked up as written, then in the docstring's class and module, and
by where it is defined as well as where it is exported), and into inline code otherwise (private helpers and other packages have no
entry to link to; a link to them would fail the strict build). ``~`` shows the last part of
the name only, as in Sphinx.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

#: The classes whose entries list inherited members too (``inherited_members`` in
#: docs/reference/api.md); the others show the members they declare.
INHERITED = {"Engine", "Accordion", "Schedule"}

ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj):`(~?)([^`<>]+?)(?:\(\))?`")


class SphinxRoles(griffe.Extension):
    """Rewrites Sphinx roles in every docstring of the loaded package (see the module)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name != "gradzip":
            return
        documented = _documented(pkg)
        for obj in _walk(pkg, set()):
            if obj.docstring is not None:
                scopes = _scopes(obj)
                obj.docstring.value = ROLE.sub(
                    lambda m, scopes=scopes: _replace(m, scopes, documented),
                    obj.docstring.value)


def _replace(match: re.Match[str], scopes: list[str], documented: dict[str, str]) -> str:
    tilde, target = match.group(1), match.group(2).strip()
    shown = target.rsplit(".", 1)[-1] if tilde else target
    # Sphinx looks a name up as written, then in the current class and module.
    for candidate in [target, *(f"{scope}.{target}" for scope in scopes)]:
        if candidate in documented:
            return f"[`{shown}`][{documented[candidate]}]"
    return f"`{shown}`"


def _scopes(obj: Any) -> list[str]:
    """Where a bare name in ``obj``'s docstring is looked up: its class, then its module."""
    scopes = []
    holder = obj if obj.is_class else obj.parent
    if holder is not None and holder.is_class:
        scopes.append(holder.path)
    scopes.append(obj.module.path)
    return scopes


def _documented(pkg: griffe.Module) -> dict[str, str]:
    """Path (public or where it is defined) -> the identifier the API reference renders it
    under (``::: gradzip.X`` for X in ``__all__``, the names of ``gradzip.ddp``)."""
    names: dict[str, str] = {}

    def add(public: str, target: Any, members: bool, inherited: bool = False) -> None:
        for path in (public, target.path):
            names.setdefault(path, public)
        if not members:
            return
        for member, value in (target.all_members if inherited else target.members).items():
            if member.startswith("_"):
                continue
            value = _resolved(value)
            if value.docstring is not None:
                for path in (f"{public}.{member}", f"{target.path}.{member}"):
                    names.setdefault(path, f"{public}.{member}")

    for name in _all(pkg):
        if name not in pkg.members:
            continue
        target = _resolved(pkg.members[name])
        if name == "ddp":
            add("gradzip.ddp", target, members=False)
            for sub in _all(target):
                if sub in target.members:
                    add(f"gradzip.ddp.{sub}", _resolved(target.members[sub]), members=True)
            continue
        add(f"gradzip.{name}", target, members=target.is_class, inherited=name in INHERITED)
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
