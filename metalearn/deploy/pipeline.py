"""The whole deployment: checkpoint -> adapt on a support folder -> ``.pt2``, self-checked.

Optionally also an AOTInductor package (``aot=True``) and a TensorRT engine
(``tensorrt=True``), each checked against eager on the support set, and a per-image
latency table of every form written beside the ``.pt2``. Every target is checked before
any work, so a refusal leaves the disk as it was.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn
from torch.export import ExportedProgram

from metalearn.data.folders import load_support_folder
from metalearn.deploy.adapt import adapt_to_support
from metalearn.deploy.aot import aot_package_path, check_compiler, compile_aot, load_aot
from metalearn.deploy.export import (
    check_export_target,
    export_adapted,
    load_exported,
    write_atomically,
)
from metalearn.deploy.latency import (
    check_repeats,
    latency_table,
    latency_table_path,
    measure_latency,
)
from metalearn.deploy.model import Norm, adapted_model, check_norm, default_norm
from metalearn.deploy.run_checkpoint import load_learner
from metalearn.deploy.tensorrt import check_tensorrt, compile_tensorrt

__all__ = ["ExportReport", "export_from_checkpoint"]

WARMUP = 5  # untimed calls before the timed ones (first-call allocation, lazy set-up)


class ExportReport(NamedTuple):
    """What `export_from_checkpoint` did, with its self-checks."""

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
    aot_path: Path | None = None
    """The AOTInductor package written (``aot=True``)."""
    aot_seconds: float | None = None
    """Wall-clock seconds the AOTInductor compile took."""
    aot_max_abs_diff: float | None = None
    """Max |package - eager| logit on the support set (the package reloaded)."""
    tensorrt_max_abs_diff: float | None = None
    """Max |TensorRT - eager| logit on the support set (``tensorrt=True``)."""
    latency_path: Path | None = None
    """The latency table written (with ``aot`` or ``tensorrt``)."""
    latency: str | None = None
    """That table's markdown."""
    norm: str | None = None
    """The batch-norm reading exported (`adapted_model`'s ``norm``)."""
    evaluation_norm: str | None = None
    """The reading the learner's `evaluate` uses (`MetaLearner.evaluation_norm`)."""


def export_from_checkpoint(
    checkpoint: str | os.PathLike,
    support_folder: str | os.PathLike,
    out: str | os.PathLike,
    *,
    which: Literal["best", "last"] = "best",
    steps: int | None = None,
    norm: Norm | None = None,
    dynamic_batch: bool = True,
    mixed_sizes: bool = False,
    device: torch.device | str = "cpu",
    overwrite: bool = False,
    aot: bool = False,
    tensorrt: bool = False,
    latency_repeats: int = 50,
) -> ExportReport:
    """Load, adapt on a support folder, export, reload and compare: the whole pipeline.

    Args:
        checkpoint: a run's checkpoint, of either experiment (see `load_learner`).
        support_folder: one sub-folder of images per class (see `load_support_folder`),
            decoded as the run's training images were (its recipe's ``data.image``).
        out: the ``.pt2`` to write.
        which: ``"best"`` or ``"last"`` weights.
        steps: inner steps (None: the run's ``eval_inner_steps``, as its test used).
        norm: batch norm at inference, see `adapted_model` (None: `default_norm`, the
            learner's own evaluation reading where that classifies each image on its own,
            else frozen support statistics). The metadata records it as ``norm`` and the
            learner's evaluation reading as ``evaluation_norm``.
        dynamic_batch: the program takes any batch size.
        mixed_sizes: resize support images of different sizes instead of refusing them
            (recorded in the program's metadata).
        device: where to adapt (the program is exported for it).
        overwrite: replace existing outputs (never a training checkpoint).
        aot: also compile the program with AOTInductor (`aot_package_path` of ``out``).
        tensorrt: also build a TensorRT engine (CUDA and ``torch_tensorrt``; not saved).
        latency_repeats: timed calls per form for the latency table (with ``aot`` or
            ``tensorrt``; `latency_table_path` of ``out``).

    Returns:
        An `ExportReport`.

    Raises:
        FileExistsError: an output is refused (`check_export_target`), before any work.
        ValueError: ``aot`` without a C++ compiler, ``tensorrt`` without its needs,
            ``latency_repeats < 1`` or an unknown ``norm``, before any work.
    """
    if norm is not None:
        check_norm(norm)
    aot_path, latency_path = _check_outputs(checkpoint, out, aot, tensorrt, latency_repeats,
                                            overwrite)  # fmt: skip
    learner, recipe = load_learner(checkpoint, which=which, device=device)
    image = recipe.data.image
    support = load_support_folder(support_folder, image=image, ways=recipe.model.ways,
                                  mixed_sizes=mixed_sizes)  # fmt: skip
    x, y = support.x.to(device), support.y.to(device)
    steps = recipe.training.eval_inner_steps if steps is None else steps
    params = adapt_to_support(learner, x, y, steps=steps)
    norm = default_norm(learner) if norm is None else norm
    model = adapted_model(learner, params, norm=norm, support_x=x)
    meta = {"class_names": list(support.class_names), "norm": norm,
            "evaluation_norm": learner.evaluation_norm, "steps": steps,
            "algorithm": recipe.learner.algorithm, "which": which, "checkpoint": str(checkpoint),
            "dataset": recipe.data.dataset, "image_size": image.size, "channels": image.channels,
            "invert": image.invert, "resample": image.resample,
            "mixed_sizes": mixed_sizes}  # fmt: skip
    path = export_adapted(
        model, x, out, dynamic_batch=dynamic_batch, metadata=meta, overwrite=overwrite
    )
    program, _ = load_exported(path)
    report = ExportReport(
        path,
        support.class_names,
        steps,
        _max_abs_diff(program.module(), model, x),
        (_logits(model, x).argmax(-1) == y).double().mean().item(),
        norm=norm,
        evaluation_norm=learner.evaluation_norm,
    )
    if latency_path is None:
        return report
    return _compile_and_time(
        report, model, program, x, meta=meta, aot_path=aot_path, tensorrt=tensorrt,
        latency_path=latency_path, repeats=latency_repeats, overwrite=overwrite,
        dynamic_batch=dynamic_batch,
    )  # fmt: skip


