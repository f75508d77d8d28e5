"""tiered-ImageNet (Ren et al., 2018): 608 ImageNet classes under 34 super-categories.

Train, validation and test hold 351, 97 and 160 classes from 20, 6 and 8 super-categories
(448,695, 124,261 and 206,209 images of 84x84), so no super-category spans two splits.
The layout is Ren et al.'s release (``tiered-imagenet.tar``, the one learn2learn reads),
in the root or in ``tiered-imagenet/`` inside it:

* ``{split}_labels.pkl``: a dict with ``label_specific`` (class per image, ``[N]``),
  ``label_general`` (super-category per image) and, when present, ``label_specific_str``
  (class names, indexed by ``label_specific``);
* ``{split}_images_png.pkl``: a list of PNG-encoded images (bytes or uint8 arrays), decoded
  once and cached (memory-mapped when read back: the training split is 9.5 GB decoded);
  or ``{split}_images.npz`` with an ``images`` array uint8 ``[N, 84, 84, 3]``.

``split`` is ``train``, ``val`` or ``test``, as in the file names.
"""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from metalearn.data.image_set import ImageSet, cached_decode, check_split, check_split_classes

__all__ = [
    "TIERED_IMAGENET_CLASSES",
    "TIERED_IMAGENET_IMAGES",
    "TIERED_IMAGENET_SUPERCLASSES",
    "load_tiered_imagenet",
]

TIERED_IMAGENET_CLASSES = {"train": 351, "val": 97, "test": 160}
TIERED_IMAGENET_SUPERCLASSES = {"train": 20, "val": 6, "test": 8}
TIERED_IMAGENET_IMAGES = {"train": 448_695, "val": 124_261, "test": 206_209}
_NAME = "tiered-imagenet"


def load_tiered_imagenet(
    root: str | os.PathLike,
    split: str,
    *,
    cache_dir: str | os.PathLike | None = None,
    workers: int | None = None,
) -> ImageSet:
    """One split of tiered-ImageNet as uint8 ``[N, 3, 84, 84]``, classes in label order.

    Raises:
        FileNotFoundError: the labels or images file is missing (the message names them).
        ValueError: other than the published numbers of classes or super-categories, labels
            and images of different lengths, or an image that cannot be decoded.

    Warns:
        UserWarning: a split without the published number of images.
    """
    check_split(split)
    folder = _folder(Path(root), split)
    labels = _read_pickle(folder / f"{split}_labels.pkl")
    specific = np.asarray(labels.get("label_specific", []), dtype=np.int64)
    general = np.asarray(labels.get("label_general", []), dtype=np.int64)
    if specific.ndim != 1 or len(specific) == 0 or len(general) != len(specific):
        raise ValueError(
            f"{folder / f'{split}_labels.pkl'} needs label_specific and label_general lists "
            "of one label per image; re-download it"
        )
    source = f"{split}_labels.pkl"
    classes = len(set(specific.tolist()))
    check_split_classes(_NAME, split, classes, TIERED_IMAGENET_CLASSES[split], source)
    supers = len(set(general.tolist()))
    if supers != TIERED_IMAGENET_SUPERCLASSES[split]:
        raise ValueError(
            f"{_NAME} {split} split: {source} gives {supers} super-categories, the published "
            f"split has {TIERED_IMAGENET_SUPERCLASSES[split]}; re-download the files"
        )
    names = _class_names(labels, specific)
    order = np.argsort(specific, kind="stable")  # class-major before decoding: no copy after
    images, fingerprint = _images(folder, split, order, len(specific), cache_dir, workers)
    # Labels are 0..C-1 in Ren et al.'s files; any other ids are renumbered in sorted order.
    ids, counts = np.unique(specific, return_counts=True)
    if len(images) != TIERED_IMAGENET_IMAGES[split]:
        warnings.warn(
            f"{_NAME} {split}: {len(images)} images, the published split has "
            f"{TIERED_IMAGENET_IMAGES[split]}; results will not be comparable to papers",
            stacklevel=2,
        )
    return ImageSet(
        images,
        torch.from_numpy(counts).long(),
        tuple(names[i] for i in ids.tolist()),
        _NAME,
        split,
        fingerprint,
    )


def _folder(root: Path, split: str) -> Path:
    for candidate in (root, root / "tiered-imagenet"):
        if (candidate / f"{split}_labels.pkl").is_file():
            return candidate
    raise FileNotFoundError(
        f"tiered-ImageNet's {split} split was not found at {root}: put {split}_labels.pkl and "
        f"{split}_images_png.pkl (or {split}_images.npz) there or in tiered-imagenet/ inside "
        "it, as extracted from tiered-imagenet.tar (Ren et al., "
        "github.com/renmengye/few-shot-ssl-public); see docs/datasets.md"
    )


def _read_pickle(path: Path) -> Any:
    """A published pickle; Python 2 pickles (Ren et al.'s) are read with latin-1 strings."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; extract it from tiered-imagenet.tar")
    with open(path, "rb") as f:
        try:
            return pickle.load(f)  # the published format is a pickle; load only trusted files
        except UnicodeDecodeError:
            f.seek(0)
            return pickle.load(f, encoding="latin1")


def _class_names(labels: dict, specific: np.ndarray) -> dict[int, str]:
    names = labels.get("label_specific_str")
    ids = sorted(set(specific.tolist()))
    if names is not None and len(names) > max(ids):
        return {i: str(names[i]) for i in ids}
    return {i: f"class {i}" for i in ids}


def _images(
    folder: Path,
    split: str,
    order: np.ndarray,
    count: int,
    cache_dir: str | os.PathLike | None,
    workers: int | None,
) -> tuple[torch.Tensor, str | None]:
    """The images in ``order``: from the npz as they are, or the PNGs decoded and cached."""
    npz, pngs = folder / f"{split}_images.npz", folder / f"{split}_images_png.pkl"
    if npz.is_file():
        with np.load(npz) as archive:
            data = archive["images"]
        _check_length(npz, len(data), count)
        return torch.from_numpy(data[order]).permute(0, 3, 1, 2).contiguous(), None
    if not pngs.is_file():
        raise FileNotFoundError(
            f"{pngs} (or {npz.name}) is missing beside {split}_labels.pkl; extract it from "
            "tiered-imagenet.tar"
        )

    def sources() -> Sequence[bytes]:
        encoded = _read_pickle(pngs)
        _check_length(pngs, len(encoded), count)
        return [_as_bytes(encoded[i]) for i in order.tolist()]

    files = [pngs, folder / f"{split}_labels.pkl"]  # the labels fix the order
    return cached_decode(
        _NAME, folder, files, sources, size=84, key=split, cache_dir=cache_dir, workers=workers
    )


def _check_length(path: Path, found: int, expected: int) -> None:
    if found != expected:
        raise ValueError(
            f"{path} holds {found} images but its labels file {expected}; the files come from "
            "different releases: re-extract both"
        )


def _as_bytes(item: Any) -> bytes:
    """One encoded PNG as bytes (stored as bytes, a uint8 array, or a latin-1 string)."""
    if isinstance(item, np.ndarray):
        return item.tobytes()
    if isinstance(item, str):
        return item.encode("latin1")
    return bytes(item)
