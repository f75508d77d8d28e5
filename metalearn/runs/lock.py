"""One writer per run folder: a lock file held for as long as a process trains in it.

``<run folder>/.lock`` is created with ``O_CREAT | O_EXCL`` (atomic on POSIX, also on NFS
since v3), holding its owner's host, process id and start time as JSON. A second process
that tries to train in the same folder finds it and is refused, naming the holder. A lock
whose owner is a process on this machine that no longer runs (killed by SIGKILL, which runs
no cleanup) is stale: the next run takes it over with a warning. A lock held from another
machine is never taken over: whether its owner lives cannot be known from here.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from metalearn.checkpoint import HOST, process_alive
from metalearn.runs.lifecycle import UserError

__all__ = ["LOCK_NAME", "held", "run_holder"]

LOCK_NAME = ".lock"
_WRITING_S = 10.0  # a lock file younger than this with no owner yet is being written


def run_holder(folder: str | os.PathLike) -> dict[str, Any] | None:
    """Who holds ``folder``'s lock: ``{"host", "pid", "started"}``, or None when nobody
    does (no lock, or a stale one: its owner on this machine has died)."""
    owner = _read(Path(folder) / LOCK_NAME)
    if owner is None or _stale(owner):
        return None
    return owner


def describe(owner: dict[str, Any]) -> str:
    """``process 123 on host h since 2026-12-01 10:00:00``."""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("started", 0)))
    return f"process {owner.get('pid')} on host {owner.get('host')} since {since}"


@contextlib.contextmanager
def held(folder: str | os.PathLike) -> Iterator[Path]:
    """Hold ``folder``'s lock for the block (the folder is created if needed).

    Raises:
        UserError: a live process holds it (named, with the way out).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    _acquire(path)
    try:
        yield path
    finally:
        owner = _read(path)
        if owner is not None and (owner["host"], owner["pid"]) == (HOST, os.getpid()):
            path.unlink(missing_ok=True)


def _acquire(path: Path) -> None:
    record = json.dumps({"host": HOST, "pid": os.getpid(), "started": time.time()})
    for _ in range(3):  # a stale lock is moved aside, then created again
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            owner = _read(path)
            if owner is None and _age(path) < _WRITING_S:  # being written by its creator
                raise UserError(f"{path.parent} is being taken by another process just now: "
                                "one process trains in a run folder at a time; pass another "
                                "--run-name") from None  # fmt: skip
            if owner is not None and not _stale(owner):
                raise UserError(
                    f"{path.parent} is in use by {describe(owner)}: one process trains in a "
                    "run folder at a time; wait for it to finish, or pass another --run-name"
                ) from None
            what = "a damaged lock" if owner is None else f"a stale lock of {describe(owner)}"
            warnings.warn(f"{path.parent}: taking over {what}, whose process is gone",
                          stacklevel=3)  # fmt: skip
            aside = path.with_name(f"{LOCK_NAME}.stale.{os.getpid()}")
            with contextlib.suppress(FileNotFoundError):  # another taker moved it first
                os.replace(path, aside)
                aside.unlink(missing_ok=True)
            continue
        _write_record(fd, path, record)
        return
    raise UserError(f"could not take {path}: other processes keep creating it; retry")


def _write_record(fd: int, path: Path, record: str) -> None:
    """Write the owner's record into the new lock file; a write that fails (a full disk)
    removes the file again, so no empty lock is left to refuse the next run, and is one line.

    Raises:
        UserError: the record could not be written.
    """
    try:
        with os.fdopen(fd, "w") as f:
            f.write(record)
    except OSError as err:
        path.unlink(missing_ok=True)
        raise UserError(f"could not write the run folder's lock {path}: {err.strerror or err}; "
                        f"free space on the disk holding {path.parent}, or pass another "
                        "--out-dir") from None  # fmt: skip


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return float("inf")


def _read(path: Path) -> dict[str, Any] | None:
    try:
        owner = json.loads(path.read_text())
    except (FileNotFoundError, ValueError, OSError):
        return None
    if not isinstance(owner, dict) or not {"host", "pid"} <= set(owner):
        return None
    return owner


def _stale(owner: dict[str, Any]) -> bool:
    """A lock of this machine whose process has died (another machine's never is)."""
    return owner["host"] == HOST and not process_alive(int(owner["pid"]))
