"""The cache of decoded data sets: uint8 tensors decoded once, kept in a ``.pt`` file.

Decoding a data set's image files takes seconds to minutes; the loaders decode once and keep
the result in a writable cache directory (``$METALEARN_CACHE`` or ``~/.cache/metalearn``),
one file per decoding, keyed on a fingerprint of the source files' relative paths, sizes and
modification times (stat only, so cheap), so the data root may be read-only and any change
to the files rebuilds the cache. Files are written atomically (`write_atomically`) and read
with ``weights_only=True``; an unreadable one is rebuilt, as is one whose fingerprint matches
but whose contents are not what the files give (a caller's ``check``: the arrays' shapes,
the class names), and one that cannot be written (a full disk, a read-only folder) leaves
the run going uncached, each with a one-line warning.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from metalearn.checkpoint import save_checkpoint
from metalearn.files import FileError

__all__ = ["cached", "default_cache_dir", "fingerprint", "load_cache", "write_cache"]

Check = Callable[[dict], "str | None"]
"""``contents -> what is wrong with them`` (None: they are what the files give)."""

CACHE_FORMAT = 1  # bump when every cache file's meaning changes (all of them rebuild)


def default_cache_dir() -> Path:
    """``$METALEARN_CACHE`` if set, else ``~/.cache/metalearn``."""
    env = os.environ.get("METALEARN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "metalearn"


def fingerprint(root: Path, files: Iterable[Path], key: str) -> str:
    """SHA-256 of ``key`` and the files' paths relative to ``root``, sizes and mtimes.

    Args:
        root: the data root the paths are taken relative to (so a moved root keeps its key).
        files: every file the decoded tensors come from, in a fixed order.
        key: whatever else changes the decoded tensors (image size, filter, split).
    """
    digest = hashlib.sha256(f"{CACHE_FORMAT}|{key}".encode())
    for path in files:
        st = path.stat()
        digest.update(f"{path.relative_to(root)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def load_cache(
    path: Path, key: str, *, what: str, mmap: bool = False, check: Check | None = None
) -> dict | None:
    """The cached dict if ``path`` is a readable cache for fingerprint ``key``, else None.

    ``what`` names the data in the warning; ``mmap`` maps the tensors from the file instead
    of reading them (pages load on first touch: for sets larger than memory); ``check``
    says what is wrong with contents that the fingerprint matches (arrays of another shape).

    Warns:
        UserWarning: the file exists but cannot be read, or ``check`` refuses it (it is
            then rebuilt).
    """
    if not path.is_file() or path.is_symlink():  # a FIFO, a folder, a link: rebuilt instead
        return None
    try:
        found = torch.load(path, weights_only=True, mmap=mmap)
    except Exception as err:  # a truncated or foreign file: rebuild it, but say so
        why = " ".join(str(err).split())
        warnings.warn(f"ignoring unreadable {what} cache {path} ({why}); rebuilding it",
                      stacklevel=4)  # fmt: skip
        return None
    if not isinstance(found, dict) or found.get("fingerprint") != key:
        return None
    problem = None if check is None else check(found)
    if problem is not None:
        warnings.warn(f"ignoring the {what} cache {path}: its fingerprint matches the files but "
                      f"{problem}; rebuilding it", stacklevel=4)  # fmt: skip
        return None
    return found


def write_cache(path: Path, contents: dict, *, what: str) -> bool:
    """Write a decoded cache; if that fails, warn and go on uncached. Returns whether written.

    The decoded tensors are in memory already, so a full disk or a read-only cache folder
    costs the next run a decode, not this run its data.

    Warns:
        UserWarning: the file could not be written (named, with the fix).
    """
    try:
        save_checkpoint(path, contents, what=f"the {what} cache")
    except FileError as err:  # a full disk, a read-only or missing folder: one line
        warnings.warn(f"{err}; running uncached (the images are decoded again next time), or "
                      "point METALEARN_CACHE at a writable folder", stacklevel=4)  # fmt: skip
        return False
    except RuntimeError as err:  # torch.save's zip writer
        why = " ".join(str(err).split())
        warnings.warn(
            f"cannot write the {what} cache {path} ({type(err).__name__}: {why}); running "
            "uncached (the images are decoded again next time): free disk space or point "
            "METALEARN_CACHE at a writable folder",
            stacklevel=4,
        )
        return False
    return True


def cached(
    path: Path,
    key: str,
    build: Callable[[], dict[str, Any]],
    *,
    what: str,
    mmap: bool = False,
    check: Check | None = None,
) -> dict[str, Any]:
    """The dict cached at ``path`` for fingerprint ``key``, else ``build()``, cached.

    Args:
        path: the cache file.
        key: the sources' `fingerprint`; stored in the file as ``"fingerprint"``.
        build: called on a miss only (it decodes); returns the tensors to cache.
        what: the data set, in warnings.
        mmap: map a hit's tensors from the file (see `load_cache`).
        check: what is wrong with a hit's contents (see `load_cache`); a refused hit is
            rebuilt.

    Returns:
        The cached dict (with ``"fingerprint"``), read back or just built.
    """
    found = load_cache(path, key, what=what, mmap=mmap, check=check)
    if found is not None:
        return found
    contents = {**build(), "fingerprint": key}
    write_cache(path, contents, what=what)
    return contents
