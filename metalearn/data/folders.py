"""Image folders as labelled sets: one sub-folder per class, images inside.

A folder laid out as ``folder/<class>/<image>`` becomes a `SupportSet`: the images decoded
exactly as the Omniglot training cache decodes its PNGs (`decode_image`: grayscale,
resized, inverted so ink is 1), and one class index per sub-folder in sorted order. It is
how a deployed learner gets the support set it adapts to (`metalearn.deploy`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from metalearn.data.omniglot import RESAMPLE_FILTERS, decode_image

__all__ = ["IMAGE_SUFFIXES", "SupportSet", "class_folders", "load_support_folder"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


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
    entries = class_folders(root)
    if ways is not None and len(entries) != ways:
        raise ValueError(
            f"{root} holds {len(entries)} class folders ({', '.join(n for n, _ in entries)}) "
            f"but the model predicts {ways} classes; give exactly {ways} class folders"
        )
    images, labels = [], []
    for label, (_, paths) in enumerate(entries):
        images += [torch.from_numpy(decode_image(str(p), image_size, resample)) for p in paths]
        labels += [label] * len(paths)
    x = torch.stack(images).unsqueeze(1).float().div_(255)
    return SupportSet(x, torch.tensor(labels), tuple(name for name, _ in entries))


def class_folders(folder: Path) -> list[tuple[str, list[Path]]]:
    """``folder``'s class sub-folders in sorted order, each with its images (sorted).

    Hidden entries are ignored. Shared by support folders and `load_image_folder`'s splits.

    Raises:
        ValueError: files beside the class folders, no class folder, an empty class or a
            file that is not an image (each named).
    """
    entries = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    if loose := [p.name for p in entries if not p.is_dir()]:
        raise ValueError(
            f"{folder} holds files beside the class folders ({', '.join(loose[:5])}); put "
            "every image inside its class's sub-folder"
        )
    if not entries:
        raise ValueError(f"{folder} holds no class folders; make one per class with its images")
    return [(entry.name, _class_images(entry)) for entry in entries]


def _class_images(class_dir: Path) -> list[Path]:
    """The images of one class folder, sorted; refuses an empty folder or non-images."""
    files = sorted(p for p in class_dir.iterdir() if not p.name.startswith("."))
    if not files:
        raise ValueError(f"class folder {class_dir} is empty; put at least one image in it")
    if others := [p.name for p in files if p.suffix.lower() not in IMAGE_SUFFIXES]:
        raise ValueError(
            f"{class_dir} holds files that are not images ({', '.join(others[:5])}); images "
            f"end in one of {', '.join(IMAGE_SUFFIXES)}: move the others out"
        )
    return files
