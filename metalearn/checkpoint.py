"""Checkpoints written atomically and read back safely.

A checkpoint is written to a temporary file beside its target, flushed to disk, then
renamed over the target (``os.replace`` is atomic on POSIX and Windows), and the folder is
fsynced so the rename itself survives a power cut; a crash or a SIGTERM mid-write leaves the
previous checkpoint intact, never half a file. The temporary file's name holds its writer's
host and process id, so one left by a process killed mid-write (SIGKILL runs no cleanup) is
removed by the next save to the same target, and one whose writer still runs never is.
Reading uses ``torch.load(weights_only=True)``: only tensors and plain containers, no
pickled code.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["HOST", "load_checkpoint", "process_alive", "save_checkpoint"]

HOST = socket.gethostname().replace(".", "_")
"""This machine's name, as temporary files and run locks record their writer's host."""


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs on this machine (signal 0 probes without sending)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        return True
    return True


def _orphans(path: Path) -> list[Path]:
    """Temporary files of ``path`` whose writer, a process on this machine, has died."""
    dead = []
    for tmp in path.parent.glob(f".{path.name}.{HOST}.*.tmp"):
        pid = tmp.name[len(f".{path.name}.{HOST}.") :].split(".", 1)[0]
        if pid.isdigit() and not process_alive(int(pid)):
            dead.append(tmp)
    return dead


def save_checkpoint(path: str | os.PathLike, obj: Any) -> Path:
    """Atomically write ``obj`` (tensors, numbers, strings, dicts, lists) to ``path``.

    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for orphan in _orphans(path):  # left by a killed writer
        orphan.unlink(missing_ok=True)
    prefix = f".{path.name}.{HOST}.{os.getpid()}."
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # the rename must not land before the data does
        os.chmod(tmp, 0o644)  # mkstemp makes the file private; a checkpoint need not be
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (POSIX; Windows cannot open a folder)."""
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """Read a checkpoint written by `save_checkpoint` (``weights_only=True``).

    Raises:
        FileNotFoundError: no checkpoint at ``path`` (the message says how to start fresh).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"no checkpoint at {path}; check --out-dir/--run-name, or drop --resume to start "
            "a new run"
        )
    return torch.load(path, map_location=map_location, weights_only=True)
