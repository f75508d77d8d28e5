"""Classify a folder of images with an adapted model: classes and probabilities.

What: reads a package written by ``metalearn-export`` (a folder of tensors and JSON:
`metalearn.deploy.load_package` checks every field and tensor, and runs no code from it),
decodes every image of a folder as the package says its training images were (image size,
channels, inversion, resampling: `metalearn.data.ImageFormat`), classifies them
(`metalearn.deploy.predict`) and writes one row per image: the file, the predicted class's
name (the package's ``class_names``, the support folder's class sub-folders) and the
probability of every class.

Command:
    metalearn-predict --model adapted --images my_queries/              # JSON on stdout
    metalearn-predict --model adapted --images my_queries/ --format csv --out preds.csv
    metalearn-predict --model adapted.pt2 --trust --images my_queries/  # your own program

``--images`` holds image files (sorted by name; hidden files skipped; any other file, a sub-
folder, an empty folder or a file that is not a regular file is refused, named). A model
exported with frozen support statistics (``norm: support``, the default of most learners)
or with each image beside the support set (``norm: beside_support``, Reptile's default)
classifies each image on its own, in batches of ``--batch`` (or of the size a
``--no-dynamic-batch`` program takes, the last padded); one exported with ``--norm
transductive`` normalises each call's batch together, so the whole folder is classified in
one call (as balanced a query set as its training tasks, or the numbers mean little). A
program (``.pt2``, ``.aoti.pt2``) is code: it is loaded only with ``--trust``, for files you
compiled yourself. An existing ``--out`` is replaced only with ``--overwrite`` (a training
checkpoint never), atomically. Bad input ends with a one-line error and exit code 2,
nothing written.
"""

from __future__ import annotations

import csv
import io
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from metalearn.runs.cli import parse_dataclass, quiet_on_closed_stdout

PROG = "metalearn-predict"


@dataclass
class Args:
    """Arguments of metalearn-predict (each is a --flag; see --help)."""

    model: str
    """The package folder written by metalearn-export (or, with --trust, a program file)."""
    images: str
    """A folder of image files to classify."""
    format: Literal["json", "csv"] = "json"
    """json: one object (the model's classes, a row per image); csv: a header, then file,
    class and one probability column per class."""
    out: str | None = None
    """Write here instead of stdout."""
    overwrite: bool = False
    """Replace an existing --out."""
    batch: int = 64
    """Images per call (a model reading support or beside_support; a transductive one takes
    the whole folder in one call; beside_support runs support + 1 images per image)."""
    mixed_sizes: bool = False
    """Resize images of different sizes instead of refusing them."""
    trust: bool = False
    """Load a program file (.pt2, .aoti.pt2), which runs its code: only one you compiled."""


@dataclass
class Predictions:
    """What `classify` returns: the model's classes and, per image, its file and row."""

    class_names: list[str]
    files: list[Path]
    classes: list[int]
    """Predicted class index per image."""
    probabilities: list[list[float]]
    """``[images][classes]``: softmax of the logits."""


def image_files(folder: Path) -> list[Path]:
    """The folder's image files, sorted by name, hidden files skipped.

    Raises:
        FileNotFoundError: no such folder.
        ValueError: an empty folder, or one holding a sub-folder, a file that is not an
            image, or one that is not a regular file inside the folder (named).
    """
    from metalearn.data.folders import IMAGE_SUFFIXES
    from metalearn.files import regular_file

    if not folder.is_dir():
        raise FileNotFoundError(f"--images {folder}: no such folder; pass a folder of images")
    files = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    if folders := [p.name for p in files if p.is_dir()]:
        raise ValueError(f"--images {folder} holds folders ({', '.join(folders[:5])}); pass "
                         "a folder of image files (one of those)")  # fmt: skip
    if others := [p.name for p in files if p.suffix.lower() not in IMAGE_SUFFIXES]:
        raise ValueError(f"--images {folder} holds files that are not images "
                         f"({', '.join(others[:5])}); images end in one of "
                         f"{', '.join(IMAGE_SUFFIXES)}: move the others out")  # fmt: skip
    if not files:
        raise ValueError(f"--images {folder} holds no images")
    for path in files:  # a FIFO or device named like an image, or a link out of the folder
        regular_file(path, what="image", within=folder)
    return files


def load_model(args: Args) -> tuple[Any, dict[str, Any], Any]:
    """The model, its document, and its `metalearn.data.ImageFormat`.

    Raises:
        FileNotFoundError: no such package or file.
        ValueError: a refused package, a program without ``--trust``, or a program whose
            metadata is not a package document (one line).
    """
    from metalearn.data import ImageFormat
    from metalearn.deploy import check_document, load_model

    model, document = load_model(args.model, trust=args.trust)
    if hasattr(model, "image"):  # a Package: checked as it was read
        return model, document, model.image
    checked = check_document(document, f"--model {args.model}'s metadata", files=False)
    return model, checked, ImageFormat(**checked["image"])


