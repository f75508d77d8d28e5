"""The deployed package: tensors and one JSON document, rebuilt by metalearn's own code.

A package is a folder a stranger can hand you::

    adapted/
      package.json          what the network is: an architecture of metalearn's model
                            registry (`metalearn.models.backbones`) and its constructor
                            arguments, the batch-norm reading, the class names, the image
                            decoding, the format version, each tensor file's SHA-256 and size
      weights.safetensors   the adapted weights and batch-norm statistics (safetensors: raw
                            little-endian tensors behind a JSON header; no pickle, no code)

`load_package` reads it as data: the document is strict JSON checked against a schema
(`check_document`: unknown keys, wrong types and out-of-range sizes are one line); the
network is built by metalearn's own constructors on the ``meta`` device (no memory) and its
size bounded; the tensor file is read whole (a regular file inside the folder, at most its
declared size), its checksum checked, parsed by the safetensors library, and every tensor
checked for name, shape, dtype and finiteness against what metalearn's code built; only then
is the network given memory and filled. Nothing in the folder is executed, imported,
unpickled or compiled, and each file is read by exactly one parser, the one whose result is
checked. A program (`metalearn.deploy.program`: ``torch.export``, AOTInductor) is code and
is no package.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from metalearn.data.decoding import RESAMPLE_FILTERS, ImageFormat
from metalearn.deploy.model import NORMS, FrozenBatchNorm, Norm, with_norm_reading
from metalearn.files import FileError, read_bytes, read_json, write_atomically
from metalearn.models.backbones import BACKBONES, build_backbone

__all__ = [
    "DOCUMENT",
    "FORMAT",
    "VERSION",
    "WEIGHTS",
    "Package",
    "PackageError",
    "check_document",
    "check_package_target",
    "is_package",
    "load_package",
    "write_package",
]

FORMAT = "metalearn-package"
VERSION = 1
DOCUMENT = "package.json"
WEIGHTS = "weights.safetensors"
DOCUMENT_BYTES = 1 << 20  # a document is a few kilobytes
WEIGHTS_BYTES = 1 << 31  # 2 GiB: a ResNet-12 is 50 MB
DTYPES = {"float32": torch.float32, "float64": torch.float64}
_AGAIN = "export the package again with metalearn-export"


class PackageError(ValueError):
    """A package refused: one line naming the file, the field or tensor, and the fix."""


class Package(NamedTuple):
    """What `load_package` returns."""

    model: nn.Module
    """The deployed network in evaluation mode, no gradients: ``[B, C, S, S] -> [B, ways]``."""
    class_names: tuple[str, ...]
    """Class index -> name (the support folder's class sub-folders)."""
    image: ImageFormat
    """How an image file becomes the network's input (as its training images were made)."""
    norm: Norm
    """The batch-norm reading the network was deployed with (`metalearn.deploy.NORMS`)."""
    document: dict[str, Any]
    """The whole checked ``package.json``."""


# --------------------------------------------------------------------------- the schema


def _integer(low: int, high: int) -> Callable[[Any, str], Any]:
    def check(value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise PackageError(f"{where}: {value!r:.40} is not an integer")
        if not low <= value <= high:
            raise PackageError(f"{where}: {value} is out of range ({low} to {high})")
        return value

    return check


def _number(low: float, high: float) -> Callable[[Any, str], Any]:
    def check(value: Any, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PackageError(f"{where}: {value!r:.40} is not a number")
        if not low <= value <= high:
            raise PackageError(f"{where}: {value} is out of range ({low} to {high})")
        return float(value)

    return check


def _text(longest: int, choices: tuple[str, ...] | None = None) -> Callable[[Any, str], Any]:
    def check(value: Any, where: str) -> str:
        if not isinstance(value, str):
            raise PackageError(f"{where}: {value!r:.40} is not a string")
        if choices is not None and value not in choices:
            raise PackageError(f"{where}: {value!r:.40} is none of {', '.join(choices)}")
        if len(value) > longest or not value.isprintable():
            raise PackageError(f"{where}: {value!r:.40} is not a printable string of at most "
                               f"{longest} characters")  # fmt: skip
        return value

    return check


def _boolean(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise PackageError(f"{where}: {value!r:.40} is not true or false")
    return value


def _optional(check: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    return lambda value, where: None if value is None else check(value, where)


def _names(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not 2 <= len(value) <= 10_000:
        raise PackageError(f"{where}: not a list of 2 to 10000 class names")
    names = [_text(255)(name, f"{where}[{i}]") for i, name in enumerate(value)]
    if len(set(names)) != len(names):
        raise PackageError(f"{where}: a class name appears twice")
    return names


def _sha256(value: Any, where: str) -> str:
    text = _text(64)(value, where)
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        raise PackageError(f"{where}: {text!r:.70} is not a SHA-256 (64 lowercase hex digits)")
    return text


def _object(fields: Mapping[str, Callable[[Any, str], Any]], optional: tuple[str, ...] = ()):
    """A JSON object with exactly ``fields`` (those in ``optional`` may be left out)."""

    def check(value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise PackageError(f"{where}: not a JSON object")
        if unknown := [k for k in value if k not in fields]:
            raise PackageError(f"{where}: unknown key {unknown[0]!r:.40} (a package of "
                               f"format version {VERSION} has {', '.join(fields)})")  # fmt: skip
        if missing := [k for k in fields if k not in value and k not in optional]:
            raise PackageError(f"{where}: no {missing[0]!r}")
        return {k: check_field(value[k], f"{where}.{k}") for k, check_field in fields.items()
                if k in value}  # fmt: skip

    return check


ARCHITECTURE_ARGUMENTS: dict[str, Callable[[Any, str], Any]] = {
    "in_channels": _integer(1, 4),
    "ways": _integer(2, 10_000),
    "hidden": _integer(1, 1024),
    "pool": _text(16, ("stride", "max")),
    "head": _text(16, ("mean", "flatten")),
    "image_size": _optional(_integer(1, 1024)),
    "activation": _text(16, ("relu", "leaky_relu")),
    "dropout": _number(0.0, 0.99),
}
"""`metalearn.models.backbones.build_backbone`'s keyword arguments, each with its range."""

_IMAGE = _object({"size": _integer(1, 1024), "channels": _integer(1, 3),
                  "invert": _boolean, "resample": _text(16, RESAMPLE_FILTERS)})  # fmt: skip
_SOURCE = _object(
    {"algorithm": _text(64), "steps": _integer(0, 1_000_000), "which": _text(8, ("best", "last")),
     "checkpoint": _text(4096), "dataset": _text(64), "mixed_sizes": _boolean},
    optional=("algorithm", "steps", "which", "checkpoint", "dataset", "mixed_sizes"),
)  # fmt: skip
_FILE = _object({"sha256": _sha256, "bytes": _integer(8, WEIGHTS_BYTES)})
_FIELDS = {
    "format": _text(32, (FORMAT,)),
    "version": _integer(VERSION, VERSION),
    "architecture": _object(
        {"name": _text(32, BACKBONES), "arguments": _object(ARCHITECTURE_ARGUMENTS)}
    ),  # fmt: skip
    "dtype": _text(16, tuple(DTYPES)),
    "norm": _text(32, NORMS),
    "evaluation_norm": _text(32, NORMS),
    "support_size": _integer(1, 100_000),
    "class_names": _names,
    "image": _IMAGE,
    "source": _SOURCE,
    "files": _object({WEIGHTS: _FILE}),
}


def check_document(document: Any, where: str = DOCUMENT, *, files: bool = True) -> dict[str, Any]:
    """The package document checked against the schema of format version `VERSION`.

    Args:
        document: the parsed JSON.
        where: how messages name it (the file's path).
        files: whether it lists tensor files (a package's does; a program's copy does not).

    Returns:
        The document, its numbers normalised (``dropout`` a float).

    Raises:
        PackageError: an unknown or missing key, a wrong type, an out-of-range value, a
            format or version other than this one, or class names that do not match the
            architecture's ways (one line naming the field).
    """
    if isinstance(document, dict) and document.get("format") == FORMAT \
            and document.get("version") != VERSION:  # fmt: skip
        raise PackageError(f"{where}: format version {document.get('version')!r:.20}; this "
                           f"metalearn reads version {VERSION}: {_AGAIN}")  # fmt: skip
    fields = _FIELDS if files else {k: v for k, v in _FIELDS.items() if k != "files"}
    checked = _object(fields)(document, where)
    ways = checked["architecture"]["arguments"]["ways"]
    if len(checked["class_names"]) != ways:
        raise PackageError(f"{where}: class_names holds {len(checked['class_names'])} names, "
                           f"the architecture predicts {ways} classes")  # fmt: skip
    image = checked["image"]
    if image["channels"] != checked["architecture"]["arguments"]["in_channels"]:
        raise PackageError(
            f"{where}: image.channels {image['channels']} but the architecture "
            f"takes {checked['architecture']['arguments']['in_channels']}"
        )
    try:
        ImageFormat(**image)
    except ValueError as err:
        raise PackageError(f"{where}: image: {err}") from None
    return checked


# --------------------------------------------------------------------------- reading


def is_package(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder holding a ``package.json`` (not checked here)."""
    return Path(path).is_dir() and os.path.lexists(Path(path) / DOCUMENT)


def skeleton(document: Mapping[str, Any], limit: int = WEIGHTS_BYTES) -> nn.Module:
    """The deployed network a checked document describes, built by metalearn's constructors
    on the ``meta`` device (shapes and names, no memory), in its batch-norm reading.

    Raises:
        PackageError: the network would hold more than ``limit`` bytes of tensors (checked
            before its batch-norm reading runs it), or the constructor refuses the arguments.
    """
    architecture, image = document["architecture"], document["image"]
    dtype = DTYPES[document["dtype"]]
    shape = (document["support_size"], image["channels"], image["size"], image["size"])
    try:
        with torch.device("meta"):
            net = build_backbone(architecture["name"], **architecture["arguments"])
            net = net.to(dtype).eval()
            _expected(net, limit)  # the bound first: the reading runs a forward
            return with_norm_reading(net, document["norm"], torch.empty(shape, dtype=dtype))
    except (ValueError, RuntimeError) as err:  # a constructor's refusal, a shape mismatch
        if isinstance(err, PackageError):
            raise
        reason = " ".join(str(err).split())[:200]
        raise PackageError(f"the architecture cannot be built ({reason})") from None


def _expected(model: nn.Module, limit: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each tensor the network holds: name -> (shape, dtype); refuses more than ``limit``
    bytes (computed from shapes: nothing is allocated)."""
    state = model.state_dict()
    total = sum(t.numel() * t.element_size() for t in state.values())
    if total > limit:
        raise PackageError(f"the architecture holds {total:,} bytes of tensors, more than a "
                           f"package may ({limit:,})")  # fmt: skip
    return {name: (tuple(t.shape), t.dtype) for name, t in state.items()}


def _tensors(path: Path, folder: Path, entry: Mapping[str, Any]) -> dict[str, Tensor]:
    """The tensor file read whole, its size and checksum checked, parsed by safetensors."""
    data = read_bytes(path, limit=entry["bytes"], what="tensor file", within=folder)
    if len(data) != entry["bytes"]:
        raise PackageError(f"{path}: {len(data):,} bytes, {DOCUMENT} says {entry['bytes']:,}")
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise PackageError(f"{path}: its SHA-256 is not the one {DOCUMENT} records (the file "
                           f"is damaged or was altered): {_AGAIN}")  # fmt: skip
    from safetensors.torch import load

    try:
        return load(data)
    except BaseException as err:  # SafetensorError, or a Rust panic (a BaseException)
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        reason = " ".join(str(err).split())[:200]
        raise PackageError(f"{path} is not a safetensors file ({reason}): {_AGAIN}") from None


def _check_tensors(
    tensors: Mapping[str, Tensor],
    expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    path: Path,
) -> None:
    """Every tensor the network needs, of its shape and dtype, finite; no other."""
    if missing := [n for n in expected if n not in tensors]:
        raise PackageError(f"{path} lacks the tensor {missing[0]!r:.80}: {_AGAIN}")
    if unknown := [n for n in tensors if n not in expected]:
        raise PackageError(f"{path} holds the tensor {unknown[0]!r:.80}, which the "
                           f"architecture has not: {_AGAIN}")  # fmt: skip
    for name, (shape, dtype) in expected.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise PackageError(f"{path}: tensor {name!r:.80} is {tensor.dtype} "
                               f"{list(tensor.shape)}, the architecture needs {dtype} "
                               f"{list(shape)}: {_AGAIN}")  # fmt: skip
        if not torch.isfinite(tensor).all():
            raise PackageError(f"{path}: tensor {name!r:.80} holds NaN or infinite values")


def _check_variances(model: nn.Module, tensors: Mapping[str, Tensor], path: Path) -> None:
    """Frozen batch-norm variances are >= 0 (a negative one is no statistic: NaN logits)."""
    for name, module in model.named_modules():
        if isinstance(module, FrozenBatchNorm) and (tensors[f"{name}.var"] < 0).any():
            raise PackageError(f"{path}: tensor {name + '.var'!r:.80}, a batch-norm variance, "
                               f"holds negative values: {_AGAIN}")  # fmt: skip


def load_package(path: str | os.PathLike) -> Package:
    """Read a package written by `write_package` (``metalearn-export``), as data only.

    Args:
        path: the package folder.

    Returns:
        A `Package`: the network (CPU, evaluation mode), class names, image format, reading.

    Raises:
        FileNotFoundError: no such folder, or a file the package needs is missing.
        PackageError: ``path`` is a file (a program is no package), the document or a
            tensor is refused (one line naming the field or tensor), or a file is not a
            regular file inside the folder, or larger than its bound.
    """
    folder = Path(path)
    if not folder.exists():
        raise FileNotFoundError(f"no package at {folder}; write one with metalearn-export")
    if not folder.is_dir():
        raise PackageError(f"{folder} is a file, not a package (a folder holding {DOCUMENT} "
                           f"and {WEIGHTS}); a .pt2 is a program, which runs code: load one "
                           "only if you made it, with trust=True (--trust)")  # fmt: skip
    where = folder / DOCUMENT
    try:
        document = check_document(read_json(where, limit=DOCUMENT_BYTES, what="package "
                                            "document", within=folder), str(where))  # fmt: skip
        model = skeleton(document)
        expected = _expected(model, WEIGHTS_BYTES)
        weights = folder / WEIGHTS
        tensors = _tensors(weights, folder, document["files"][WEIGHTS])
        _check_tensors(tensors, expected, weights)
        _check_variances(model, tensors, weights)
    except FileError as err:
        raise PackageError(str(err)) from None
    except PackageError as err:
        message = str(err)
        raise PackageError(message if message.startswith(str(folder)) else
                           f"package {folder}: {message}") from None  # fmt: skip
    model = model.to_empty(device="cpu")
    model.load_state_dict(tensors, strict=True)
    model.eval().requires_grad_(False)
    image = ImageFormat(**document["image"])
    return Package(model, tuple(document["class_names"]), image, document["norm"], document)


# --------------------------------------------------------------------------- writing


def write_package(
    path: str | os.PathLike,
    model: nn.Module,
    document: Mapping[str, Any],
    *,
    overwrite: bool = False,
) -> Path:
    """Write the deployed network ``model`` and its ``document`` as a package folder.

    The folder is built beside ``path`` under a fresh temporary name and renamed into place,
    so a crash leaves either the old package or the new one; an existing folder is replaced
    only with ``overwrite`` and only if it is a package (never another folder).

    Args:
        path: the package folder to create.
        model: the deployed network (`metalearn.deploy.adapted_model`), whose state must
            be exactly what ``document``'s architecture and reading build.
        document: every field of `check_document` but ``files`` (added here).
        overwrite: replace an existing package folder.

    Returns:
        ``path``.

    Raises:
        FileExistsError: ``path`` exists (without ``overwrite``, or not a package folder).
        PackageError: the document fails the schema, or ``model`` is not what it describes.
        FileError: the disk is full (one line; nothing replaced, no temporary folder left).
    """
    from safetensors.torch import save

    target = Path(path)
    check_package_target(target, overwrite)
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in model.state_dict().items()}
    data = save(state)
    full = {**document, "format": FORMAT, "version": VERSION,
            "files": {WEIGHTS: {"sha256": hashlib.sha256(data).hexdigest(),
                                "bytes": len(data)}}}  # fmt: skip
    checked = check_document(full, "the package document")
    _check_tensors(state, _expected(skeleton(checked), WEIGHTS_BYTES), Path(WEIGHTS))
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp"))
    try:
        write_atomically(staging / WEIGHTS, data, what="tensor file")
        write_atomically(staging / DOCUMENT, _json(checked), what="package document")
        os.chmod(staging, 0o755)
        _move_folder(staging, target, overwrite)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _json(document: Mapping[str, Any]) -> str:
    import json

    return json.dumps(document, indent=1, allow_nan=False) + "\n"


def check_package_target(target: str | os.PathLike, overwrite: bool) -> None:
    """Refuse a target that is not free: another file or folder always, a package unless
    ``overwrite``.

    Raises:
        FileExistsError: ``target`` exists and is not a package, or is one and
            ``overwrite`` is False.
    """
    target = Path(target)
    if not os.path.lexists(target):
        return
    if target.is_symlink() or not is_package(target):
        what = "a folder" if target.is_dir() and not target.is_symlink() else "a file"
        raise FileExistsError(
            f"--out {target} is {what}, not a metalearn package, never "
            "replaced (not even with --overwrite); choose another --out"
        )
    if not overwrite:
        raise FileExistsError(f"--out {target} exists; pass --overwrite to replace it, or "
                              "choose another --out")  # fmt: skip


def _move_folder(staging: Path, target: Path, overwrite: bool) -> None:
    """Rename ``staging`` to ``target``; an old package is moved aside first, then removed."""
    if not os.path.lexists(target):
        try:
            os.rename(staging, target)  # refused if a folder appeared there meanwhile
        except OSError:
            raise FileExistsError(f"--out {target} appeared while exporting; pass "
                                  "--overwrite to replace it") from None  # fmt: skip
        return
    check_package_target(target, overwrite)
    aside = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old."))
    os.rename(target, aside / "package")
    try:
        os.rename(staging, target)
    except OSError:
        os.rename(aside / "package", target)  # put the old one back
        raise
    shutil.rmtree(aside, ignore_errors=True)
