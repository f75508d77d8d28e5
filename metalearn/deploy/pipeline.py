"""The whole deployment: checkpoint -> adapt on a support folder -> ``.pt2``, self-checked."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, NamedTuple

import torch

from metalearn.data.folders import load_support_folder
from metalearn.deploy.adapt import adapt_to_support
from metalearn.deploy.export import check_export_target, export_adapted, load_exported
from metalearn.deploy.model import adapted_model
from metalearn.deploy.run_checkpoint import load_learner

__all__ = ["ExportReport", "export_from_checkpoint"]


class ExportReport(NamedTuple):
    """What `export_from_checkpoint` did, with its self-check."""

    path: Path
    """The ``.pt2`` written."""
    class_names: tuple[str, ...]
    """Class index -> support sub-folder name."""
    steps: int
    """Inner steps taken on the support set."""
    max_abs_diff: float
    """Max |exported - eager| logit on the support set (the exported program reloaded)."""
    support_accuracy: float
    """Accuracy of the adapted model on its own support set."""


def export_from_checkpoint(
    checkpoint: str | os.PathLike,
    support_folder: str | os.PathLike,
    out: str | os.PathLike,
    *,
    which: Literal["best", "last"] = "best",
    steps: int | None = None,
    norm: Literal["support", "transductive"] = "support",
    dynamic_batch: bool = True,
    resample: str = "lanczos",
    device: torch.device | str = "cpu",
    overwrite: bool = False,
) -> ExportReport:
    """Load, adapt on a support folder, export, reload and compare: the whole pipeline.

    Args:
        checkpoint: an Omniglot experiment checkpoint (see `load_learner`).
        support_folder: one sub-folder of images per class (see `load_support_folder`).
        out: the ``.pt2`` to write.
        which: ``"best"`` or ``"last"`` weights.
        steps: inner steps (None: the run's ``eval_inner_steps``, as its test used).
        norm: batch norm at inference, see `adapted_model`.
        dynamic_batch: the program takes any batch size.
        resample: image resizing filter (the experiment trains with ``"lanczos"``).
        device: where to adapt (the program is exported for it).
        overwrite: replace an existing ``out`` (never a training checkpoint).

    Returns:
        An `ExportReport`.

    Raises:
        FileExistsError: ``out`` is refused (`check_export_target`), before any work.
    """
    check_export_target(out, overwrite=overwrite, source=checkpoint)
    learner, args = load_learner(checkpoint, which=which, device=device)
    support = load_support_folder(support_folder, resample=resample, ways=args["ways"])
    x, y = support.x.to(device), support.y.to(device)
    steps = args.get("eval_inner_steps", learner.inner_steps) if steps is None else steps
    params = adapt_to_support(learner, x, y, steps=steps)
    model = adapted_model(learner, params, norm=norm, support_x=x)
    meta = {"class_names": list(support.class_names), "norm": norm, "steps": steps,
            "algorithm": args["algorithm"], "which": which, "checkpoint": str(checkpoint),
            "image_size": int(x.shape[-1]), "resample": resample}  # fmt: skip
    path = export_adapted(
        model, x, out, dynamic_batch=dynamic_batch, metadata=meta, overwrite=overwrite
    )
    program, _ = load_exported(path)
    with torch.inference_mode():
        eager, exported = model(x), program.module()(x)
    return ExportReport(
        path,
        support.class_names,
        steps,
        (exported - eager).abs().max().item(),
        (eager.argmax(-1) == y).double().mean().item(),
    )
