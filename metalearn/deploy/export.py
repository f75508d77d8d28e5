"""``torch.export`` an adapted network to a ``.pt2`` file, never over data it was not given.

A ``.pt2`` is written to a temporary file beside its target and then renamed into place,
so a crash mid-write leaves whatever was there intact. An existing file is replaced only
when asked (``overwrite=True``), and a training checkpoint never: exporting over
``runs/<run>/checkpoint.pt`` would turn the run into one adapted task.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.export import Dim, ExportedProgram

from metalearn.deploy.archive import load_program
from metalearn.deploy.program_check import check_program_archive, check_targets
from metalearn.deploy.run_checkpoint import is_run_checkpoint

__all__ = [
    "check_export_target",
    "export_adapted",
    "load_exported",
    "sibling_path",
    "write_atomically",
]

_METADATA = "metalearn.json"  # the name of the metadata file inside a .pt2


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
        label: how messages name the file: ``"--out"`` for the ``.pt2`` itself, or what a
            file written beside it is (e.g. ``"the --aot package"``), named after ``--out``.

    Raises:
        FileExistsError: ``path`` is a folder, the source checkpoint, a training
            checkpoint, or (without ``overwrite``) any existing file.
    """
    path = Path(path)
    if label == "--out":
        fix = f"choose another --out (e.g. {path.parent / 'adapted.pt2'})"
    else:  # a file named after --out: another --out renames it
        fix = "choose another --out (the files beside it are named after it)"
    if path.is_dir():
        raise FileExistsError(f"{label} {path} is a folder; give the .pt2 file to write")
    if not path.exists():
        return path
    if source is not None and Path(source).exists() and path.samefile(source):
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
    """A file beside ``out`` named after it: ``adapted.pt2`` -> ``adapted<suffix>``.

    One naming rule for everything written next to the exported program (the AOTInductor
    package ``adapted.aoti.pt2``, the latency table ``adapted.latency.md``).
    """
    out = Path(out)
    stem = out.name[: -len(".pt2")] if out.name.endswith(".pt2") else out.name
    return out.with_name(stem + suffix)


def export_adapted(
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
        model: e.g. `adapted_model`'s result, ``[B, C, H, W] -> [B, ways]``.
        example_x: an example input ``[B, C, H, W]`` (the support images do).
        path: the ``.pt2`` file to write (its folder is created).
        dynamic_batch: let the program take any batch size; False fixes it to
            ``example_x``'s.
        metadata: JSON-serialisable facts stored inside the file (class names, norm mode,
            ...); `load_exported` returns them.
        overwrite: replace an existing file (never a training checkpoint).

    Returns:
        The path written.

    Raises:
        FileExistsError: see `check_export_target`; nothing is written.
    """
    path = check_export_target(path, overwrite=overwrite)
    dynamic = ({0: Dim.DYNAMIC},) if dynamic_batch else None
    program = torch.export.export(model, (example_x,), dynamic_shapes=dynamic)
    extra = {_METADATA: json.dumps(dict(metadata or {}))}
    # torch.export.save warns unless the name ends in .pt2, so the temporary file does too.
    # Serialised in memory, then written by Python: torch's C++ file writer aborts the
    # process on a full disk, where Python's write raises OSError (ENOSPC).
    buffer = io.BytesIO()
    torch.export.save(program, buffer, extra_files=extra)
    write_atomically(
        path, lambda tmp: Path(tmp).write_bytes(buffer.getvalue()), overwrite=overwrite
    )
    return path


def write_atomically(
    path: Path, write: Callable[[str], object], *, overwrite: bool, suffix: str = ".tmp.pt2"
) -> None:
    """Let ``write`` fill a temporary file beside ``path``, then move it into place.

    A crash mid-write leaves any previous file intact, as ``save_checkpoint`` does; without
    ``overwrite``, a file that appeared at ``path`` meanwhile is not replaced.

    Args:
        path: the final file (its folder is created).
        write: called with the temporary file's name; writes the whole file there.
        overwrite: replace an existing ``path``.
        suffix: the temporary name's ending (torch's writers want ``.pt2``).

    Raises:
        ValueError: ``write`` failed with an ``OSError`` (a full disk): nothing replaced.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=suffix)
    os.close(fd)
    try:
        try:
            write(tmp)
        except OSError as err:  # a full disk, a quota: nothing replaced, one line
            reason = err.strerror or str(err)
            raise ValueError(f"could not write {path}: {reason}; free space there or choose "
                             "another --out; nothing was replaced") from None  # fmt: skip
        os.chmod(tmp, 0o644)
        _move_into_place(Path(tmp), path, overwrite)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _move_into_place(tmp: Path, path: Path, overwrite: bool) -> None:
    """Rename ``tmp`` to ``path``; without ``overwrite``, fail if ``path`` appeared meanwhile.

    ``os.link`` creates the name only if it is free (atomically), where ``os.replace``
    would silently take over a file written since `check_export_target` looked.
    """
    if overwrite:
        os.replace(tmp, path)
        return
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise FileExistsError(
            f"--out {path} appeared while exporting; pass --overwrite to replace it"
        ) from None
    except OSError:  # a file system without hard links: look once more, then rename
        if path.exists():
            raise FileExistsError(
                f"--out {path} appeared while exporting; pass --overwrite to replace it"
            ) from None
        os.replace(tmp, path)


def load_exported(
    path: str | os.PathLike, *, trust: bool = False
) -> tuple[ExportedProgram, dict[str, Any]]:
    """Read a ``.pt2`` written by `export_adapted`: ``(program, metadata)``.

    Before torch reads anything, `check_program_archive` checks the member list and the
    configs (no pickled weight or constant, no custom or opaque object, no AOTInductor
    library unless ``trust``, no member name leaving the archive, shape expressions, guards
    and node targets within their grammars); every pickled member torch still reads (the
    sample inputs) is read as tensors only (`load_program`); after loading, every call in
    the graph is checked to be a torch operator (`check_targets`).

    Args:
        path: the ``.pt2`` file.
        trust: allow an AOTInductor library inside the archive (torch opens it, running its
            native code): only for packages you compiled or whose author you trust.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: the file was altered or is no exported program (one line naming the
            member); `UntrustedPackageError` for an AOTInductor library without ``trust``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no exported program at {path}; write one with export_adapted")
    try:
        check_program_archive(path, trust=trust)
    except zipfile.BadZipFile:
        raise ValueError(f"{path} is not a .pt2 archive (not a zip file)") from None
    extra = {_METADATA: ""}
    program = load_program(path, extra)
    check_targets(path, program)
    return program, json.loads(extra[_METADATA] or "{}")
