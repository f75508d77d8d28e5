"""Adapt a trained learner to a support folder and write it as a package of data.

What: loads a run's checkpoint (``runs/<run>/checkpoint.pt``, of either experiment), adapts it
on the images of a support folder (one sub-folder per class, each image decoded as the run's
training images were: its recipe's image size, channels and decoding), writes the adapted
network as a package (a folder: ``package.json``, naming the architecture, the classes, the
image decoding and the batch-norm reading, and ``weights.safetensors``), reloads it as
``metalearn-predict`` does and prints the largest logit difference from the eager model on
the support set. Support images of different sizes are refused unless ``--mixed-sizes``.

Command (NAME: a run's folder name, as the run printed it):
    metalearn-export --checkpoint runs/NAME/checkpoint.pt --support my_support/ \\
        --out adapted [--program] [--aot] [--tensorrt]

A package is data: anyone may hand you one, and loading it runs no code from it. Programs
are code, for the machine that compiled them: --program also writes the ``torch.export``
program adapted.pt2, --aot an AOTInductor package adapted.aoti.pt2 (a C++ compiler is
needed; about half a minute), --tensorrt builds a TensorRT engine in memory (CUDA and
torch_tensorrt); each is checked against eager on the support set, and a per-image latency
table of every form is written to adapted.latency.md and printed. Loading a program needs
``trust=True`` (``metalearn-predict --trust``): only for files you compiled yourself.

An existing ``--out`` is replaced only with ``--overwrite`` (and only if it is a package), a
training checkpoint never; each file is written atomically. Bad input ends with a one-line
error and exit code 2, with nothing on disk changed.

Then ``metalearn-predict --model adapted --images FOLDER`` classifies a folder of images;
or, in Python (see docs/deploy.md)::

    from metalearn.deploy import load_package, predict
    package = load_package("adapted")          # tensors and JSON, checked
    prediction = predict(package, images)      # images as the run's: e.g. [B, 1, 28, 28], ink 1
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from metalearn.runs.cli import parse_dataclass, quiet_on_closed_stdout

if TYPE_CHECKING:  # imported where used: --help loads no torch
    from metalearn.deploy import ExportReport

PROG = "metalearn-export"


@dataclass
class Args:
    """Arguments of metalearn-export (each is a --flag; see --help)."""

    checkpoint: str
    """The run's checkpoint file, runs/NAME/checkpoint.pt."""
    support: str
    """Support folder: one sub-folder of images per class."""
    out: str | None = None
    """The package folder to write (default: adapted/ beside the checkpoint)."""
    overwrite: bool = False
    """Replace an existing --out package (never another folder or a training checkpoint)."""
    which: Literal["best", "last"] = "best"
    """best: the best-validation weights (what the run tested); last: the latest."""
    steps: int | None = None
    """Inner steps on the support set (default: the run's eval_inner_steps)."""
    norm: Literal["support", "transductive", "beside_support"] | None = None
    """Batch norm: support (frozen support-set statistics, each image alone), transductive
    (each call's batch statistics, as in training: classify a whole balanced query set per
    call) or beside_support (each image in a batch with the support set alone). Default:
    the learner's own evaluation reading where it classifies each image alone (Reptile's
    beside_support), else support."""
    dynamic_batch: bool = True
    """Programs take any batch size (--no-dynamic-batch: the support set's size only)."""
    mixed_sizes: bool = False
    """Resize support images of different sizes instead of refusing them (recorded)."""
    device: str = "cpu"
    """Where to adapt; programs are compiled for this device."""
    program: bool = False
    """Also write the torch.export program <out>.pt2 (code: for this machine, loaded with
    --trust)."""
    aot: bool = False
    """Also compile the program with AOTInductor into <out>.aoti.pt2 (needs a C++ compiler)."""
    tensorrt: bool = False
    """Also build a TensorRT engine through torch_tensorrt (needs it and a CUDA device)."""
    latency_repeats: int = 50
    """Timed calls per form for the latency table <out>.latency.md (with --program, --aot or
    --tensorrt)."""


def export(args: Args) -> ExportReport:
    """Run the pipeline and print the path and the self-check."""
    from metalearn.deploy import export_from_checkpoint

    out = args.out or str(Path(args.checkpoint).parent / "adapted")
    report = export_from_checkpoint(
        args.checkpoint, args.support, out, which=args.which, steps=args.steps, norm=args.norm,
        dynamic_batch=args.dynamic_batch, mixed_sizes=args.mixed_sizes, device=args.device,
        overwrite=args.overwrite, program=args.program, aot=args.aot, tensorrt=args.tensorrt,
        latency_repeats=args.latency_repeats,
    )  # fmt: skip
    print(f"package: {report.path}")
    print(f"classes: {', '.join(f'{i}={n}' for i, n in enumerate(report.class_names))}")
    print(f"inner steps: {report.steps}, support accuracy: {report.support_accuracy:.3f}")
    print(f"batch norm: {report.norm} (the learner's evaluate reads {report.evaluation_norm})")
    print(f"self-check: max |package - eager| logit on the support set = {report.max_abs_diff:.3g}")
    if report.program_path is not None:
        print(f"program: {report.program_path} (code: load it here, with --trust)")
        print(
            "self-check: max |program - eager| logit on the support set = "
            f"{report.program_max_abs_diff:.3g}"
        )
    if report.aot_path is not None:
        print(f"AOT package: {report.aot_path} (compiled in {report.aot_seconds:.1f} s)")
        print(
            "self-check: max |AOT package - eager| logit on the support set = "
            f"{report.aot_max_abs_diff:.3g}"
        )
    if report.tensorrt_max_abs_diff is not None:
        print(
            "self-check: max |TensorRT - eager| logit on the support set = "
            f"{report.tensorrt_max_abs_diff:.3g}"
        )
    if report.latency is not None:
        print(f"latency table: {report.latency_path}\n{report.latency}", end="")
    return report


@quiet_on_closed_stdout
def main(argv: Sequence[str] | None = None) -> int:
    """``metalearn-export``: parse, export, and turn a user error into one line on stderr and
    exit status 2."""
    args = parse_dataclass(Args, argv, description=__doc__.split("\n\n")[0])
    try:
        export(args)
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
