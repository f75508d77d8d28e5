"""The whole deployment: checkpoint -> adapt on a support folder -> package, self-checked.

The package (`metalearn.deploy.package`: tensors and JSON) is the output; programs for
this machine are extra outputs beside it: a ``torch.export`` program (``program=True``),
an AOTInductor package (``aot=True``), a TensorRT engine in memory (``tensorrt=True``),
each checked against eager on the support set, with a per-image latency table of every
form written beside the package. Every target is checked before any work, so a refusal
leaves the disk as it was.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn

from metalearn.data.folders import load_support_folder
from metalearn.deploy.adapt import adapt_to_support
from metalearn.deploy.aot import aot_package_path, check_compiler, compile_aot, load_aot
from metalearn.deploy.latency import (
    check_repeats,
    latency_table,
    latency_table_path,
    measure_latency,
)
from metalearn.deploy.model import Norm, adapted_model, check_norm, default_norm, merge_lora
from metalearn.deploy.package import check_package_target, load_package, write_package
from metalearn.deploy.program import (
    check_export_target,
    exported,
    load_program,
    program_path,
    save_program,
)
from metalearn.deploy.run_checkpoint import load_learner
from metalearn.deploy.tensorrt import check_tensorrt, compile_tensorrt
from metalearn.files import write_atomically
from metalearn.runs.recipe import Recipe

__all__ = ["ExportReport", "export_from_checkpoint", "package_document"]

WARMUP = 5  # untimed calls before the timed ones (first-call allocation, lazy set-up)


class ExportReport(NamedTuple):
    """What `export_from_checkpoint` did, with its self-checks."""

    path: Path
    """The package folder written."""
    class_names: tuple[str, ...]
    """Class index -> support sub-folder name."""
    steps: int
    """Inner steps taken on the support set."""
    max_abs_diff: float
    """Max |package - eager| logit on the support set (the package reloaded)."""
    support_accuracy: float
    """Accuracy of the adapted model on its own support set."""
    program_path: Path | None = None
    """The ``torch.export`` program written (``program=True``)."""
    program_max_abs_diff: float | None = None
    """Max |program - eager| logit on the support set (the program reloaded)."""
    aot_path: Path | None = None
    """The AOTInductor package written (``aot=True``)."""
    aot_seconds: float | None = None
    """Wall-clock seconds the AOTInductor compile took."""
    aot_max_abs_diff: float | None = None
    """Max |AOT package - eager| logit on the support set (the package reloaded)."""
    tensorrt_max_abs_diff: float | None = None
    """Max |TensorRT - eager| logit on the support set (``tensorrt=True``)."""
    latency_path: Path | None = None
    """The latency table written (with a program, ``aot`` or ``tensorrt``)."""
    latency: str | None = None
    """That table's markdown."""
    norm: str | None = None
    """The batch-norm reading exported (`adapted_model`'s ``norm``)."""
    evaluation_norm: str | None = None
    """The reading the learner's `evaluate` uses (`MetaLearner.evaluation_norm`)."""


