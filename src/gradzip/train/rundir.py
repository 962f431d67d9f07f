"""The run directory: whose results it holds, atomic writes, and checkpoints.

A run directory holds ``run.json`` (the configuration, written when a run starts),
``metrics.jsonl``, ``summary.json`` (written last: a finished run) and ``checkpoint/``::

    checkpoint/latest.json            the manifest: which epoch, which files, metrics length
    checkpoint/epoch-00003/rank-0.pt  one file per process (residuals are per rank)

A checkpoint is committed by replacing ``latest.json`` after every process has written its
file, so a run killed at any moment leaves either the previous checkpoint or the new one,
never a mixture. The manifest records the sha256 of every file, checked before a file is
loaded. Nothing here decides whether a directory may be used: the runner checks first
(:func:`stored_config`, :func:`read_manifest`) and only then writes, holding
:func:`lock_out_dir` for the whole run.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import secrets
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gradzip.train.outpath import check_out_path

__all__ = [
    "CHECKPOINT_DIR", "FORMAT_VERSION", "RUN_FILE", "Manifest", "atomic_save", "atomic_write_text",
    "LOCK_FILE", "check_out_dir", "commit_checkpoint", "load_rank_file", "lock_out_dir",
    "prune_checkpoints", "rank_file", "read_manifest", "run_token", "save_hashed", "stored_config",
    "write_run_file",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
RUN_FILE = "run.json"
CHECKPOINT_DIR = "checkpoint"
_MANIFEST = "latest.json"
#: Held (``flock``) by the process that writes a run directory, for the run's whole life.
LOCK_FILE = ".gradzip.lock"
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


def save_hashed(obj: Any, path: str | os.PathLike[str]) -> str:
    """``torch.save`` to ``path`` atomically and return the sha256 (hex) of the bytes written.

    The digest is taken of the very bytes that go to disk (serialised once in memory), so a
    later change to the file, a flipped bit included, no longer matches it.
    """
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _replace_with(path, "xb", lambda fh: fh.write(data))
    return hashlib.sha256(data).hexdigest()


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


def write_run_file(out: Path, config: dict[str, Any], token: str | None = None) -> None:
    """Record the configuration of the run now using ``out`` (atomically), and the token
    that marks its TensorBoard event files."""
    out.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"format_version": FORMAT_VERSION, "config": config}
    if token is not None:
        record["events_token"] = token
    atomic_write_text(out / RUN_FILE, json.dumps(record, indent=2) + "\n")


def run_token(out: str | os.PathLike[str]) -> str | None:
    """The token of the event files of the run in ``out`` (None: no run, or one recorded
    before tokens were, whose event files carry none and are left alone)."""
    try:
        data = json.loads((Path(out) / RUN_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    token = data.get("events_token") if isinstance(data, dict) else None
    return token if isinstance(token, str) and token.isalnum() else None


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
        sha256: the sha256 (hex) of each per-process file, by file name (``rank-0.pt``); None
            for a manifest written before digests were recorded (its files load unchecked).
    """

    epoch: int
    step: int
    directory: str
    processes: int
    metrics_bytes: int
    config: dict[str, Any]
    sha256: dict[str, str] | None = None

    def to_dict(self) -> dict[str, Any]:
        data = {"format_version": FORMAT_VERSION, "epoch": self.epoch, "step": self.step,
                "directory": self.directory, "processes": self.processes,
                "metrics_bytes": self.metrics_bytes, "config": self.config}
        if self.sha256 is not None:
            data["sha256"] = dict(self.sha256)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        """Inverse of :meth:`to_dict`.

        Raises:
            KeyError, TypeError, ValueError: a missing or malformed field.
        """
        digests = data.get("sha256")
        if digests is not None:
            if not isinstance(digests, dict) or not all(
                    isinstance(v, str) and len(v) == 64 and set(v) <= set("0123456789abcdef")
                    for v in digests.values()):
                raise ValueError("`sha256` must map file names to 64 hex digits")
            digests = {str(k): v for k, v in digests.items()}
        return cls(int(data["epoch"]), int(data["step"]), str(data["directory"]),
                   int(data["processes"]), int(data["metrics_bytes"]), dict(data["config"]),
                   digests)


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
        ValueError: the file is missing, unreadable, or not the file the manifest's sha256
            records (damaged or changed since it was written).
    """
    path = rank_file(out, manifest.directory, rank)
    if not path.is_file():
        raise ValueError(f"`out` checkpoint is missing {path}; it cannot be resumed")
    expected = None
    if manifest.sha256 is not None:
        expected = manifest.sha256.get(path.name)
        if expected is None:
            raise ValueError(f"`out` checkpoint manifest records no sha256 for {path}; it "
                             "cannot be resumed")
    try:
        data = path.read_bytes()
        # weights_only: a checkpoint is data, never code to run.
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises several types for a damaged file
        raise ValueError(f"`out` checkpoint file {path} is unreadable: {exc}") from None
    # A file that still loads may hold changed numbers (one flipped bit in a weight loads
    # fine and trains NaN from then on): only the digest tells.
    if expected is not None and hashlib.sha256(data).hexdigest() != expected:
        raise ValueError(f"`out` checkpoint file {path} does not match the sha256 its manifest "
                         "records (damaged or changed since it was written); it cannot be "
                         "resumed")
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"`out` checkpoint file {path} is of another format")
    # A digest proves the file unchanged, not that it belongs here: an earlier epoch's file
    # named with its own digest would resume from there and write its records twice.
    loop = state.get("loop")
    held = (loop.get("epoch"), loop.get("step")) if isinstance(loop, dict) else None
    if held != (manifest.epoch, manifest.step):
        raise ValueError(f"`out` checkpoint file {path} holds epoch {held and held[0]} (step "
                         f"{held and held[1]}), but its manifest records epoch {manifest.epoch} "
                         f"(step {manifest.step}); it cannot be resumed")
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


class OutDirLock:
    """An exclusive ``flock`` on ``OUT/.gradzip.lock``, held while a run writes ``OUT``.

    The kernel drops the lock when its holder exits for any reason (SIGKILL included), so a
    lock is never stale; the file itself stays (deleting it would let two writers each lock a
    different file of the same name).
    """

    def __init__(self, fd: int | None, path: Path) -> None:
        self._fd, self.path = fd, path

    def release(self) -> None:
        """Drop the lock (idempotent)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the only descriptor releases the flock

    def __enter__(self) -> OutDirLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_out_dir(out: str | os.PathLike[str]) -> OutDirLock:
    """Take the writer's lock of the run directory ``out`` (created if missing).

    Returns:
        The held lock (release it, or let the process exit).

    Raises:
        ValueError: another process (a run still writing there) holds it.
    """
    path = Path(out) / LOCK_FILE
    if sys.platform == "win32":  # pragma: no cover - no flock; runs there are not locked
        return OutDirLock(None, path)
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            # A file system without locks (some network mounts): run unlocked, as before.
            log.warning("cannot lock %s (%s): a second run there would not be refused",
                        path, exc)
            return OutDirLock(fd, path)
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise ValueError(f"`out` {str(out)!r} is in use by another gradzip run (pid {holder}); "
                         "wait for it to end or choose another --out") from None
    # The holder's pid, for the message above (informational only: the lock is the flock);
    # left alone when it is already this process's, so a run refused under its own lock
    # leaves the directory byte for byte as it was.
    pid = f"{os.getpid()}\n".encode("ascii")
    if os.pread(fd, 64, 0) != pid:
        os.ftruncate(fd, 0)
        os.pwrite(fd, pid, 0)
    return OutDirLock(fd, path)
