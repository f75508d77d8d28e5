"""tiered-ImageNet (Ren et al., 2018): 608 ImageNet classes under 34 super-categories.

Train, validation and test hold 351, 97 and 160 classes from 20, 6 and 8 super-categories
(448,695, 124,261 and 206,209 images of 84x84), so no super-category spans two splits.
Two layouts are read (``split`` is ``train``, ``val`` or ``test``, as in the file names):

Ren et al.'s release (``tiered-imagenet.tar``, the one learn2learn reads), in the root or in
``tiered-imagenet/`` inside it:

* ``{split}_labels.pkl``: a dict with ``label_specific`` (class per image, ``[N]``),
  ``label_general`` (super-category per image) and, when present, ``label_specific_str``
  (class names, indexed by ``label_specific``);
* ``{split}_images_png.pkl``: a list of PNG-encoded 84x84 images (bytes or uint8 arrays),
  decoded once and cached (memory-mapped when read back: the training split is 9.5 GB
  decoded); or ``{split}_images.npz`` with an ``images`` array uint8 ``[N, 84, 84, 3]``.

torchmeta's HDF5 conversion of it, in the root or in ``tieredimagenet/`` inside it:
``{split}_data.hdf5`` with one dataset per class under ``datasets/`` (that class's PNGs, as
variable-length uint8 arrays; its super-category in the attribute ``label_general``) and
``{split}_labels.json`` listing the classes in label order (needs h5py:
``pip install metalearn[h5]``). Both layouts give the same `ImageSet`.

Pickles are read by `metalearn.data.safe_pickle.load_pickle` (no code runs from them).
"""

from __future__ import annotations

import bisect
import os
import warnings
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from metalearn.data.checks import image_array, integer_labels
from metalearn.data.hdf5 import class_names, encoded_classes, read_encoded
from metalearn.data.image_set import ImageSet, cached_decode, check_split, check_split_classes
from metalearn.data.safe_pickle import load_pickle
from metalearn.files import regular_file

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
_FIX = "the file is not the published one: re-download it (docs/datasets.md)"


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
        ValueError: other than the published numbers of classes or super-categories, a file
            that breaks its format (named: a refused pickle, labels that are not integers
            one per image, a class under two super-categories, images of another dtype or
            size), or an image that cannot be decoded.
        ImportError: the HDF5 layout without h5py installed.

    Warns:
        UserWarning: a split without the published number of images.
    """
    check_split(split)
    root = Path(root)
    for folder in (root, root / "tiered-imagenet"):
        if (folder / f"{split}_labels.pkl").is_file():
            return _from_ren(folder, split, cache_dir, workers)
    for folder in (root, root / "tieredimagenet"):
        if (folder / f"{split}_data.hdf5").is_file():
            return _from_hdf5(folder / f"{split}_data.hdf5", split, cache_dir, workers)
    raise FileNotFoundError(
        f"tiered-ImageNet's {split} split was not found at {root}: put {split}_labels.pkl and "
        f"{split}_images_png.pkl (or {split}_images.npz) there or in tiered-imagenet/ inside "
        "it, as extracted from tiered-imagenet.tar (Ren et al., "
        f"github.com/renmengye/few-shot-ssl-public), or torchmeta's {split}_data.hdf5 and "
        f"{split}_labels.json there or in tieredimagenet/; see docs/datasets.md"
    )


def _from_ren(folder: Path, split: str, cache_dir, workers) -> ImageSet:
    """Ren et al.'s labels pickle, then its images (PNG pickle or npz) in class order."""
    path = folder / f"{split}_labels.pkl"
    labels = load_pickle(path)
    if not isinstance(labels, dict):
        raise ValueError(
            f"{path}: expected a dict with label_specific and label_general, got "
            f"{type(labels).__name__}; {_FIX}"
        )
    specific = integer_labels(path, labels.get("label_specific"), "label_specific")
    general = integer_labels(path, labels.get("label_general"), "label_general", len(specific))
    if len(specific) == 0:
        raise ValueError(f"{path}: label_specific lists no images; {_FIX}")
    ids, counts = np.unique(specific, return_counts=True)
    _check_counts(split, len(ids), len(np.unique(general)), path.name)
    _one_super_each(path, specific, general, len(ids))
    names = _class_names(path, labels.get("label_specific_str"), ids.tolist())
    order = np.argsort(specific, kind="stable")  # class-major before decoding: no copy after
    images, fingerprint = _images(folder, split, order, len(specific), cache_dir, workers)
    # Labels are 0..C-1 in Ren et al.'s files; any other ids are renumbered in sorted order.
    return _image_set(images, counts.tolist(), names, split, fingerprint)


