"""A user's own labelled images: ``ROOT/{train,val,test}/<class>/<images>``.

Each split is a folder of class folders; classes of a split are its sub-folders in sorted
order, any number of images each (at least ``shots + queries`` for sampling). Images are
decoded once to ``image_size`` squares, RGB or grayscale, and cached like the benchmarks'.
"""

from __future__ import annotations

import os
from pathlib import Path

from metalearn.data.folders import IMAGE_SUFFIXES
from metalearn.data.image_set import ImageSet, check_split, image_set_from_files

__all__ = ["load_image_folder"]

_NAME = "folder"


def load_image_folder(
    root: str | os.PathLike,
    split: str,
    *,
    image_size: int = 84,
    channels: int = 3,
    cache_dir: str | os.PathLike | None = None,
    workers: int | None = None,
) -> ImageSet:
    """One split of ``ROOT/<split>/<class>/<images>`` as uint8 ``[N, channels, S, S]``.

    Raises:
        FileNotFoundError: ``ROOT/<split>`` is missing.
        ValueError: no class folders, files beside them, an empty class, a file that is
            not an image (named), or ``channels`` other than 1 or 3.
    """
    check_split(split)
    if channels not in (1, 3):
        raise ValueError(f"channels={channels}; choose 3 (RGB) or 1 (grayscale)")
    root = Path(root)
    folder = root / split
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{folder} is missing: an image folder holds train/, val/ and test/, each with "
            "one sub-folder of images per class; see docs/datasets.md"
        )
    entries = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    if loose := [p.name for p in entries if not p.is_dir()]:
        raise ValueError(
            f"{folder} holds files beside the class folders ({', '.join(loose[:5])}); put "
            "every image inside its class's sub-folder"
        )
    if not entries:
        raise ValueError(f"{folder} holds no class folders; make one per class with its images")
    classes = [(entry.name, _class_images(entry)) for entry in entries]
    return image_set_from_files(
        _NAME,
        split,
        root,
        classes,
        size=image_size,
        channels=channels,
        cache_dir=cache_dir,
        workers=workers,
    )


def _class_images(class_dir: Path) -> list[Path]:
    files = sorted(p for p in class_dir.iterdir() if not p.name.startswith("."))
    if others := [p.name for p in files if p.suffix.lower() not in IMAGE_SUFFIXES]:
        raise ValueError(
            f"{class_dir} holds files that are not images ({', '.join(others[:5])}); images "
            f"end in one of {', '.join(IMAGE_SUFFIXES)}: move the others out"
        )
    if not files:
        raise ValueError(f"class folder {class_dir} is empty; put at least one image in it")
    return files
