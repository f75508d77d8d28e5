"""Files that come from elsewhere, read by metalearn's own checks; files written atomically.

Every file metalearn reads from a place a user names (a data set, a support folder, a
package, a checkpoint, a run's W&B records) goes through `open_regular` or `read_bytes`
before any parser sees it:

* **Regular files only.** The file is opened without blocking (``O_NONBLOCK``: a FIFO
  opens at once instead of waiting for a writer) and its *open descriptor* is checked to
  be a regular file, so a FIFO, a device, a socket or a folder is refused in one line, and
  no name swapped between the check and the read can slip another file in.
* **Inside its folder.** With ``within``, a path whose real location (symbolic links
  followed) lies outside that folder is refused: a link inside a package or an image
  folder cannot make metalearn read ``/etc/shadow`` or a FIFO elsewhere.
* **Bounded.** ``limit`` caps the bytes read, checked against the descriptor's size before
  reading and again while reading (a file that grows meanwhile is refused too).

Every file metalearn writes goes through `write_atomically`: the bytes go to a fresh
temporary file beside the target (``mkstemp``: a new name, created exclusively, so a
symbolic link planted at a fixed name cannot redirect the write), are flushed to disk, and
the temporary file is renamed into place. A crash mid-write leaves whatever was there; a
full disk (``ENOSPC``) or a quota is one line (`FileError`) with nothing replaced and no
temporary file left behind.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "FULL_DISK",
    "HOST",
    "FileError",
    "disk_full",
    "open_regular",
    "process_alive",
    "read_bytes",
    "read_json",
    "regular_file",
    "write_atomically",
]

HOST = socket.gethostname().replace(".", "_")
"""This machine's name, as temporary files and run locks record their writer's host."""


FULL_DISK = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""The errors of a write refused for want of room: a full disk, a quota, a file-size limit
(``ulimit -f``: the kernel refuses the write past it with EFBIG, as a full disk does)."""


class FileError(ValueError):
    """A file refused before it was read (not a regular file, outside its folder, too
    large, not valid JSON), or one that could not be written (a full disk): one line.

    Attributes:
        errno: a failed write's ``errno`` (`FULL_DISK` for want of room); None otherwise.
        path: the file that could not be written; None for a refused read.
    """

    def __init__(self, message: str, *, errno: int | None = None,
                 path: Path | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.errno, self.path = errno, path


def disk_full(err: BaseException) -> bool:
    """Whether ``err`` is a write refused for want of room (`FULL_DISK`): an ``OSError`` or
    a `FileError` from `write_atomically`."""
    return getattr(err, "errno", None) in FULL_DISK


def _kind(mode: int) -> str:
    """What a file of this ``st_mode`` is, in words."""
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):  # fmt: skip
        if test(mode):
            return name
    return "not a regular file"


def _check_within(path: Path, within: str | os.PathLike | None, what: str) -> None:
    """Refuse ``path`` when its real location lies outside the real ``within``."""
    if within is None:
        return
    real, folder = os.path.realpath(path), os.path.realpath(within)
    if os.path.commonpath([real, folder]) != folder:
        raise FileError(
            f"{what} {path} is a link to {real}, outside {within}; copy the file into the "
            "folder instead of linking to it"
        )


