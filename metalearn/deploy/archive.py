"""Deployed packages are code: what may be loaded from a ``.pt2`` file, and how.

* An exported program (``.pt2``, `load_program`) holds a graph, tensors and pickled
  members (its sample inputs, some constants). ``torch.export.load`` reads those pickles
  with ``weights_only=True`` first and, when that fails, retries with
  ``weights_only`` off, which runs whatever the pickle names: a replaced
  ``data/sample_inputs/model.pt`` would run code. `load_program` forces every
  ``torch.load`` the load makes to ``weights_only=True`` (torch's own
  ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` switch), so such a member is refused in one line. The
  other ways a ``.pt2`` runs code on loading (opaque objects, libraries, shape expressions,
  guards, node targets) are refused before torch reads the file by
  `metalearn.deploy.program_check`.
* An AOTInductor package (``.aoti.pt2``) is a zipped shared library: loading it runs the
  library's native code, which no check can make safe. `check_trusted` refuses it unless
  the caller says it trusts the package's author (``trust=True``; no command line loads
  a package it did not compile itself, so none offers a flag for it), and
  `check_members` refuses an archive whose member names would be extracted outside its
  folder (``../x``, ``/abs``: a zip-slip).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import stat
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import torch
from torch.export import ExportedProgram

__all__ = ["UntrustedPackageError", "check_members", "check_trusted", "load_program"]

_FORCE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"  # torch.load reads it on every call
_UNFORCE = "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"  # must not be set with _FORCE (torch raises)
_ENV_LOCK = threading.Lock()
_AOTI = "/data/aotinductor/"  # where an archive keeps AOTInductor's shared libraries


class UntrustedPackageError(ValueError):
    """A package that runs native code, loaded without ``trust=True``."""


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """Within the block, every ``torch.load`` in this process reads with
    ``weights_only=True``, whatever its caller asked (only stricter for other threads)."""
    with _ENV_LOCK:
        saved = {name: os.environ.pop(name, None) for name in (_FORCE, _UNFORCE)}
        os.environ[_FORCE] = "1"
        try:
            yield
        finally:
            for name, value in saved.items():
                os.environ.pop(name, None)
                if value is not None:
                    os.environ[name] = value


def load_program(path: str | os.PathLike, extra_files: dict[str, str]) -> ExportedProgram:
    """The program at ``path`` as torch.export's ``load`` reads it (``extra_files`` filled),
    with every pickled member read as tensors and plain containers only.

    Raises:
        ValueError: a member holds pickled objects other than tensors and containers (the
            file was tampered with, or written by code that is not torch.export.save's).
    """
    with weights_only_loads():
        try:
            return torch.export.load(path, extra_files=extra_files)  # safe: load_exported checks
        except pickle.UnpicklingError as err:
            found = re.search(r"WeightsUnpickler error: ([^.\n]*)", str(err))
            refused = found.group(1).strip() if found else type(err).__name__
            raise ValueError(
                f"{path}: refusing a pickled member that holds more than tensors ({refused}); "
                "an exported program written by torch.export.save never does, so this file "
                "was altered: export it again from its checkpoint"
            ) from None


def check_trusted(path: str | os.PathLike, trust: bool) -> None:
    """Refuse an archive holding an AOTInductor library unless ``trust``: loading it runs
    native code.

    Raises:
        UntrustedPackageError: ``trust`` is False and a member lies under
            ``data/aotinductor/`` (named in the message).
    """
    if trust:
        return
    with zipfile.ZipFile(path) as archive:
        library = next((n for n in archive.namelist() if _AOTI in f"/{n}"), None)
    if library is not None:
        raise UntrustedPackageError(
            f"{path} is an AOTInductor package (it holds the library {library!r}): loading "
            "it runs the native code inside it; load only packages you compiled or whose "
            "author you trust, with trust=True"
        )


def check_members(path: str | os.PathLike) -> None:
    """Refuse an archive with a member that would be extracted outside its folder: an
    absolute name, a ``..`` component, a backslash path, or a symbolic link.

    Raises:
        ValueError: the first such member, named.
    """
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            name = info.filename
            parts = PurePosixPath(name.replace("\\", "/")).parts
            is_link = stat.S_ISLNK(info.external_attr >> 16)
            if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":") \
                    or ".." in parts or is_link:  # fmt: skip
                raise ValueError(
                    f"{Path(path)}: refusing member {name!r}, which would be extracted outside "
                    "the package's folder; the archive was altered: compile it again"
                )
