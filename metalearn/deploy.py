"""Deploy an adapted learner: checkpoint -> adapt on a support folder -> ``torch.export``.

The pipeline, one function per step (``scripts/export_adapted.py`` is the command line)::

    learner, args = load_learner("runs/maml-5w1s-seed0/checkpoint.pt", which="best")
    support = load_support_folder("my_support/", ways=args["ways"])   # one folder per class
    params = adapt_to_support(learner, support.x, support.y, steps=args["eval_inner_steps"])
    model = adapted_model(learner, params)                        # an ordinary nn.Module
    export_adapted(model, support.x, "adapted.pt2", metadata={"classes": support.class_names})
    program, meta = load_exported("adapted.pt2")
    prediction = predict(program, images)                         # classes, probabilities

**Batch norm at inference.** Conv4's `MetaBatchNorm` is transductive: it normalises with
the statistics of the batch it is given, in training and in evaluation alike, so an
image's logits depend on the other images in its batch. `adapted_model` offers both
readings. ``norm="support"`` (the default) freezes each batch norm's statistics at those of
the support set (`FrozenBatchNorm`), so every image is classified on its own, whatever
else is in its batch. ``norm="transductive"`` keeps the training behaviour exactly: the
exported program takes any batch size and normalises each call's batch together, which
is right for a whole balanced query set in one call and wrong for one image at a time.
Measured on 200 Omniglot 5-way 1-shot test tasks (``docs/deploy.md``): transductive with
the 75 query images in one batch 88.6%, frozen support statistics 86.1%, transductive one
image per call 18.3% (chance is 20%).
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor, nn
from torch.export import Dim, ExportedProgram

from metalearn.algorithms import MetaLearner, build_learner
from metalearn.checkpoint import load_checkpoint
from metalearn.data.omniglot import RESAMPLE_FILTERS, decode_image
from metalearn.debug import check_consistent
from metalearn.models import MetaBatchNorm
from metalearn.outer import Task

__all__ = [
    "FrozenBatchNorm",
    "IMAGE_SUFFIXES",
    "Prediction",
    "SupportSet",
    "adapt_to_support",
    "adapted_model",
    "ExportReport",
    "export_adapted",
    "export_from_checkpoint",
    "load_exported",
    "load_learner",
    "load_support_folder",
    "predict",
]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")
_METADATA = "metalearn.json"  # the name of the metadata file inside a .pt2


def load_learner(
    path: str | os.PathLike,
    which: Literal["best", "last"] = "best",
    device: torch.device | str = "cpu",
) -> tuple[MetaLearner, dict[str, Any]]:
    """Rebuild a learner from an Omniglot experiment checkpoint (``runs/<name>/checkpoint.pt``).

    Args:
        path: the checkpoint file.
        which: ``"best"``: the best-validation weights (what the experiment tests);
            ``"last"``: the weights of the last completed meta-step.
        device: where the learner goes.

    Returns:
        ``(learner, args)``: the learner with the chosen weights, and the run's arguments
        (``args["ways"]``, ``args["eval_inner_steps"]``, ...).

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        ValueError: ``which`` is unknown, the checkpoint holds no best weights yet, or its
            weights do not fit the learner its args describe.
    """
    if which not in ("best", "last"):
        raise ValueError(f"which={which!r}; choose 'best' (best validation) or 'last'")
    saved = load_checkpoint(path)
    if not isinstance(saved, dict) or "args" not in saved or "learner" not in saved:
        raise ValueError(
            f"{path} is not an Omniglot experiment checkpoint (no 'args'/'learner' entries); "
            "pass runs/<run_name>/checkpoint.pt"
        )
    state = saved["best_learner"] if which == "best" else saved["learner"]
    if state is None:
        raise ValueError(
            f"{path} holds no best-validation weights yet (the run stopped before its first "
            "validation); pass which='last' (--which last) for the latest weights"
        )
    args = dict(saved["args"])
    learner = build_learner(args)
    try:
        learner.load_state_dict(state)
    except RuntimeError as err:
        raise ValueError(
            f"the weights in {path} do not fit the {args['algorithm']} learner its args "
            f"describe (ways={args['ways']}, hidden={args['hidden']}): {err}"
        ) from None
    return learner.to(device), args


# --------------------------------------------------------------------------- the support set


class SupportSet(NamedTuple):
    """Labelled images read from a folder (see `load_support_folder`)."""

    x: Tensor
    """Images ``[N, 1, S, S]``, float32 in [0, 1], strokes 1 (Omniglot's convention)."""
    y: Tensor
    """Class indices ``[N]`` (int64): ``y == i`` for images of ``class_names[i]``."""
    class_names: tuple[str, ...]
    """The class sub-folders' names, sorted; the class index is the position here."""


def load_support_folder(
    folder: str | os.PathLike,
    *,
    image_size: int = 28,
    resample: str = "lanczos",
    ways: int | None = None,
) -> SupportSet:
    """Read a support set: one sub-folder per class, images inside, decoded as in training.

    Each image is converted to grayscale, resized to ``image_size`` square with
    ``resample`` and inverted (ink 1, paper 0) by the same code that builds the Omniglot
    training cache, so dark strokes on a light background look like Omniglot. Classes are
    the sub-folders in sorted order. Hidden files (``.DS_Store``) are skipped.

    Args:
        folder: ``folder/<class>/<image>``; any image format Pillow reads (see
            `IMAGE_SUFFIXES`).
        image_size: side in pixels (28 for the Omniglot experiments).
        resample: ``"lanczos"`` (the training default), ``"bilinear"`` or ``"nearest"``;
            use what the model was trained with.
        ways: the number of classes the model predicts; checked against the sub-folders.

    Returns:
        A `SupportSet`: ``x [N, 1, S, S]``, ``y [N]``, the class names.

    Raises:
        FileNotFoundError: ``folder`` does not exist or is not a folder.
        ValueError: no class sub-folders, files beside them, an empty class, a file that
            is not an image or cannot be decoded (named), or ``ways`` classes expected.
    """
    if resample not in RESAMPLE_FILTERS:
        raise ValueError(f"resample={resample!r}; choose one of {RESAMPLE_FILTERS}")
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(
            f"support folder {root} does not exist or is not a folder; make one sub-folder per "
            "class holding that class's images"
        )
    entries = sorted(p for p in root.iterdir() if not p.name.startswith("."))
    if loose := [p.name for p in entries if not p.is_dir()]:
        raise ValueError(
            f"{root} holds files beside the class folders ({', '.join(loose[:5])}); put every "
            "image inside its class's sub-folder"
        )
    if not entries:
        raise ValueError(f"{root} holds no class sub-folders; make one per class with its images")
    if ways is not None and len(entries) != ways:
        raise ValueError(
            f"{root} holds {len(entries)} class folders ({', '.join(p.name for p in entries)}) "
            f"but the model predicts {ways} classes; give exactly {ways} class folders"
        )
    images, labels = [], []
    for label, class_dir in enumerate(entries):
        paths = _class_images(class_dir)
        images += [torch.from_numpy(decode_image(str(p), image_size, resample)) for p in paths]
        labels += [label] * len(paths)
    x = torch.stack(images).unsqueeze(1).float().div_(255)
    return SupportSet(x, torch.tensor(labels), tuple(p.name for p in entries))


def _class_images(class_dir: Path) -> list[Path]:
    files = sorted(p for p in class_dir.iterdir() if not p.name.startswith("."))
    if not files:
        raise ValueError(f"class folder {class_dir} is empty; put at least one image in it")
    if others := [p.name for p in files if p.suffix.lower() not in IMAGE_SUFFIXES]:
        raise ValueError(
            f"{class_dir} holds files that are not images ({', '.join(others[:5])}); images "
            f"end in one of {', '.join(IMAGE_SUFFIXES)}: move the others out"
        )
    return files


# --------------------------------------------------------------------------- adapt


def adapt_to_support(
    learner: MetaLearner, x: Tensor, y: Tensor, steps: int | None = None
) -> dict[str, Tensor]:
    """The learner's fast weights for the support set ``(x, y)`` (its own inner loop).

    This is ``learner.adapt`` (MAML++ and Meta-SGD use their learned rates; MAML++ its
    last step's batch-norm weights), detached, after checking the inputs.

    Args:
        learner: a trained learner (e.g. from `load_learner`).
        x: support images ``[N, C, H, W]`` on the learner's device and dtype.
        y: class indices ``[N]`` (int64), each in ``[0, ways)``.
        steps: inner steps (None: ``learner.inner_steps``, the training value; the
            experiment evaluates with its ``eval_inner_steps``).

    Returns:
        Parameter name -> adapted tensor, every parameter of ``learner.model``.

    Raises:
        ValueError: shapes, label range or device disagree (named), or ``steps < 0``.
        TypeError: ``y`` is not an integer tensor or ``x``'s dtype is not the model's.
    """
    if x.dim() != 4 or y.dim() != 1 or len(x) != len(y):
        raise ValueError(
            f"support images must be [N, C, H, W] and labels [N], got {tuple(x.shape)} and "
            f"{tuple(y.shape)}; load them with load_support_folder"
        )
    if y.is_floating_point() or y.dtype == torch.bool:
        raise TypeError(f"labels must be class indices (int64), got {y.dtype}; use y.long()")
    check_consistent(learner=learner, support=(x, y))
    with torch.no_grad():
        ways = learner.model(x[:2]).shape[-1]
    if y.min() < 0 or y.max() >= ways:
        raise ValueError(
            f"labels span {int(y.min())}..{int(y.max())} but the model predicts {ways} classes "
            f"(0..{ways - 1}); relabel the support set or use a model with more ways"
        )
    if steps is not None and steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    empty = (x[:0], y[:0])  # adapt reads only the support set
    return learner.adapt(Task(support=(x, y), query=empty), steps=steps)


# --------------------------------------------------------------------------- the adapted model


class FrozenBatchNorm(nn.Module):
    """`MetaBatchNorm` with fixed statistics: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    Built by `adapted_model(norm="support")` from the support set's statistics, so each
    example is normalised on its own, whatever else is in its batch.

    Shape:
        ``[N, C, *]`` in and out; ``mean``, ``var``, ``weight``, ``bias`` are ``[C]``.
    """

    def __init__(self, mean: Tensor, var: Tensor, weight: Tensor, bias: Tensor, eps: float):
        super().__init__()
        self.register_buffer("mean", mean.detach().clone())
        self.register_buffer("var", var.detach().clone())
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        scale = torch.rsqrt(self.var + self.eps) * self.weight
        return (x - self.mean.reshape(shape)) * scale.reshape(shape) + self.bias.reshape(shape)


def adapted_model(
    learner: MetaLearner | nn.Module,
    params: Mapping[str, Tensor],
    *,
    norm: Literal["support", "transductive"] = "support",
    support_x: Tensor | None = None,
) -> nn.Module:
    """A standalone copy of the network with the adapted weights, in eval mode, no grads.

    Args:
        learner: the learner (or its model) that was adapted.
        params: the adapted weights (`adapt_to_support`), every parameter of the model.
        norm: ``"support"``: every `MetaBatchNorm` becomes a `FrozenBatchNorm` with the
            statistics of ``support_x`` through the adapted network (each image is then
            classified on its own); ``"transductive"``: batch norm uses each call's batch
            statistics, as in training (see the module docstring for the trade-off).
        support_x: the support images ``[N, C, H, W]`` (needed for ``norm="support"``).

    Returns:
        An ``nn.Module`` ``[B, C, H, W] -> [B, ways]`` (logits).

    Raises:
        ValueError: ``params`` lacks a parameter, ``norm`` is unknown, or ``support_x`` is
            missing for ``norm="support"``.
    """
    model = copy.deepcopy(learner.model if isinstance(learner, MetaLearner) else learner)
    names = [n for n, _ in model.named_parameters()]
    if missing := [n for n in names if n not in params]:
        raise ValueError(f"params lack {missing[:4]}: pass the full dict adapt_to_support returns")
    model.load_state_dict({**dict(model.named_buffers()), **params}, strict=False)
    model.eval().requires_grad_(False)
    if norm == "support":
        if support_x is None:
            raise ValueError("norm='support' needs support_x, the support images [N, C, H, W]")
        _freeze_batch_norm(model, support_x)
    elif norm != "transductive":
        raise ValueError(f"norm={norm!r}; choose 'transductive' or 'support'")
    return model


def _freeze_batch_norm(model: nn.Module, support_x: Tensor) -> None:
    """Replace each `MetaBatchNorm` by a `FrozenBatchNorm` holding its support statistics."""
    stats: dict[str, tuple[Tensor, Tensor]] = {}

    def record(name: str):
        def hook(module: nn.Module, inputs: tuple[Tensor, ...]) -> None:
            (x,) = inputs
            dims = (0, *range(2, x.dim()))
            mean = x.mean(dims)  # biased variance, as `metalearn.models.batch_norm`
            stats[name] = (
                mean,
                ((x - mean.reshape((1, -1) + (1,) * (x.dim() - 2))) ** 2).mean(dims),
            )

        return hook

    norms = {n: m for n, m in model.named_modules() if isinstance(m, MetaBatchNorm)}
    if not norms:
        raise ValueError("norm='support' found no MetaBatchNorm in the model; use 'transductive'")
    handles = [m.register_forward_pre_hook(record(n)) for n, m in norms.items()]
    try:
        with torch.no_grad():
            model(support_x)
    finally:
        for handle in handles:
            handle.remove()
    for name, module in norms.items():
        frozen = FrozenBatchNorm(*stats[name], module.weight, module.bias, module.eps)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, frozen)


