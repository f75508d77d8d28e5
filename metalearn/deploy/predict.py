"""Classify images with an adapted model, an exported program, an AOT package, or their file."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.export import ExportedProgram

from metalearn.deploy.aot import is_aot_package, load_aot
from metalearn.deploy.export import load_exported

__all__ = ["Prediction", "predict"]


class Prediction(NamedTuple):
    """What `predict` returns."""

    classes: Tensor
    """Predicted class index per image, ``[B]`` (int64)."""
    probabilities: Tensor
    """Softmax of the logits, ``[B, ways]``."""


def predict(
    model: nn.Module | ExportedProgram | Callable[[Tensor], Tensor] | str | os.PathLike,
    x: Tensor,
    *,
    trust: bool = False,
) -> Prediction:
    """Classify images under ``torch.inference_mode()``.

    Args:
        model: an adapted module, an ``ExportedProgram``, a loaded AOT package (`load_aot`),
            or the path of an exported ``.pt2`` or of an AOT package (``.aoti.pt2``).
        x: images ``[B, C, H, W]``. Under ``norm="transductive"`` the batch is normalised
            together (predict a query set in one call); under ``"support"`` and
            ``"beside_support"`` each image alone.
        trust: load an AOT package's path (its native code runs); a ``.pt2`` needs none.

    Returns:
        A `Prediction`: ``classes [B]`` and ``probabilities [B, ways]``.

    Raises:
        ValueError: an AOT package's path without ``trust=True``, an altered ``.pt2``, or
            images of another shape than an exported program takes.
    """
    if isinstance(model, (str, os.PathLike)):
        model = (
            load_aot(model, trust=trust)[0]
            if is_aot_package(model)
            else load_exported(model, trust=trust)[0]
        )
    if isinstance(model, ExportedProgram):
        check_input_shape(model, x)
    run = model.module() if isinstance(model, ExportedProgram) else model
    with torch.inference_mode():
        probabilities = torch.softmax(run(x), dim=-1)
    return Prediction(probabilities.argmax(-1), probabilities)


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