def _check_outputs(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    aot: bool,
    tensorrt: bool,
    latency_repeats: int,
    overwrite: bool,
) -> tuple[Path | None, Path | None]:
    """Refuse, before any work, what the run could not finish: ``(aot_path, latency_path)``."""
    check_export_target(out, overwrite=overwrite, source=checkpoint)
    aot_path = latency_path = None
    kept = {"overwrite": overwrite, "source": checkpoint}
    if aot:
        aot_path = check_export_target(aot_package_path(out), label="the --aot package", **kept)
        check_compiler()
    if tensorrt:
        check_tensorrt()
    if aot or tensorrt:
        check_repeats(latency_repeats, WARMUP)
        latency_path = check_export_target(
            latency_table_path(out), label="the latency table", **kept
        )
    return aot_path, latency_path


def _compile_and_time(
    report: ExportReport,
    model: nn.Module,
    program: ExportedProgram,
    x: Tensor,
    *,
    meta: dict[str, Any],
    aot_path: Path | None,
    tensorrt: bool,
    latency_path: Path,
    repeats: int,
    overwrite: bool,
    dynamic_batch: bool,
) -> ExportReport:
    """Compile the requested forms, check each on the support set ``x``, and time them all.

    Forms are timed on one image (on the whole support set when the program's batch is
    fixed); the table goes to ``latency_path`` and into the returned report.
    """
    one = x[:1] if dynamic_batch else x  # a fixed-batch program takes only the support size

    def inference_mode_model(images: Tensor) -> Tensor:
        with torch.inference_mode():
            return model(images)

    forms: dict[str, tuple[Callable[[Tensor], Tensor], Tensor]] = {
        "eager": (model, one),
        "eager, inference_mode": (inference_mode_model, one),
        "exported program": (program.module(), one),
    }
    changes: dict[str, Any] = {"latency_path": latency_path}
    if aot_path is not None:
        start = time.perf_counter()
        compile_aot(program, aot_path, metadata=meta, overwrite=overwrite)
        changes["aot_seconds"] = time.perf_counter() - start
        package, _ = load_aot(aot_path, trust=True)  # compiled just now, here
        changes.update(aot_path=aot_path, aot_max_abs_diff=_max_abs_diff(package, model, x))
        forms["AOTInductor package"] = (package, one)
    if tensorrt:
        engine = compile_tensorrt(model, x, dynamic_batch=dynamic_batch)
        changes["tensorrt_max_abs_diff"] = _max_abs_diff(engine, model, x, device="cuda")
        forms["TensorRT engine"] = (engine, one.to("cuda"))
    latencies = measure_latency(forms, repeats=repeats, warmup=WARMUP)
    devices = {name: images.device.type for name, (_, images) in forms.items()}
    table = latency_table(latencies, batch=len(one), repeats=repeats, warmup=WARMUP,
                          devices=devices)  # fmt: skip
    write_atomically(latency_path, lambda tmp: Path(tmp).write_text(table),
                     overwrite=overwrite, suffix=".tmp.md")  # fmt: skip
    return report._replace(latency=table, **changes)


def _logits(run: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``run(x)`` under ``torch.inference_mode()``."""
    with torch.inference_mode():
        return run(x)


def _max_abs_diff(
    run: Callable[[Tensor], Tensor], model: nn.Module, x: Tensor, device: str | None = None
) -> float:
    """Max |run - eager| logit on ``x``; ``run`` gets ``x`` on ``device`` (default: x's)."""
    got = _logits(run, x.to(device or x.device)).to(x.device)
    return (got - _logits(model, x)).abs().max().item()