@contextlib.contextmanager
def open_regular(
    path: str | os.PathLike,
    *,
    what: str = "file",
    within: str | os.PathLike | None = None,
    limit: int | None = None,
) -> Iterator[IO[bytes]]:
    """Open ``path`` for binary reading after checking it is a regular file.

    Args:
        path: the file.
        what: how messages name it (``"--model"``, ``"image"``, ...).
        within: a folder the file's real location must lie in (links followed).
        limit: the most bytes the file may hold (None: no bound).

    Yields:
        The open file (blocking reads), positioned at its start.

    Raises:
        FileNotFoundError: no file at ``path``.
        FileError: not a regular file (a FIFO, device, socket or folder), outside
            ``within``, larger than ``limit``, or unreadable (each named).
    """
    path = Path(path)
    _check_within(path, within, what)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} does not exist") from None
    except OSError as err:
        raise FileError(f"cannot open {what} {path}: {err.strerror or err}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FileError(f"{what} {path} is {_kind(info.st_mode)}; give a regular file")
        if limit is not None and info.st_size > limit:
            raise FileError(
                f"{what} {path} holds {info.st_size:,} bytes, more than the {limit:,} such a "
                "file may hold; it is not the file metalearn wrote (or reads), or it is damaged"
            )
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        file = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with file:
        yield file


def regular_file(
    path: str | os.PathLike, *, what: str = "file", within: str | os.PathLike | None = None
) -> Path:
    """``path`` checked as `open_regular` checks it (opened and closed, nothing read).

    For files handed to a reader that opens them itself (wandb's, Pillow's, h5py's).

    Raises:
        FileNotFoundError, FileError: as `open_regular`.
    """
    with open_regular(path, what=what, within=within):
        pass
    return Path(path)


def read_bytes(
    path: str | os.PathLike,
    *,
    limit: int,
    what: str = "file",
    within: str | os.PathLike | None = None,
) -> bytes:
    """The whole of a regular file of at most ``limit`` bytes.

    Raises:
        FileNotFoundError, FileError: as `open_regular`; also a file that grew past
            ``limit`` while it was read.
    """
    with open_regular(path, what=what, within=within, limit=limit) as file:
        try:
            data = file.read(limit + 1)
        except OSError as err:
            raise FileError(f"cannot read {what} {path}: {err.strerror or err}") from None
    if len(data) > limit:
        raise FileError(f"{what} {path} grew past {limit:,} bytes while it was read")
    return data


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (Python's json keeps the last silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice")
        out[key] = value
    return out


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(text: str | bytes, *, what: str) -> Any:
    """Strict JSON: no repeated key, no ``NaN``/``Infinity``; errors are one `FileError`."""
    try:
        return json.loads(text, object_pairs_hook=_refuse_duplicates,
                          parse_constant=_refuse_constant)  # fmt: skip
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError too
        reason = " ".join(str(err).split())[:200]
        raise FileError(f"{what} is not valid JSON ({reason})") from None


def read_json(
    path: str | os.PathLike,
    *,
    limit: int = 1 << 20,
    what: str = "file",
    within: str | os.PathLike | None = None,
) -> Any:
    """A regular file of at most ``limit`` bytes, parsed as strict JSON (`parse_json`).

    Raises:
        FileNotFoundError, FileError: as `read_bytes`, or the text is not strict JSON.
    """
    return parse_json(read_bytes(path, limit=limit, what=what, within=within),
                      what=f"{what} {path}")  # fmt: skip


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


def write_atomically(
    path: str | os.PathLike,
    data: bytes | bytearray | memoryview | str | Callable[[IO[bytes]], object],
    *,
    overwrite: bool = True,
    what: str = "file",
) -> Path:
    """Write ``data`` to ``path`` through a fresh temporary file renamed into place.

    The temporary file's name holds this host and process id, so one left by a writer
    killed mid-write (SIGKILL runs no cleanup) is removed by the next write of the same
    target, and one whose writer still runs never is. The data is fsynced before the
    rename and the folder after it, so the rename survives a power cut.

    Args:
        path: the target (its folder is created).
        data: the bytes, a text (UTF-8), or a function writing the file it is given (its
            ``OSError`` is a failed write).
        overwrite: replace an existing ``path``; False refuses one, also one that appeared
            while writing (the name is taken with ``os.link``, which fails if it exists).
        what: how messages name the file (``"--out"``, ``"checkpoint"``, ...).

    Returns:
        ``path``.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False (nothing written).
        FileError: the write failed (a full disk, a quota, a read-only folder): one line,
            nothing replaced, the temporary file removed.
    """
    path = Path(path)
    if not overwrite and os.path.lexists(path):
        raise FileExistsError(f"{what} {path} exists; pass --overwrite to replace it")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        for orphan in _orphans(path):
            orphan.unlink(missing_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{HOST}.{os.getpid()}.",
                                   suffix=".tmp")  # fmt: skip
    except OSError as err:
        raise _write_failed(path, what, err) from None
    try:
        with os.fdopen(fd, "wb") as file:
            if callable(data):
                _call_writer(data, file)
            else:
                file.write(data.encode() if isinstance(data, str) else data)
            file.flush()
            os.fsync(file.fileno())  # the rename must not land before the data does
        os.chmod(tmp, 0o644)  # mkstemp makes the file private; what metalearn writes need not be
        _move_into_place(Path(tmp), path, overwrite, what)
        _fsync_dir(path.parent)
    except OSError as err:
        if isinstance(err, FileExistsError):
            raise
        raise _write_failed(path, what, err) from None
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


class _Recording:
    """A binary file whose failed writes are kept (``error``) as they pass through: a writer
    such as ``torch.save`` reports a refused write as its own error (a ``RuntimeError``
    "unexpected pos ..."), and the refusal's cause must still reach the user."""

    def __init__(self, file: IO[bytes]) -> None:
        self._file, self.error = file, None

    def write(self, data: Any) -> int:
        try:
            return self._file.write(data)
        except OSError as err:
            self.error = err
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._file, name)


def _call_writer(write: Callable[[IO[bytes]], object], file: IO[bytes]) -> None:
    """``write(file)``; a refused write it reported as another error raises the refusal."""
    recording = _Recording(file)
    try:
        write(recording)  # type: ignore[arg-type]
    except OSError:
        raise
    except Exception:
        if recording.error is not None:
            raise recording.error from None
        raise


def _write_failed(path: Path, what: str, err: OSError) -> FileError:
    """The one line a failed write ends with."""
    reason = err.strerror or str(err)
    if err.errno in FULL_DISK:
        fix = f"free space on the disk holding {path.parent}, or write elsewhere"
    else:
        fix = "check the folder's permissions, or write elsewhere"
    return FileError(f"could not write {what} {path}: {reason}; {fix} (nothing was replaced)",
                     errno=err.errno, path=path)  # fmt: skip


def _move_into_place(tmp: Path, path: Path, overwrite: bool, what: str) -> None:
    """Rename ``tmp`` to ``path``; without ``overwrite``, fail if ``path`` appeared meanwhile.

    ``os.link`` creates the name only if it is free (atomically), where ``os.replace``
    would silently take over a file written since the caller looked.
    """
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise FileExistsError(
            f"{what} {path} appeared while it was written; pass --overwrite to replace it"
        ) from None
    except OSError as err:  # a file system without hard links: look once more, then rename
        if err.errno in (*FULL_DISK, errno.EROFS):
            raise
        if os.path.lexists(path):
            raise FileExistsError(
                f"{what} {path} appeared while it was written; pass --overwrite to replace it"
            ) from None
        os.replace(tmp, path)


def _fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (POSIX; Windows cannot open a folder)."""
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
