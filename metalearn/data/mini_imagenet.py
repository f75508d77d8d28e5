"""mini-ImageNet (Vinyals et al., 2016) with Ravi and Larochelle's (2017) class split.

100 ImageNet classes of 600 images, 84x84 colour: 64 classes train, 16 validate, 20 test.
Two layouts are read, whichever the root holds (see docs/datasets.md):

* Ravi and Larochelle's: ``images/<file>.jpg`` with ``train.csv``, ``val.csv`` and
  ``test.csv`` beside it, each a header line then ``filename,label`` rows (``label`` the
  ImageNet wnid). The JPEGs are decoded once to ``image_size`` squares and cached.
* learn2learn's pickles: ``mini-imagenet-cache-{train,validation,test}.pkl``, each a dict
  with ``image_data`` (uint8 ``[N, 84, 84, 3]``) and ``class_dict`` (wnid -> list of rows
  of ``image_data``). Used as they are (84x84 only).

Classes come out sorted by wnid in both, images in file order within a class, so the two
layouts of the same data give the same `ImageSet`.
"""

from __future__ import annotations

import csv
import os
import pickle
from pathlib import Path

import numpy as np
import torch

from metalearn.data.image_set import (
    ImageSet,
    check_split,
    check_split_classes,
    image_set_from_files,
    warn_on_counts,
)

__all__ = [
    "MINI_IMAGENET_CLASSES",
    "MINI_IMAGENET_IMAGES_PER_CLASS",
    "MINI_IMAGENET_PICKLES",
    "load_mini_imagenet",
]

MINI_IMAGENET_CLASSES = {"train": 64, "val": 16, "test": 20}
MINI_IMAGENET_IMAGES_PER_CLASS = 600
MINI_IMAGENET_PICKLES = {
    s: f"mini-imagenet-cache-{m}.pkl"
    for s, m in (("train", "train"), ("val", "validation"), ("test", "test"))
}
_NAME = "mini-imagenet"


def load_mini_imagenet(
    root: str | os.PathLike,
    split: str,
    *,
    image_size: int = 84,
    cache_dir: str | os.PathLike | None = None,
    workers: int | None = None,
) -> ImageSet:
    """One split of mini-ImageNet as uint8 ``[N, 3, S, S]``, from either layout.

    Args:
        root: the folder holding ``images/`` and the csv files, or the pickles.
        split: ``"train"`` (64 classes), ``"val"`` (16) or ``"test"`` (20).
        image_size: side of the decoded images (the pickles hold 84 only).
        cache_dir: for the decoded JPEGs (default: `default_cache_dir`).
        workers: decoding processes (see `cached_decode`).

    Raises:
        FileNotFoundError: neither layout is there (the message says which files go where).
        ValueError: a split with other than the published number of classes, a row naming a
            missing image, or an image that cannot be decoded.

    Warns:
        UserWarning: a class without the published 600 images.
    """
    root = Path(root)
    check_split(split)
    pickled = root / MINI_IMAGENET_PICKLES[split]
    listing = root / f"{split}.csv"
    if pickled.is_file():
        if image_size != 84:
            raise ValueError(
                f"{pickled.name} holds 84x84 images; use image_size=84, or the images/ + csv "
                "layout for other sizes"
            )
        image_set, source = _from_pickle(pickled, split), pickled.name
    elif listing.is_file() and (root / "images").is_dir():
        image_set = _from_csv(root, listing, split, image_size, cache_dir, workers)
        source = listing.name
    else:
        raise FileNotFoundError(_how_to_get(root, split))
    check_split_classes(_NAME, split, image_set.num_classes, MINI_IMAGENET_CLASSES[split], source)
    warn_on_counts(image_set, MINI_IMAGENET_IMAGES_PER_CLASS)
    return image_set


def _how_to_get(root: Path, split: str) -> str:
    return (
        f"mini-ImageNet's {split} split was not found at {root}: put either "
        f"{MINI_IMAGENET_PICKLES[split]} (learn2learn's pickles, linked from its "
        "mini_imagenet.py) or images/ with train.csv, val.csv and test.csv (Ravi and "
        "Larochelle's split, github.com/twitter/meta-learning-lstm, images from image-net.org) "
        "in that folder; see docs/datasets.md"
    )


def _from_csv(
    root: Path,
    listing: Path,
    split: str,
    image_size: int,
    cache_dir: str | os.PathLike | None,
    workers: int | None,
) -> ImageSet:
    """Read ``filename,label`` rows (after a header) and decode ``images/<filename>``."""
    by_class: dict[str, list[Path]] = {}
    with open(listing, newline="") as f:
        rows = list(csv.reader(f))
    if not rows or [c.strip() for c in rows[0]] != ["filename", "label"]:
        raise ValueError(f"{listing} must start with the header line filename,label")
    for number, row in enumerate(rows[1:], start=2):
        if len(row) != 2:
            raise ValueError(f"{listing} line {number}: expected filename,label, got {row}")
        filename, label = (cell.strip() for cell in row)
        path = root / "images" / filename
        if not path.is_file():
            raise ValueError(
                f"{listing} line {number} names images/{filename}, which is missing; "
                "extract all the images into images/"
            )
        by_class.setdefault(label, []).append(path)
    classes = sorted(by_class.items())
    return image_set_from_files(
        _NAME, split, root, classes, size=image_size, cache_dir=cache_dir, workers=workers
    )


def _from_pickle(path: Path, split: str) -> ImageSet:
    """learn2learn's dict: ``image_data [N, 84, 84, 3]``, ``class_dict`` name -> rows."""
    with open(path, "rb") as f:
        cache = pickle.load(f)  # the published format is a pickle; load only trusted files
    if not isinstance(cache, dict) or not {"image_data", "class_dict"} <= set(cache):
        raise ValueError(
            f"{path} is not a mini-ImageNet cache: expected a dict with image_data and "
            "class_dict; re-download it"
        )
    data = np.asarray(cache["image_data"])
    if data.dtype != np.uint8 or data.ndim != 4 or data.shape[-1] != 3:
        raise ValueError(
            f"{path}: image_data must be uint8 [N, 84, 84, 3], got {data.dtype} {data.shape}"
        )
    names = sorted(cache["class_dict"])
    rows = [np.asarray(cache["class_dict"][name], dtype=np.int64) for name in names]
    order = torch.from_numpy(np.concatenate(rows)) if rows else torch.zeros(0, dtype=torch.long)
    images = torch.from_numpy(data).permute(0, 3, 1, 2)[order].contiguous()
    counts = torch.tensor([len(r) for r in rows], dtype=torch.long)
    return ImageSet(images, counts, tuple(names), _NAME, split)
