"""What a run's output path must be before anything is written there: a directory the file
system can create (no file above it, no name too long), whose result files and checkpoint
folder, where present, are of the right kind.

These are configuration errors (``ValueError``, exit status 2 in the CLI), found before the
first write instead of as an ``OSError`` halfway through a run.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["check_out_path"]

#: Entries of a run directory and the kind each must be when present.
_FILES = ("run.json", "metrics.jsonl", "summary.json", "checkpoint/latest.json")
_FOLDERS = ("checkpoint",)
_DEFAULT_NAME_MAX = 255
_DEFAULT_PATH_MAX = 4096


def _short(name: str) -> str:
    return name if len(name) <= 40 else f"{name[:20]}...{name[-12:]}"


def _limit(path: Path, name: str, default: int) -> int:
    try:
        return int(os.pathconf(path, name))
    except (OSError, ValueError, AttributeError):
        return default


def _first_existing(path: Path) -> tuple[Path, list[str]]:
    """The deepest existing folder on ``path``'s way down and the names below it.

    Raises:
        ValueError: a file (not a folder) lies on the way, or a name is too long.
    """
    below: list[str] = []
    for current in (path, *path.parents):
        try:
            exists = current.is_dir() or current.exists()
        except OSError as exc:  # Python versions differ on which errors exists() raises
            if exc.errno != errno.ENAMETOOLONG:
                raise
            exists = False
        if exists:
            if not current.is_dir():
                if current == path:
                    raise ValueError(f"`out` must be a directory, got the file {str(path)!r}")
                raise ValueError(f"`out` must be a directory path, got {_short(str(path))!r}, "
                                 f"which lies below the file {str(current)!r}")
            return current, below[::-1]
        below.append(current.name)
    return Path("."), below[::-1]


def check_out_path(out: str) -> Path:
    """``out`` as a path, refusing what would fail only when the run first writes there.

    Args:
        out: the output directory (``--out``).

    Returns:
        The path, with ``~`` expanded.

    Raises:
        ValueError: ``out`` is a file or lies below one; a folder name on it or the whole path
            is longer than the file system allows; ``checkpoint`` there is not a folder, or
            ``run.json``, ``metrics.jsonl``, ``summary.json`` or ``checkpoint/latest.json``
            is not a regular file.
    """
    path = Path(out).expanduser()
    anchor, names = _first_existing(path)
    name_max = _limit(anchor, "PC_NAME_MAX", _DEFAULT_NAME_MAX)
    for name in names:
        size = len(os.fsencode(name))
        if size > name_max:
            raise ValueError(f"`out` folder names must be at most {name_max} bytes, got "
                             f"{size} bytes in {_short(name)!r}")
    path_max = _limit(anchor, "PC_PATH_MAX", _DEFAULT_PATH_MAX)
    # The longest path a run writes below ``out`` (a temporary checkpoint file) must fit too.
    longest = len(os.fsencode(os.path.abspath(path))) + len("/checkpoint/epoch-00000/.rank-0.pt"
                                                            ".0000000.00000000.tmp")
    if longest >= path_max:
        raise ValueError(f"`out` must be a path shorter than the file system's {path_max} bytes "
                         f"(with the files a run writes there), got {_short(str(path))!r}")
    if path.is_dir():
        for name in _FOLDERS:
            entry = path / name
            if os.path.lexists(entry) and not entry.is_dir():
                raise ValueError(f"`out` entry {name!r} must be a folder (the run's checkpoints), "
                                 f"got a file: {str(entry)!r}; remove it or choose another --out")
        for name in _FILES:
            entry = path / name
            if os.path.lexists(entry) and not entry.is_file():
                raise ValueError(f"`out` entry {name!r} must be a regular file, got a "
                                 f"{'folder' if entry.is_dir() else 'non-file'}: {str(entry)!r}; "
                                 f"remove it or choose another --out")
    return path
