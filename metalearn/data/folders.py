"""Image folders as labelled sets: one sub-folder per class, images inside.

A folder laid out as ``folder/<class>/<image>`` becomes a `SupportSet`: each image decoded
by the run's `ImageFormat` (`metalearn.data.decoding`), the code that made its training
images, and one class index per sub-folder in sorted order. It is how a deployed learner
gets the support set it adapts to (`metalearn.deploy`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from metalearn.data.decoding import OMNIGLOT_FORMAT, ImageFormat, open_image
from metalearn.files import regular_file

__all__ = [
    "IMAGE_SUFFIXES",
    "OMNIGLOT_FORMAT",
    "SupportSet",
    "class_folders",
    "load_support_folder",
]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


class SupportSet(NamedTuple):
    """Labelled images read from a folder (see `load_support_folder`)."""

    x: Tensor
    """Images ``[N, ch, S, S]``, float32 in [0, 1], decoded by the run's `ImageFormat`."""
    y: Tensor
    """Class indices ``[N]`` (int64): ``y == i`` for images of ``class_names[i]``."""
    class_names: tuple[str, ...]
    """The class sub-folders' names, sorted; the class index is the position here."""
    source_sizes: tuple[tuple[int, int], ...]
    """Each image's ``(width, height)`` in its file, in the order of ``x``."""


def load_support_folder(
    folder: str | os.PathLike,
    *,
    image: ImageFormat = OMNIGLOT_FORMAT,
    ways: int | None = None,
    mixed_sizes: bool = False,
) -> SupportSet:
    """Read a support set: one sub-folder per class, images inside, decoded as in training.

    Each image is decoded by ``image`` (`ImageFormat.decode`): for the Omniglot format,
    grayscale, resized and inverted (ink 1, paper 0) by the code that builds the Omniglot
    training cache, so dark strokes on a light background look like Omniglot. Classes are
    the sub-folders in sorted order. Hidden files (``.DS_Store``) are skipped.

    Images whose files differ in size would be squashed to one square by different factors
    (a 400x60 strip and a 12x12 icon both become ``S x S``), which no training image was:
    they are refused unless ``mixed_sizes`` says to resize them anyway.

    Args:
        folder: ``folder/<class>/<image>``; any image format Pillow reads (see
            `IMAGE_SUFFIXES`).
        image: the run's image format (its recipe's ``data.image``).
        ways: the number of classes the model predicts; checked against the sub-folders.
        mixed_sizes: resize images of different sizes instead of refusing them.

    Returns:
        A `SupportSet`: ``x [N, ch, S, S]``, ``y [N]``, the class names, the files' sizes.

    Raises:
        FileNotFoundError: ``folder`` does not exist or is not a folder.
        ValueError: no class sub-folders, files beside them, an empty class, a file that
            is not an image or cannot be decoded (named), ``ways`` classes expected, or
            images of different sizes without ``mixed_sizes`` (two of them named).
    """
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
    paths = [path for _, files in entries for path in files]
    sizes = image_sizes(paths)
    if not mixed_sizes and len(set(sizes)) > 1:
        first = paths[0]
        other = next(p for p, s in zip(paths, sizes) if s != sizes[0])
        raise ValueError(
            f"{root} holds images of different sizes ({first.name} is "
            f"{sizes[0][0]}x{sizes[0][1]}, {other.relative_to(root)} is "
            f"{sizes[paths.index(other)][0]}x{sizes[paths.index(other)][1]}); each would be "
            f"squashed to {image.size}x{image.size} differently: crop them to one size, or "
            "pass mixed_sizes=True (--mixed-sizes) to resize them anyway"
        )
    x = load_images(paths, image)
    labels = [label for label, (_, files) in enumerate(entries) for _ in files]
    return SupportSet(x, torch.tensor(labels), tuple(name for name, _ in entries), tuple(sizes))


def load_images(paths: list[Path], image: ImageFormat = OMNIGLOT_FORMAT) -> Tensor:
    """Image files decoded by ``image`` as a batch: float32 ``[B, ch, S, S]`` in [0, 1].

    Raises:
        ValueError: a file that cannot be decoded (named).
    """
    return torch.stack([torch.from_numpy(image.decode(p)) for p in paths]).float().div_(255)


def image_sizes(paths: list[Path]) -> list[tuple[int, int]]:
    """Each file's ``(width, height)``, read from its header.

    Raises:
        ValueError: a file Pillow cannot open, not a regular file, or too large (named:
            `metalearn.data.decoding.open_image`).
    """
    sizes = []
    for path in paths:
        with open_image(path) as img:
            sizes.append(img.size)
    return sizes


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
    for path in files:  # a FIFO or a device named like an image, or a link out of the folder
        if path.suffix.lower() in IMAGE_SUFFIXES:
            regular_file(path, what="image", within=class_dir.parent)
    if not files:
        raise ValueError(f"class folder {class_dir} is empty; put at least one image in it")
    if others := [p.name for p in files if p.suffix.lower() not in IMAGE_SUFFIXES]:
        raise ValueError(
            f"{class_dir} holds files that are not images ({', '.join(others[:5])}); images "
            f"end in one of {', '.join(IMAGE_SUFFIXES)}: move the others out"
        )
    return files