def package_document(
    recipe: Recipe,
    *,
    class_names: tuple[str, ...],
    norm: Norm,
    evaluation_norm: Norm,
    support_size: int,
    dtype: torch.dtype,
    source: dict[str, Any],
) -> dict[str, Any]:
    """The package document of a run's adapted network (`metalearn.deploy.package`): the
    recipe's backbone and its constructor arguments, the reading, the classes, the run's
    image decoding, and where it came from (``source``)."""
    arguments = {k: v for k, v in dataclasses.asdict(recipe.model).items() if k != "backbone"}
    image = recipe.data.image
    return {"architecture": {"name": recipe.model.backbone, "arguments": arguments},
            "dtype": str(dtype).removeprefix("torch."), "norm": norm,
            "evaluation_norm": evaluation_norm, "support_size": support_size,
            "class_names": list(class_names),
            "image": {"size": image.size, "channels": image.channels, "invert": image.invert,
                      "resample": image.resample},
            "source": source}  # fmt: skip


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
    program: bool = False,
    aot: bool = False,
    tensorrt: bool = False,
    latency_repeats: int = 50,
) -> ExportReport:
    """Load, adapt on a support folder, write the package, reload and compare.

    The package holds the adapted network with any low-rank adapters merged into their
    layers (`merge_lora`: the backbone its recipe names); the self-check compares the
    reloaded package with the learner's own adapted network.

    Args:
        checkpoint: a run's checkpoint, of either experiment (see `load_learner`).
        support_folder: one sub-folder of images per class (see `load_support_folder`),
            decoded as the run's training images were (its recipe's ``data.image``).
        out: the package folder to write.
        which: ``"best"`` or ``"last"`` weights.
        steps: inner steps (None: the run's ``eval_inner_steps``, as its test used).
        norm: batch norm at inference, see `adapted_model` (None: `default_norm`, the
            learner's own evaluation reading where that classifies each image on its own,
            else frozen support statistics). The document records it as ``norm`` and the
            learner's evaluation reading as ``evaluation_norm``.
        dynamic_batch: a program takes any batch size (False: the support set's).
        mixed_sizes: resize support images of different sizes instead of refusing them
            (recorded in the document's ``source``).
        device: where to adapt (programs are compiled for it; the package is CPU tensors).
        overwrite: replace existing outputs (a package only over a package, never a
            training checkpoint).
        program: also write the ``torch.export`` program (`program_path` of ``out``).
        aot: also compile the program with AOTInductor (`aot_package_path` of ``out``).
        tensorrt: also build a TensorRT engine (CUDA and ``torch_tensorrt``; not saved).
        latency_repeats: timed calls per form for the latency table (with a program,
            ``aot`` or ``tensorrt``; `latency_table_path` of ``out``).

    Returns:
        An `ExportReport`.

    Raises:
        FileExistsError: an output is refused, before any work.
        ValueError: ``aot`` without a C++ compiler, ``tensorrt`` without its needs,
            ``latency_repeats < 1`` or an unknown ``norm``, before any work.
    """
    if norm is not None:
        check_norm(norm)
    targets = _check_outputs(checkpoint, out, program, aot, tensorrt, latency_repeats, overwrite)
    learner, recipe = load_learner(checkpoint, which=which, device=device)
    support = load_support_folder(support_folder, image=recipe.data.image,
                                  ways=recipe.model.ways, mixed_sizes=mixed_sizes)  # fmt: skip
    x, y = support.x.to(device), support.y.to(device)
    steps = recipe.training.eval_inner_steps if steps is None else steps
    params = adapt_to_support(learner, x, y, steps=steps)
    norm = default_norm(learner) if norm is None else norm
    eager = adapted_model(learner, params, norm=norm, support_x=x)  # the learner's own network
    model = adapted_model(*merge_lora(learner.model, params), norm=norm, support_x=x)
    source = {"algorithm": recipe.learner.algorithm, "steps": steps, "which": which,
              "checkpoint": str(checkpoint), "dataset": recipe.data.dataset,
              "mixed_sizes": mixed_sizes}  # fmt: skip
    document = package_document(recipe, class_names=support.class_names, norm=norm,
                                evaluation_norm=learner.evaluation_norm, support_size=len(x),
                                dtype=x.dtype, source=source)  # fmt: skip
    path = write_package(out, model, document, overwrite=overwrite)
    loaded = load_package(path)  # the real loader, as a user's machine runs it
    report = ExportReport(path, support.class_names, steps,
                          _max_abs_diff(loaded.model, eager, x.cpu(), eager_device=x.device),
                          (_logits(eager, x).argmax(-1) == y).double().mean().item(),
                          norm=norm, evaluation_norm=learner.evaluation_norm)  # fmt: skip
    if not (program or aot or tensorrt):
        return report
    return _compile_and_time(report, model, x, loaded.document, targets, overwrite=overwrite,
                             dynamic_batch=dynamic_batch, repeats=latency_repeats,
                             tensorrt=tensorrt)  # fmt: skip


class _Targets(NamedTuple):
    program: Path | None
    aot: Path | None
    latency: Path | None