# --------------------------------------------------------------------------- export and predict


def export_adapted(
    model: nn.Module,
    example_x: Tensor,
    path: str | os.PathLike,
    *,
    dynamic_batch: bool = True,
    metadata: Mapping[str, Any] | None = None,
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

    Returns:
        The path written.
    """
    dynamic = ({0: Dim.DYNAMIC},) if dynamic_batch else None
    program = torch.export.export(model, (example_x,), dynamic_shapes=dynamic)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = {_METADATA: json.dumps(dict(metadata or {}))}
    # torch.export.save warns unless the name ends in .pt2, so the temporary file does too.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp.pt2")
    os.close(fd)
    try:  # a crash mid-write leaves any previous file intact, as save_checkpoint does
        torch.export.save(program, tmp, extra_files=extra)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def load_exported(path: str | os.PathLike) -> tuple[ExportedProgram, dict[str, Any]]:
    """Read a ``.pt2`` written by `export_adapted`: ``(program, metadata)``.

    Raises:
        FileNotFoundError: no file at ``path``.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no exported program at {path}; write one with export_adapted")
    extra = {_METADATA: ""}
    program = torch.export.load(path, extra_files=extra)
    return program, json.loads(extra[_METADATA] or "{}")


class Prediction(NamedTuple):
    """What `predict` returns."""

    classes: Tensor
    """Predicted class index per image, ``[B]`` (int64)."""
    probabilities: Tensor
    """Softmax of the logits, ``[B, ways]``."""


def predict(model: nn.Module | ExportedProgram | str | os.PathLike, x: Tensor) -> Prediction:
    """Classify images under ``torch.inference_mode()``.

    Args:
        model: an adapted module, an ``ExportedProgram``, or the path of a ``.pt2``.
        x: images ``[B, C, H, W]``. Under ``norm="transductive"`` the batch is normalised
            together (predict a query set in one call); under ``"support"`` each image alone.

    Returns:
        A `Prediction`: ``classes [B]`` and ``probabilities [B, ways]``.
    """
    if isinstance(model, (str, os.PathLike)):
        model = load_exported(model)[0]
    run = model.module() if isinstance(model, ExportedProgram) else model
    with torch.inference_mode():
        probabilities = torch.softmax(run(x), dim=-1)
    return Prediction(probabilities.argmax(-1), probabilities)


# --------------------------------------------------------------------------- the whole pipeline


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

    Returns:
        An `ExportReport`.
    """
    learner, args = load_learner(checkpoint, which=which, device=device)
    support = load_support_folder(support_folder, resample=resample, ways=args["ways"])
    x, y = support.x.to(device), support.y.to(device)
    steps = args.get("eval_inner_steps", learner.inner_steps) if steps is None else steps
    params = adapt_to_support(learner, x, y, steps=steps)
    model = adapted_model(learner, params, norm=norm, support_x=x)
    meta = {"class_names": list(support.class_names), "norm": norm, "steps": steps,
            "algorithm": args["algorithm"], "which": which, "checkpoint": str(checkpoint),
            "image_size": int(x.shape[-1]), "resample": resample}  # fmt: skip
    path = export_adapted(model, x, out, dynamic_batch=dynamic_batch, metadata=meta)
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
