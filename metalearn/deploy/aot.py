"""The exported program compiled ahead of time: an AOTInductor package (``.aoti.pt2``).

``torch._inductor.aoti_compile_and_package`` turns a ``torch.export`` program into C++,
compiles it to a shared library and zips it into a ``.pt2`` archive; loading it needs
torch but runs no Python per op. The package is written like the exported ``.pt2``
(atomically, never over a file unasked, never over a training checkpoint) and carries the
same metadata (the package document without its files) inside the library, read back by
`load_aot`. It runs on the kind of device, and CPU instruction set, it was compiled for.
Loading it opens the library, which runs its native code: `load_aot` needs ``trust=True``,
as `metalearn.deploy.program.load_program` does; a package from elsewhere is a folder of
tensors and JSON (`metalearn.deploy.package`).
"""

from __future__ import annotations

import io
import json
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from metalearn.deploy.program import check_export_target, check_trusted, sibling_path
from metalearn.files import parse_json, write_atomically

__all__ = ["AOT_SUFFIX", "aot_package_path", "compile_aot", "is_aot_package", "load_aot"]

AOT_SUFFIX = ".aoti.pt2"
"""Beside the package folder: ``adapted/`` -> ``adapted.aoti.pt2``."""
_METADATA = "metalearn.json"  # the metadata key inside the package, as in the exported .pt2


def aot_package_path(out: str | os.PathLike) -> Path:
    """Where ``--aot`` writes the AOTInductor package of the package folder ``out``."""
    return sibling_path(out, AOT_SUFFIX)


def compile_aot(
    program: ExportedProgram,
    path: str | os.PathLike,
    *,
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    source: str | os.PathLike | None = None,
) -> Path:
    """Compile ``program`` with AOTInductor into a package at ``path``, written atomically.

    Takes about half a minute for Conv4 on a CPU (a C++ compile).

    Args:
        program: a ``torch.export`` program (``[B, C, H, W] -> [B, ways]``); its dynamic
            batch dimension, if any, stays dynamic.
        path: the package to write; must end in ``.pt2`` (torch's rule).
        metadata: JSON-serialisable facts stored inside the package; `load_aot` returns them.
        overwrite: replace an existing file (never a training checkpoint).
        source: the checkpoint being exported, refused as a target.

    Returns:
        The path written.

    Raises:
        FileExistsError: see `check_export_target`; nothing is compiled or written.
        ValueError: ``path`` does not end in ``.pt2``, ``program`` has no example inputs,
            or no C++ compiler is found; or the package could not be written (a full
            disk), with any previous file at ``path`` kept.
    """
    path = check_export_target(path, overwrite=overwrite, source=source, label="the --aot package")
    if path.suffix != ".pt2":
        raise ValueError(f"the AOT package {path} must end in .pt2; name it e.g. {path}.pt2")
    if program.example_inputs is None:
        raise ValueError(
            "the program has no example inputs, which AOTInductor needs; export it with "
            "torch.export.export (metalearn.deploy.export_program writes one)"
        )
    check_compiler()
    configs = {"aot_inductor.metadata": {_METADATA: json.dumps(dict(metadata or {}))}}

    # Packaged in memory, then written by Python, as `export_adapted` writes a .pt2: torch's
    # C++ file writer aborts the process on a full disk, where Python's write raises
    # OSError (ENOSPC), which `write_atomically` turns into one line, the old file kept.
    buffer = io.BytesIO()
    torch._inductor.aoti_compile_and_package(program, package_path=buffer, inductor_configs=configs)
    return write_atomically(path, buffer.getbuffer(), overwrite=overwrite, what="--aot package")


def check_compiler() -> None:
    """Raise ``ValueError`` naming the fix when Inductor finds no C++ compiler.

    Asks Inductor's own search (private to torch), so the check agrees with the compile; if
    a torch release moves it, the check is skipped and the compile names the problem.
    """
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:
        return

    try:
        get_cpp_compiler()
    except Exception:  # torch's own search (CXX, then g++) failed, whatever it raised
        raise ValueError(
            "--aot needs a C++ compiler: install g++ (apt-get install g++) or point CXX at "
            "one, e.g. CXX=clang++"
        ) from None


def is_aot_package(path: str | os.PathLike) -> bool:
    """True when ``path`` (a file you trust: this opens it as a zip) is an AOTInductor
    package (a ``.pt2`` archive holding a library)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any("/data/aotinductor/" in f"/{name}" for name in archive.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def load_aot(path: str | os.PathLike, *, trust: bool = False) -> tuple[Any, dict[str, Any]]:
    """Load a package written by `compile_aot`: ``(model, metadata)``.

    ``model(x)`` maps images ``[B, C, H, W]`` to logits ``[B, ways]``, on the device the
    package was compiled for. Loading runs the package's native code, so it needs
    ``trust=True``: pass it only for packages you compiled yourself.

    Raises:
        UntrustedProgramError: ``trust`` is False.
        FileNotFoundError: no file at ``path``.
        ValueError: not a regular file, or not an AOTInductor package.
    """
    path = check_trusted(path, trust, what="AOTInductor package (native code)")
    if not is_aot_package(path):
        raise ValueError(f"{path} is not an AOTInductor package (a torch.export program? read "
                         "it with load_program)")  # fmt: skip
    model = torch._inductor.aoti_load_package(str(path))  # safe: trusted by the caller
    meta = parse_json(model.get_metadata().get(_METADATA) or "{}", what=f"{path}'s metadata")
    return model, meta
