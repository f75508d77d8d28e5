"""Checkpoints written atomically and read back safely.

A checkpoint is written through `metalearn.files.write_atomically`: a fresh temporary file
beside its target, flushed to disk, renamed over the target (``os.replace`` is atomic on
POSIX and Windows), the folder fsynced so the rename itself survives a power cut. A crash
or a SIGTERM mid-write leaves the previous checkpoint intact, never half a file, and a full
disk is one line with the previous checkpoint kept. Reading checks the file is a regular
file (`metalearn.files.open_regular`: a FIFO named ``checkpoint.pt`` is refused, not waited
on) and uses ``torch.load(weights_only=True)``: only tensors and plain containers, no
pickled code.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import torch

from metalearn.files import HOST, open_regular, process_alive, write_atomically

__all__ = ["HOST", "load_checkpoint", "process_alive", "save_checkpoint"]


def save_checkpoint(path: str | os.PathLike, obj: Any, *, what: str = "checkpoint") -> Path:
    """Atomically write ``obj`` (tensors, numbers, strings, dicts, lists) to ``path``.

    ``what`` names the file in the one line a failed write gives.

    Returns:
        The path written.

    Raises:
        metalearn.files.FileError: the disk is full (or the folder unwritable): one line,
            the previous checkpoint kept.
    """
    # Serialised in memory, then written by Python: torch's zip writer turns a full disk
    # into an opaque RuntimeError ("unexpected pos ..."), where Python's write raises
    # OSError (ENOSPC), which write_atomically makes one line.
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return write_atomically(path, buffer.getbuffer(), what=what)


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> Any:
    """Read a checkpoint written by `save_checkpoint` (``weights_only=True``).

    Raises:
        FileNotFoundError: no checkpoint at ``path`` (the message says how to start fresh).
        metalearn.files.FileError: ``path`` is not a regular file (a FIFO, a folder, ...).
    """
    path = Path(path)
    if not os.path.lexists(path):
        raise FileNotFoundError(
            f"no checkpoint at {path}; check --out-dir/--run-name, or drop --resume to start "
            "a new run"
        )
    with open_regular(path, what="checkpoint") as file:
        return torch.load(file, map_location=map_location, weights_only=True)
