"""Classify images with an adapted model, a package, or a program you trust."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.export import ExportedProgram

from metalearn.deploy.aot import is_aot_package, load_aot
from metalearn.deploy.package import Package, load_package
from metalearn.deploy.program import check_trusted, load_program

__all__ = ["Prediction", "check_input_shape", "load_model", "predict"]


class Prediction(NamedTuple):
    """What `predict` returns."""

    classes: Tensor
    """Predicted class index per image, ``[B]`` (int64)."""
    probabilities: Tensor
    """Softmax of the logits, ``[B, ways]``."""


Model = nn.Module | Package | ExportedProgram | Callable[[Tensor], Tensor]


def load_model(path: str | os.PathLike, *, trust: bool = False) -> tuple[Model, dict]:
    """A package folder (data: any source), or with ``trust`` a program file you compiled
    (a ``.pt2`` or an AOTInductor ``.aoti.pt2``): ``(model, document)``.

    Raises:
        FileNotFoundError: nothing at ``path``.
        UntrustedProgramError: a file without ``trust``.
        ValueError: a package or program refused (one line).
    """
    path = Path(path)
    if path.is_dir() or not os.path.lexists(path):
        package = load_package(path)
        return package, package.document
    check_trusted(path, trust, what="program file (.pt2, code)")
    if is_aot_package(path):
        return load_aot(path, trust=trust)
    return load_program(path, trust=trust)


def predict(model: Model | str | os.PathLike, x: Tensor, *, trust: bool = False) -> Prediction:
    """Classify images under ``torch.inference_mode()``.

    Args:
        model: an adapted module, a `Package` (or its folder's path), an
            ``ExportedProgram``, a loaded AOT package, or with ``trust`` the path of a
            program you compiled (``.pt2``, ``.aoti.pt2``).
        x: images ``[B, C, H, W]``. Under ``norm="transductive"`` the batch is normalised
            together (predict a query set in one call); under ``"support"`` and
            ``"beside_support"`` each image alone.
        trust: load a program's path (its code runs); a package needs none.

    Returns:
        A `Prediction`: ``classes [B]`` and ``probabilities [B, ways]``.

    Raises:
        ValueError: a refused package, a program's path without ``trust=True``, images of
            another shape than the model takes, or non-finite logits (never a class picked
            from NaN).
    """
    if isinstance(model, (str, os.PathLike)):
        model = load_model(model, trust=trust)[0]
    if isinstance(model, Package):
        check_package_input(model, x)
        model = model.model
    if isinstance(model, ExportedProgram):
        check_input_shape(model, x)
    run = model.module() if isinstance(model, ExportedProgram) else model
    with torch.inference_mode():
        logits = run(x)
    if not torch.isfinite(logits).all():  # an argmax over NaN would still name a class
        bad = int((~torch.isfinite(logits)).any(-1).nonzero()[0])
        raise ValueError(f"the model's logits for image {bad} of the batch are not finite (NaN "
                         "or infinite): its weights are not those of a trained network; export "
                         "it again")  # fmt: skip
    probabilities = torch.softmax(logits, dim=-1)
    return Prediction(probabilities.argmax(-1), probabilities)


def check_package_input(package: Package, x: Tensor) -> None:
    """Refuse images that are not ``[B, channels, size, size]`` of the package's format.

    Raises:
        ValueError: the shape of ``x`` against the package's image format.
    """
    image = package.image
    if x.dim() != 4 or tuple(x.shape[1:]) != (image.channels, image.size, image.size):
        raise ValueError(f"images of shape {list(x.shape)}; this package takes [B, "
                         f"{image.channels}, {image.size}, {image.size}]: decode them with "
                         "its image format (package.image.decode)")  # fmt: skip


def check_input_shape(program: ExportedProgram, x: Tensor) -> None:
    """Refuse images whose shape the exported program was not exported for (it would fail
    with a bare ``AssertionError: Guard failed``).

    Raises:
        ValueError: the shape of ``x`` against the program's, where a batch dimension
            exported as dynamic may take any size.
    """
    user_inputs = [
        spec.arg.name
        for spec in program.graph_signature.input_specs
        if spec.kind == spec.kind.USER_INPUT
    ]
    node = next(
        n for n in program.graph.nodes if n.op == "placeholder" and n.name == user_inputs[0]
    )
    expected = node.meta["val"].shape
    fits = x.dim() == len(expected) and all(
        not isinstance(size, int) or size == got for size, got in zip(expected, x.shape)
    )
    if not fits:
        wanted = ", ".join("B" if not isinstance(s, int) else str(s) for s in expected)
        raise ValueError(
            f"images of shape {list(x.shape)}; this program takes [{wanted}]: resize the "
            "images as the package's metadata says (image_shape), one batch of one size"
        )
