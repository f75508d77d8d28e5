"""A user's own labelled images: ``ROOT/{train,val,test}/<class>/<images>``.

Each split is a folder of class folders; classes of a split are its sub-folders in sorted
order, any number of images each (at least ``shots + queries`` for sampling). Images are
decoded once to ``image_size`` squares, RGB or grayscale, and cached like the benchmarks'.
"""

from __future__ import annotations

import os
from pathlib import Path

from metalearn.data.folders import class_folders
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
    classes = class_folders(folder)
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
