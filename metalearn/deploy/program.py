"""The adapted network as a ``torch.export`` program (``.pt2``): code, for your own machine.

A ``.pt2`` is a program, not data: ``torch.export.load`` unpickles members, parses shape
expressions with ``sympy`` (which evaluates Python), compiles the program's guards and its
FX graph into Python source and runs them, resolves node targets by attribute lookups, opens
AOTInductor libraries, and reads the archive with its own zip parser. No check made before
it by another parser can close those doors, so metalearn does not try: `load_program`
loads a ``.pt2`` only when the caller says it trusts the file (``trust=True``; the command
line's ``--trust``), as for a ``.so``. Export one for the machine that compiled it
(``metalearn-export --program``); hand others a package (`metalearn.deploy.package`), which is
tensors and JSON.

Files are written atomically (`metalearn.files.write_atomically`), never over a training
checkpoint, and over another file only when asked.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.export import Dim, ExportedProgram

from metalearn.deploy.run_checkpoint import is_run_checkpoint
from metalearn.files import FileError, parse_json, regular_file, write_atomically

__all__ = [
    "PROGRAM_SUFFIX",
    "UntrustedProgramError",
    "check_export_target",
    "check_trusted",
    "export_program",
    "exported",
    "load_program",
    "program_path",
    "save_program",
    "sibling_path",
]

PROGRAM_SUFFIX = ".pt2"
"""Beside the package folder: ``adapted/`` -> ``adapted.pt2``."""
METADATA = "metalearn.json"  # the metadata member of a program (the package document's copy)


class UntrustedProgramError(ValueError):
    """A program (``.pt2``, ``.aoti.pt2``) given to a loader without ``trust=True``."""


def check_trusted(path: str | os.PathLike, trust: bool, what: str = "torch.export program") -> Path:
    """``path`` as a regular file, refused unless ``trust``: loading it runs its code.

    Raises:
        UntrustedProgramError: ``trust`` is False (one line saying what to load instead).
        FileNotFoundError, FileError: no such file, or not a regular file (a FIFO, ...).
    """
    path = Path(path)
    if not trust:
        raise UntrustedProgramError(
            f"{path} is a {what}: loading it runs code from the file; load only programs you "
            "compiled yourself, with trust=True (--trust), and take a package (a folder "
            "written by metalearn-export) from anyone else"
        )
    return regular_file(path, what=what)


def check_export_target(
    path: str | os.PathLike,
    *,
    overwrite: bool = False,
    source: str | os.PathLike | None = None,
    label: str = "--out",
) -> Path:
    """Refuse a target that would destroy data; returns it as a ``Path``.

    Args:
        path: where the file would be written.
        overwrite: allow replacing an existing file that is not a training checkpoint.
        source: the checkpoint being exported, refused as a target whatever its contents.
        label: how messages name the file: ``"--out"``, or what is written beside it (e.g.
            ``"the --aot package"``), named after ``--out``.

    Raises:
        FileExistsError: ``path`` is a folder, the source checkpoint, a training
            checkpoint, or (without ``overwrite``) any existing file.
    """
    path = Path(path)
    fix = ("choose another --out" if label == "--out" else
           "choose another --out (the files beside it are named after it)")  # fmt: skip
    if path.is_dir():
        raise FileExistsError(f"{label} {path} is a folder; {fix}")
    if not os.path.lexists(path):
        return path
    if source is not None and Path(source).exists() and path.exists() and path.samefile(source):
        raise FileExistsError(f"{label} {path} is the checkpoint being exported; {fix}")
    if is_run_checkpoint(path):
        raise FileExistsError(
            f"{label} {path} is a metalearn training checkpoint, never overwritten (not even "
            f"with --overwrite); {fix}"
        )
    if not overwrite:
        raise FileExistsError(
            f"{label} {path} exists; pass --overwrite (overwrite=True) to replace it, or {fix}"
        )
    return path


def sibling_path(out: str | os.PathLike, suffix: str) -> Path:
    """A file beside the package folder ``out`` named after it: ``adapted`` ->
    ``adapted<suffix>`` (one naming rule for the program, the AOTInductor package and the
    latency table)."""
    out = Path(out)
    return out.with_name(out.name + suffix)


def program_path(out: str | os.PathLike) -> Path:
    """Where ``--program`` writes the program of the package ``out``."""
    return sibling_path(out, PROGRAM_SUFFIX)


def exported(model: nn.Module, example_x: Tensor, *, dynamic_batch: bool = True) -> ExportedProgram:
    """``torch.export.export`` of the adapted network on ``example_x`` ``[B, C, H, W]``, its
    batch dimension dynamic unless ``dynamic_batch`` is False (then ``B`` only)."""
    dynamic = ({0: Dim.DYNAMIC},) if dynamic_batch else None
    return torch.export.export(model, (example_x,), dynamic_shapes=dynamic)


def export_program(
    model: nn.Module,
    example_x: Tensor,
    path: str | os.PathLike,
    *,
    dynamic_batch: bool = True,
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """``torch.export`` the adapted network to a ``.pt2`` file, written atomically.

    Args:
        model: e.g. `metalearn.deploy.adapted_model`'s result, ``[B, C, H, W] -> [B, ways]``.
        example_x: an example input ``[B, C, H, W]`` (the support images do).
        path: the ``.pt2`` to write (its folder is created).
        dynamic_batch: let the program take any batch size; False fixes it to
            ``example_x``'s.
        metadata: JSON-serialisable facts stored inside the file (the package document
            without its files); `load_program` returns them.
        overwrite: replace an existing file (never a training checkpoint).

    Returns:
        The path written.

    Raises:
        FileExistsError: see `check_export_target`; nothing is written.
        FileError: the disk is full (one line; nothing replaced).
    """
    path = check_export_target(path, overwrite=overwrite)
    program = exported(model, example_x, dynamic_batch=dynamic_batch)
    return save_program(program, path, metadata=metadata, overwrite=overwrite)


def save_program(
    program: ExportedProgram,
    path: str | os.PathLike,
    *,
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``program`` to the ``.pt2`` ``path`` with ``metadata``, atomically.

    Raises:
        FileExistsError, FileError: as `export_program`.
    """
    import json

    path = check_export_target(path, overwrite=overwrite)
    # Serialised in memory, then written by Python: torch's C++ file writer aborts the
    # process on a full disk, where Python's write raises OSError (ENOSPC).
    buffer = io.BytesIO()
    torch.export.save(program, buffer, extra_files={METADATA: json.dumps(dict(metadata or {}))})
    return write_atomically(path, buffer.getbuffer(), overwrite=overwrite, what="--program")


def load_program(
    path: str | os.PathLike, *, trust: bool = False
) -> tuple[ExportedProgram, dict[str, Any]]:
    """Load a ``.pt2`` you exported (`export_program`): ``(program, metadata)``.

    Args:
        path: the ``.pt2`` file.
        trust: required: ``torch.export.load`` runs code from the file (see the module
            docstring), so only a program you compiled yourself may be loaded.

    Raises:
        UntrustedProgramError: ``trust`` is False.
        FileNotFoundError: no file at ``path``.
        ValueError: not a regular file, not a program torch can load, or metadata that is
            not JSON (one line naming the file).
    """
    path = check_trusted(path, trust)
    extra = {METADATA: ""}
    try:
        program = torch.export.load(path, extra_files=extra)  # safe: trusted by the caller
    except Exception as err:  # torch's many readers: name the file, one line
        reason = " ".join(str(err).split())[:200]
        raise ValueError(f"{path} is not a program torch.export can load ({type(err).__name__}:"
                         f" {reason})") from None  # fmt: skip
    try:
        metadata = parse_json(extra[METADATA] or "{}", what=f"{path}'s {METADATA}")
    except FileError as err:
        raise ValueError(str(err)) from None
    return program, metadata
