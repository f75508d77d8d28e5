"""A folder with little room left, for tests of what a run does when the disk fills.

`SmallDisk` mounts a tmpfs of its own at the folder (``mount -t tmpfs -o size=...``, which
root may do here) and, on `SmallDisk.leave`, mounts it again with only that many bytes left
above what it holds, so the kernel refuses a write past them with ENOSPC, as a full disk
does. Where mounting is not permitted (no root, no ``mount``), the commands it runs
(`SmallDisk.run`) are child processes whose files may not grow past that many bytes
(``RLIMIT_FSIZE``, SIGXFSZ ignored, so the kernel refuses the write with EFBIG, which
`metalearn.files` treats as a full disk). Either way the refusal is the operating system's,
never a stub, and the test runs everywhere: ``mounted`` says which of the two it got.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

__all__ = ["SmallDisk", "temporary_files"]

_START = 64 << 20  # the tmpfs's size until `leave` shrinks it (room for any test's run)
_PAGE = os.sysconf("SC_PAGE_SIZE")


class SmallDisk:
    """A folder that holds what is written until `leave` cuts its room (a context manager).

    Attributes:
        folder: the folder (created; on exit unmounted, or left as it is).
        mounted: a tmpfs is mounted there (else the children's file-size limit stands in).
    """

    def __init__(self, folder: Path) -> None:
        self.folder, self.mounted = Path(folder), False
        self._limit: int | None = None

    def __enter__(self) -> SmallDisk:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.mounted = _mount(self.folder, f"size={_START}")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.folder)], check=True, timeout=60)

    def leave(self, free: int) -> None:
        """From now on, refuse writes past ``free`` more bytes: the tmpfs shrunk to what it
        holds plus ``free`` (whole pages), or each child's files bounded to ``free`` bytes."""
        if not self.mounted:
            self._limit = free
            return
        info = os.statvfs(self.folder)
        used = (info.f_blocks - info.f_bfree) * info.f_frsize
        size = -(-(used + free) // _PAGE) * _PAGE
        if not _mount(self.folder, f"remount,size={size}"):
            raise RuntimeError(f"could not shrink the tmpfs at {self.folder} to {size} bytes")

    def run(self, cmd: list[str], timeout: float = 300, **kwargs: Any) -> Any:
        """``subprocess.run(cmd)`` (output captured as text) under the disk's bound."""
        limit = self._limit

        def bounded() -> None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a killed child
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=None if limit is None else bounded, **kwargs)  # fmt: skip


def _mount(folder: Path, options: str) -> bool:
    """Mount (or remount) a tmpfs at ``folder``; False where this process may not."""
    if shutil.which("mount") is None:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                          capture_output=True, timeout=60)  # fmt: skip
    return done.returncode == 0


def temporary_files(folder: Path) -> list[Path]:
    """The temporary files `metalearn.files.write_atomically` leaves if it fails to clean up
    (``.NAME.HOST.PID.*.tmp``), anywhere under ``folder``."""
    return sorted(folder.rglob(".*.tmp"))