def _from_hdf5(path: Path, split: str, cache_dir, workers) -> ImageSet:
    """torchmeta's HDF5: each class's PNGs and super-category, classes as the json lists."""
    listing = path.with_name(f"{split}_labels.json")
    if not listing.is_file():
        raise FileNotFoundError(f"{listing} is missing beside {path.name}; torchmeta writes both")
    names = class_names(listing)
    counts, attributes = encoded_classes(path, "datasets", names)
    supers = []
    for name, attrs in zip(names, attributes):
        value = attrs.get("label_general")
        value = value.decode() if isinstance(value, bytes) else value
        if not isinstance(value, str) or not value:
            raise ValueError(f"{path}: datasets/{name} has no label_general attribute; {_FIX}")
        supers.append(value)
    _check_counts(split, len(names), len(set(supers)), listing.name)
    offsets = np.cumsum([0, *counts]).tolist()

    def describe(position: int) -> str:
        c = bisect.bisect_right(offsets, position) - 1
        return f"{path}: datasets/{names[c]}[{position - offsets[c]}]"

    images, fingerprint = cached_decode(
        _NAME, path.parent, [path, listing], lambda: read_encoded(path, "datasets", names),
        size=84, key=f"hdf5|{split}", cache_dir=cache_dir, workers=workers, exact=True,
        describe=describe,
    )  # fmt: skip
    return _image_set(images, counts, names, split, fingerprint)


def _one_super_each(path: Path, specific: np.ndarray, general: np.ndarray, classes: int) -> None:
    """Refuse a class with images under two super-categories (the hierarchy is a tree)."""
    pairs = np.unique(np.stack([specific, general]), axis=1)  # sorted by class, then super
    if pairs.shape[1] != classes:
        cls = int(pairs[0][np.flatnonzero(np.diff(pairs[0]) == 0)[0]])
        raise ValueError(
            f"{path}: class {cls} has images under two super-categories in label_general; {_FIX}"
        )


def _check_counts(split: str, classes: int, supers: int, source: str) -> None:
    check_split_classes(_NAME, split, classes, TIERED_IMAGENET_CLASSES[split], source)
    if supers != TIERED_IMAGENET_SUPERCLASSES[split]:
        raise ValueError(
            f"{_NAME} {split} split: {source} gives {supers} super-categories, the published "
            f"split has {TIERED_IMAGENET_SUPERCLASSES[split]}; re-download the files"
        )


def _image_set(
    images: torch.Tensor, counts: list[int], names: Sequence[str], split: str, fingerprint
) -> ImageSet:
    if len(images) != TIERED_IMAGENET_IMAGES[split]:
        warnings.warn(
            f"{_NAME} {split}: {len(images)} images, the published split has "
            f"{TIERED_IMAGENET_IMAGES[split]}; results will not be comparable to papers",
            stacklevel=4,
        )
    return ImageSet(images, torch.tensor(counts), tuple(names), _NAME, split, fingerprint)


def _class_names(path: Path, names: Any, ids: list[int]) -> list[str]:
    """``label_specific_str[i]`` for each id (``"class i"`` when the file has no names)."""
    if names is None or (isinstance(names, list | tuple) and len(names) <= max(ids)):
        return [f"class {i}" for i in ids]
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{path}: label_specific_str must be a list of class names; {_FIX}")
    return [names[i] for i in ids]


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
        data = image_array(npz, _npz_images(npz), 84, "images")
        _check_length(npz, len(data), count)
        return torch.from_numpy(data[order]).permute(0, 3, 1, 2).contiguous(), None
    if not pngs.is_file():
        raise FileNotFoundError(
            f"{pngs} (or {npz.name}) is missing beside {split}_labels.pkl; extract it from "
            "tiered-imagenet.tar"
        )

    def sources() -> Sequence[bytes]:
        encoded = load_pickle(pngs)
        if not isinstance(encoded, list | tuple):
            raise ValueError(f"{pngs}: expected a list of PNG-encoded images; {_FIX}")
        _check_length(pngs, len(encoded), count)
        return [_as_bytes(pngs, i, encoded[i]) for i in order.tolist()]

    def describe(position: int) -> str:
        return f"{pngs} image {int(order[position])}"

    files = [pngs, folder / f"{split}_labels.pkl"]  # the labels fix the order
    return cached_decode(
        _NAME, folder, files, sources, size=84, key=split, cache_dir=cache_dir,
        workers=workers, exact=True, describe=describe,
    )  # fmt: skip


def _npz_images(npz: Path) -> Any:
    """The ``images`` array of an npz (object arrays refused: they would need pickle)."""
    regular_file(npz, what="data file")  # a FIFO named like the npz: refused, not waited on
    try:
        with np.load(npz, allow_pickle=False) as archive:
            data = archive["images"] if "images" in archive.files else None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as err:  # numpy refuses pickles
        why = " ".join(str(err).split())
        raise ValueError(f"{npz} is not a readable npz of arrays ({why}); {_FIX}") from None
    if data is None:
        raise ValueError(f"{npz} holds no images array; {_FIX}")
    return data


def _check_length(path: Path, found: int, expected: int) -> None:
    if found != expected:
        raise ValueError(
            f"{path} holds {found} images but its labels file {expected}; the files come from "
            "different releases: re-extract both"
        )


def _as_bytes(path: Path, index: int, item: Any) -> bytes:
    """One encoded PNG as bytes (stored as bytes, a uint8 array, or a latin-1 string)."""
    if isinstance(item, np.ndarray) and item.dtype == np.uint8 and item.ndim <= 2:
        return item.tobytes()  # cv2.imencode's [n] or [n, 1]
    if isinstance(item, str):
        return item.encode("latin1")
    if isinstance(item, bytes | bytearray):
        return bytes(item)
    raise ValueError(
        f"{path} image {index} is a {type(item).__name__}, not PNG bytes (bytes or a uint8 "
        f"array); {_FIX}"
    )
