"""The run directory: whose results it holds, atomic writes, and checkpoints.

A run directory holds ``run.json`` (the configuration, written when a run starts),
``metrics.jsonl``, ``summary.json`` (written last: a finished run) and ``checkpoint/``::

    checkpoint/latest.json            the manifest: which epoch, which files, metrics length
    checkpoint/epoch-00003/rank-0.pt  one file per process (residuals are per rank)

A checkpoint is committed by replacing ``latest.json`` after every process has written its
file, so a run killed at any moment leaves either the previous checkpoint or the new one,
never a mixture. Nothing here decides whether a directory may be used: the runner checks
first (:func:`stored_config`, :func:`read_manifest`) and only then writes.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gradzip.train.outpath import check_out_path

__all__ = [
    "CHECKPOINT_DIR", "FORMAT_VERSION", "RUN_FILE", "Manifest", "atomic_save", "atomic_write_text",
    "check_out_dir", "commit_checkpoint", "load_rank_file", "prune_checkpoints", "rank_file",
    "read_manifest", "stored_config", "write_run_file",
]

FORMAT_VERSION = 1
RUN_FILE = "run.json"
CHECKPOINT_DIR = "checkpoint"
_MANIFEST = "latest.json"
#: Files a run writes; their presence without any configuration record is a foreign run.
_RESULT_FILES = ("metrics.jsonl", "summary.json")


def _temporary(path: Path) -> Path:
    """A fresh name beside ``path`` (same file system, so ``os.replace`` is atomic); created
    with ``open(..., "x")`` so it gets the usual permissions, unlike ``mkstemp``'s 0600."""
    return path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file in the same directory and
    ``os.replace``: a reader (or a crash) sees the old file or the new one, never a part."""
    return _replace_with(Path(path), "x", lambda fh: fh.write(text), encoding="utf-8")


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> Path:
    """``torch.save`` to ``path`` atomically (temporary file, then ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return _replace_with(path, "xb", lambda fh: torch.save(obj, fh))


def _replace_with(path: Path, mode: str, write: Any, encoding: str | None = None) -> Path:
    """Write a temporary file beside ``path`` with ``write(fh)``, flush it to disk, then
    ``os.replace`` it onto ``path``; the temporary file is removed if anything fails."""
    tmp = _temporary(path)
    try:
        with open(tmp, mode, encoding=encoding) as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"`out` holds an unreadable {path.name} ({exc}); choose another --out "
                         f"or remove {path}") from None


def check_out_dir(out: str) -> Path:
    """``out`` as a path, refusing one that exists and is not a directory.

    Raises:
        ValueError: ``out`` is a file (or another non-directory).
    """
    path = check_out_path(out)  # also: no file above it, names not too long, entries' kinds
    if path.exists() and not path.is_dir():
        raise ValueError(f"`out` must be a directory, got the file {out!r}")
    return path


def stored_config(out: str) -> dict[str, Any] | None:
    """The configuration of the run ``out`` holds (``run.json``, else the summary's or the
    checkpoint's), or None when it holds no run's results.

    Raises:
        ValueError: ``out`` holds results with no readable configuration (another program's
            files, or a damaged ``run.json``): they are not ours to replace.
    """
    path = check_out_dir(out)
    if not path.is_dir():
        return None
    for name in (RUN_FILE, "summary.json", f"{CHECKPOINT_DIR}/{_MANIFEST}"):
        file = path / name
        if file.is_file():
            data = _read_json(file)
            config = data.get("config") if isinstance(data, dict) else None
            if not isinstance(config, dict):
                raise ValueError(f"`out` holds a {name} without a configuration; choose another "
                                 f"--out or remove {file}")
            return config
    present = [n for n in _RESULT_FILES if (path / n).exists()]
    if present:
        raise ValueError(f"`out` holds {present[0]} of a run whose configuration is unknown; "
                         f"choose another --out or remove {path / present[0]}")
    return None