def _check_outputs(
    checkpoint: str | os.PathLike,
    out: str | os.PathLike,
    program: bool,
    aot: bool,
    tensorrt: bool,
    latency_repeats: int,
    overwrite: bool,
) -> _Targets:
    """Refuse, before any work, what the run could not finish; where each output goes."""
    out = Path(out)
    if out.exists() and not out.is_dir() and out.samefile(checkpoint):
        raise FileExistsError(f"--out {out} is the checkpoint being exported; choose another "
                              "--out (a package is a folder)")  # fmt: skip
    check_package_target(out, overwrite)
    kept = {"overwrite": overwrite, "source": checkpoint}
    program_at = aot_at = latency_at = None
    if program:
        program_at = check_export_target(program_path(out), label="the --program file", **kept)
    if aot:
        aot_at = check_export_target(aot_package_path(out), label="the --aot package", **kept)
        check_compiler()
    if tensorrt:
        check_tensorrt()
    if program or aot or tensorrt:
        check_repeats(latency_repeats, WARMUP)
        latency_at = check_export_target(latency_table_path(out), label="the latency table",
                                         **kept)  # fmt: skip
    return _Targets(program_at, aot_at, latency_at)


def _compile_and_time(
    report: ExportReport,
    model: nn.Module,
    x: Tensor,
    document: dict[str, Any],
    targets: _Targets,
    *,
    overwrite: bool,
    dynamic_batch: bool,
    repeats: int,
    tensorrt: bool,
) -> ExportReport:
    """Compile the requested forms, check each on the support set ``x``, and time them all.

    Forms are timed on one image (on the whole support set when a program's batch is
    fixed); the table goes to ``targets.latency`` and into the returned report.
    """
    one = x[:1] if dynamic_batch else x  # a fixed-batch program takes only the support size
    meta = {k: v for k, v in document.items() if k != "files"}

    def inference_mode_model(images: Tensor) -> Tensor:
        with torch.inference_mode():
            return model(images)

    forms: dict[str, tuple[Callable[[Tensor], Tensor], Tensor]] = {
        "eager": (model, one),
        "eager, inference_mode": (inference_mode_model, one),
    }
    changes: dict[str, Any] = {"latency_path": targets.latency}
    if targets.program is not None or targets.aot is not None:
        compiled = exported(model, x, dynamic_batch=dynamic_batch)
        if targets.program is not None:
            save_program(compiled, targets.program, metadata=meta, overwrite=overwrite)
            compiled, _ = load_program(targets.program, trust=True)  # written just now, here
            changes.update(program_path=targets.program, program_max_abs_diff=_max_abs_diff(
                compiled.module(), model, x))  # fmt: skip
        forms["exported program"] = (compiled.module(), one)
    if targets.aot is not None:
        start = time.perf_counter()
        compile_aot(compiled, targets.aot, metadata=meta, overwrite=overwrite)
        changes["aot_seconds"] = time.perf_counter() - start
        package, _ = load_aot(targets.aot, trust=True)  # compiled just now, here
        changes.update(aot_path=targets.aot, aot_max_abs_diff=_max_abs_diff(package, model, x))
        forms["AOTInductor package"] = (package, one)
    if tensorrt:
        engine = compile_tensorrt(model, x, dynamic_batch=dynamic_batch)
        changes["tensorrt_max_abs_diff"] = _max_abs_diff(engine, model, x, device="cuda")
        forms["TensorRT engine"] = (engine, one.to("cuda"))
    latencies = measure_latency(forms, repeats=repeats, warmup=WARMUP)
    devices = {name: images.device.type for name, (_, images) in forms.items()}
    table = latency_table(latencies, batch=len(one), repeats=repeats, warmup=WARMUP,
                          devices=devices)  # fmt: skip
    write_atomically(targets.latency, table, overwrite=overwrite, what="the latency table")
    return report._replace(latency=table, **changes)


def _logits(run: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """``run(x)`` under ``torch.inference_mode()``."""
    with torch.inference_mode():
        return run(x)


def _max_abs_diff(
    run: Callable[[Tensor], Tensor],
    model: nn.Module,
    x: Tensor,
    device: str | None = None,
    eager_device: torch.device | None = None,
) -> float:
    """Max |run - eager| logit on ``x``: ``run`` gets ``x`` on ``device`` (default: x's),
    the eager ``model`` on ``eager_device`` (default: x's)."""
    got = _logits(run, x.to(device or x.device)).to(x.device)
    reference = _logits(model, x.to(eager_device or x.device)).to(x.device)
    return (got - reference).abs().max().item()
