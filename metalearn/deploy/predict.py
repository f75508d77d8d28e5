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
            together (predict a query set in one call); under ``"support"`` each image alone.
        trust: load an AOT package's path (its native code runs); a ``.pt2`` needs none.

    Returns:
        A `Prediction`: ``classes [B]`` and ``probabilities [B, ways]``.

    Raises:
        ValueError: an AOT package's path without ``trust=True``, or an altered ``.pt2``.
    """
    if isinstance(model, (str, os.PathLike)):
        model = (
            load_aot(model, trust=trust)[0] if is_aot_package(model) else load_exported(model)[0]
        )
    run = model.module() if isinstance(model, ExportedProgram) else model
    with torch.inference_mode():
        probabilities = torch.softmax(run(x), dim=-1)
    return Prediction(probabilities.argmax(-1), probabilities)