def write_run_file(out: Path, config: dict[str, Any]) -> None:
    """Record the configuration of the run now using ``out`` (atomically)."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / RUN_FILE, json.dumps({"format_version": FORMAT_VERSION,
                                                  "config": config}, indent=2) + "\n")


@dataclass(frozen=True)
class Manifest:
    """The committed checkpoint of a run directory.

    Attributes:
        epoch: epochs completed when it was written.
        step: optimizer steps completed.
        directory: the folder (under ``checkpoint/``) holding the per-process files.
        processes: number of per-process files (1 for a simulated run).
        metrics_bytes: length of ``metrics.jsonl`` at that point (a resumed run keeps this
            prefix and writes the rest again).
        config: the run's configuration.
    """

    epoch: int
    step: int
    directory: str
    processes: int
    metrics_bytes: int
    config: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, "epoch": self.epoch, "step": self.step,
                "directory": self.directory, "processes": self.processes,
                "metrics_bytes": self.metrics_bytes, "config": self.config}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        """Inverse of :meth:`to_dict`.

        Raises:
            KeyError, TypeError, ValueError: a missing or malformed field.
        """
        return cls(int(data["epoch"]), int(data["step"]), str(data["directory"]),
                   int(data["processes"]), int(data["metrics_bytes"]), dict(data["config"]))


def read_manifest(out: str | os.PathLike[str]) -> Manifest | None:
    """The committed checkpoint of ``out``, or None when there is none.

    Raises:
        ValueError: the manifest is unreadable or of another format.
    """
    path = Path(out) / CHECKPOINT_DIR / _MANIFEST
    if not path.is_file():
        return None
    data = _read_json(path)
    if not isinstance(data, dict) or data.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"`out` holds a checkpoint of another format ({path}); it cannot be "
                         "resumed by this version")
    try:
        return Manifest.from_dict(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"`out` holds a damaged checkpoint manifest {path}: {exc}") from None


def epoch_directory(epoch: int) -> str:
    """The folder name of the checkpoint taken after ``epoch`` epochs."""
    return f"epoch-{epoch:05d}"


def rank_file(out: str | os.PathLike[str], directory: str, rank: int) -> Path:
    """The file of process ``rank`` in checkpoint folder ``directory``."""
    return Path(out) / CHECKPOINT_DIR / directory / f"rank-{rank}.pt"


def load_rank_file(out: str | os.PathLike[str], manifest: Manifest, rank: int) -> dict[str, Any]:
    """Process ``rank``'s part of the committed checkpoint (tensors and plain data only).

    Raises:
        ValueError: the file is missing or unreadable.
    """
    path = rank_file(out, manifest.directory, rank)
    if not path.is_file():
        raise ValueError(f"`out` checkpoint is missing {path}; it cannot be resumed")
    try:
        # weights_only: a checkpoint is data, never code to run.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a damaged file
        raise ValueError(f"`out` checkpoint file {path} is unreadable: {exc}") from None
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"`out` checkpoint file {path} is of another format")
    return state


def commit_checkpoint(out: str | os.PathLike[str], manifest: Manifest) -> None:
    """Make ``manifest`` the run's checkpoint (after every process has written its file)."""
    atomic_write_text(Path(out) / CHECKPOINT_DIR / _MANIFEST,
                      json.dumps(manifest.to_dict(), indent=2) + "\n")


def prune_checkpoints(out: str | os.PathLike[str], keep: str, rank: int) -> None:
    """Remove this process's files of every checkpoint folder but ``keep`` (the committed
    one), and (rank 0) folders left empty; a crash midway leaves only unreferenced files."""
    root = Path(out) / CHECKPOINT_DIR
    if not root.is_dir():
        return
    for folder in root.iterdir():
        if not folder.is_dir() or folder.name == keep or not folder.name.startswith("epoch-"):
            continue
        with contextlib.suppress(OSError):
            (folder / f"rank-{rank}.pt").unlink()
        if rank == 0:
            with contextlib.suppress(OSError):
                folder.rmdir()  # fails while another process's file is still there


def remove_checkpoints(out: str | os.PathLike[str]) -> None:
    """Remove the checkpoint folder (a run of the same configuration starting over)."""
    shutil.rmtree(Path(out) / CHECKPOINT_DIR, ignore_errors=True)