def fixed_batch(program: Any) -> int | None:
    """The batch size a program exported with ``--no-dynamic-batch`` takes; None when it
    takes any (its input's first dimension is symbolic, or the model is a package)."""
    if not hasattr(program, "graph_signature"):
        return None
    names = set(program.graph_signature.user_inputs)
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in names:
            size = node.meta["val"].shape[0]
            return size if isinstance(size, int) else None
    return None


def batches(count: int, batch: int, fixed: int | None, transductive: bool) -> list[range]:
    """Which images each call classifies: the whole folder in one call (transductive), else
    chunks of ``batch``, or of the program's ``fixed`` size (the last one padded by `classify`).

    Raises:
        ValueError: a transductive program exported for another number of images.
    """
    if transductive:
        if fixed is not None and fixed != count:
            raise ValueError(f"the model normalises a call's images together (--norm "
                             f"transductive) and was exported for calls of {fixed} images "
                             f"(--no-dynamic-batch); --images holds {count}: give {fixed}, or "
                             "export it again without --no-dynamic-batch")  # fmt: skip
        return [range(count)]
    step = fixed or batch
    return [range(start, min(start + step, count)) for start in range(0, count, step)]


def classify(args: Args) -> Predictions:
    """Load the model, decode the folder's images as its metadata says, classify them.

    Raises:
        FileNotFoundError, ValueError: a bad model, folder, image or ``--batch`` (named).
    """
    import torch

    from metalearn.data.folders import image_sizes, load_images
    from metalearn.deploy import predict

    if args.batch < 1:
        raise ValueError(f"--batch {args.batch}: must be at least 1")
    files = image_files(Path(args.images))
    program, meta, image = load_model(args)
    sizes = image_sizes(files)
    if not args.mixed_sizes and len(set(sizes)) > 1:
        other = next(f for f, s in zip(files, sizes) if s != sizes[0])
        (w0, h0), (w1, h1) = sizes[0], sizes[files.index(other)]
        raise ValueError(f"--images holds images of different sizes ({files[0].name} is "
                         f"{w0}x{h0}, {other.name} is {w1}x{h1}); each would be squashed to "
                         f"{image.size}x{image.size} differently: crop them to one size, or "
                         "pass --mixed-sizes")  # fmt: skip
    fixed = fixed_batch(program)
    classes, probabilities = [], []
    for chunk in batches(len(files), args.batch, fixed, meta["norm"] == "transductive"):
        x = load_images([files[i] for i in chunk], image)
        if fixed is not None and len(x) < fixed:  # each image alone: padding changes none
            x = torch.cat([x, x[-1:].expand(fixed - len(x), *x.shape[1:])])
        found = predict(program, x)
        classes += found.classes[: len(chunk)].tolist()
        probabilities += found.probabilities[: len(chunk)].to(torch.float64).tolist()
    return Predictions(list(meta["class_names"]), files, classes, probabilities)


def to_json(p: Predictions, model: str) -> str:
    """One JSON object: the model, its classes, and per image its file, class, probabilities."""
    rows = [{"file": f.name, "class": p.class_names[c], "index": c,
             "probabilities": dict(zip(p.class_names, probs))}
            for f, c, probs in zip(p.files, p.classes, p.probabilities)]  # fmt: skip
    return json.dumps({"model": model, "classes": p.class_names, "predictions": rows}, indent=1)


def to_csv(p: Predictions) -> str:
    """A header (``file, class, <each class name>``), then one line per image."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["file", "class", *p.class_names])
    for f, c, probs in zip(p.files, p.classes, p.probabilities):
        writer.writerow([f.name, p.class_names[c], *probs])
    return out.getvalue()


def check_out(out: str | None, overwrite: bool) -> None:
    """Refuse an existing ``--out`` without ``--overwrite``, and a training checkpoint
    always (before any work).

    Raises:
        FileExistsError: it exists (or is a checkpoint, or a folder).
    """
    if out is None:
        return
    from metalearn.deploy import check_export_target

    check_export_target(out, overwrite=overwrite)


def write(text: str, out: str | None, overwrite: bool) -> None:
    """``text`` to stdout, or to ``out`` (atomically; an existing file only with overwrite)."""
    if out is None:
        print(text, end="" if text.endswith("\n") else "\n")
        return
    from metalearn.files import write_atomically

    check_out(out, overwrite)
    write_atomically(out, text, overwrite=overwrite, what="--out")


@quiet_on_closed_stdout
def main(argv: Sequence[str] | None = None) -> int:
    """``metalearn-predict``: parse, classify, write; a user error is one line on stderr
    and exit status 2."""
    args = parse_dataclass(Args, argv, description=__doc__.split("\n\n")[0])
    try:
        check_out(args.out, args.overwrite)
        found = classify(args)
        text = to_json(found, args.model) if args.format == "json" else to_csv(found)
        write(text, args.out, args.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
