"""MkDocs hook: serve files kept at the repository's root as pages of the site.

BENCHMARKS.md, IMPLEMENTING.md and CHANGELOG.md live beside the code, where readers of the
repository find them; the site links to them as if they were in ``docs/``, and the build
checks those links like any other. Nothing is copied into the source tree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

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
