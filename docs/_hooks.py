"""MkDocs hook: serve files kept at the repository's root as pages of the site.

BENCHMARKS.md, IMPLEMENTING.md and CHANGELOG.md live beside the code, where readers of the
repository find them. The site serves them at its root, and the pages of ``docs/`` link to
them by their real place (``../BENCHMARKS.md`` from ``docs/benchmarks.md``), so that the links
work when the Markdown is read in the repository too; this hook rewrites such links to the
served place before MkDocs checks them like any other. Nothing is copied into the source tree.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

#: Repository files served at the same path in the site (the plot is BENCHMARKS.md's image).
ROOT_FILES = (
    "BENCHMARKS.md",
    "IMPLEMENTING.md",
    "CHANGELOG.md",
    "benchmarks/results/claims.png",
)


def on_files(files: Files, config: Any) -> Files:
    root = Path(config["config_file_path"]).parent
    for name in ROOT_FILES:
        files.append(File(name, src_dir=str(root), dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    return files


LINK = re.compile(r"(\]\()([^()\s#]+)(#[^()\s]*)?\)")


def on_page_markdown(markdown: str, page: Page, config: Any, files: Files) -> str:
    if page.file.src_uri in ROOT_FILES:
        return markdown  # served at the site's root, where they lie in the repository
    docs = Path(config["docs_dir"]).resolve()
    root = Path(config["config_file_path"]).resolve().parent
    here = (docs / page.file.src_uri).parent

    def served(match: re.Match[str]) -> str:
        target = match.group(2)
        if "://" in target or target.startswith(("/", "mailto:")):
            return match.group(0)
        real = (here / target).resolve()
        try:
            name = real.relative_to(root).as_posix()
        except ValueError:
            return match.group(0)
        if name not in ROOT_FILES:
            return match.group(0)
        link = os.path.relpath(docs / name, here).replace(os.sep, "/")
        return f"{match.group(1)}{link}{match.group(3) or ''})"

    return LINK.sub(served, markdown)
