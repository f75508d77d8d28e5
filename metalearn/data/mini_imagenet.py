"""mini-ImageNet (Vinyals et al., 2016) with Ravi and Larochelle's (2017) class split.

100 ImageNet classes of 600 images, 84x84 colour: 64 classes train, 16 validate, 20 test.
Four layouts are read, the first the root holds (see docs/datasets.md):

* Ren et al.'s and learn2learn's pickles: ``mini-imagenet-cache-{split}.pkl``, the
  validation split named ``-val.pkl`` (Ren et al.'s ``mini-imagenet.tar.gz``, which
  torchmeta downloads) or ``-validation.pkl`` (learn2learn's): a dict with ``image_data``
  (uint8 ``[N, 84, 84, 3]``) and ``class_dict`` (wnid -> list of rows of ``image_data``).
* MetaOptNet's (Gidaris and Komodakis's) pickles:
  ``miniImageNet_category_split_{train_phase_train,val,test}.pickle``: a dict with ``data``
  (uint8 ``[N, 84, 84, 3]``), ``labels`` (one integer per image) and ``catname2label``
  (wnid -> label).
* torchmeta's HDF5 files, in the root or ``miniimagenet/``: ``{split}_data.hdf5`` with one
  dataset per class under ``datasets/`` (uint8 ``[n, 84, 84, 3]``) and ``{split}_labels.json``
  listing the classes (needs h5py: ``pip install metalearn[h5]``).
* Ravi and Larochelle's: ``images/<file>.jpg`` with ``train.csv``, ``val.csv`` and
  ``test.csv`` beside it, each a header line then ``filename,label`` rows (``label`` the
  ImageNet wnid). The JPEGs are decoded once to ``image_size`` squares and cached.

The arrays are used as they are (84x84 only), after the checks of `metalearn.data.checks`.
Pickles are read by `metalearn.data.safe_pickle.load_pickle` (no code runs from them).
Classes come out sorted by wnid in every layout, images in file order within a class, so
the layouts of the same data give the same `ImageSet`.
"""

from __future__ import annotations

import csv
import io
import os
from pathlib import Path

import numpy as np
import torch

from metalearn.data.checks import class_rows, image_array, integer_labels
from metalearn.data.hdf5 import class_arrays, class_names
from metalearn.data.image_set import (
    ImageSet,
    check_split,
    check_split_classes,
    image_set_from_files,
    warn_on_counts,
)
from metalearn.data.safe_pickle import load_pickle
from metalearn.files import read_bytes

__all__ = [
    "MINI_IMAGENET_CLASSES",
    "MINI_IMAGENET_IMAGES_PER_CLASS",
    "MINI_IMAGENET_METAOPTNET",
    "MINI_IMAGENET_PICKLES",
    "load_mini_imagenet",
]

MINI_IMAGENET_CLASSES = {"train": 64, "val": 16, "test": 20}
MINI_IMAGENET_IMAGES_PER_CLASS = 600
# The cache pickles' names per split: Ren et al.'s spell validation "val", learn2learn's
# "validation"; the first found is read.
MINI_IMAGENET_PICKLES = {
    "train": ("mini-imagenet-cache-train.pkl",),
    "val": ("mini-imagenet-cache-val.pkl", "mini-imagenet-cache-validation.pkl"),
    "test": ("mini-imagenet-cache-test.pkl",),
}
# MetaOptNet's pickles: the training classes' 600 images each are "train_phase_train" (the
# "train_phase_val" and "train_phase_test" files hold other images of the same classes).
MINI_IMAGENET_METAOPTNET = {
    split: tuple(f"miniImageNet_category_split_{part}.{ext}" for ext in ("pickle", "pkl"))
    for split, part in (("train", "train_phase_train"), ("val", "val"), ("test", "test"))
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
    """One split of mini-ImageNet as uint8 ``[N, 3, S, S]``, from any of the layouts.

    Args:
        root: the folder holding the pickles, the HDF5 files or ``images/`` and the csvs.
        split: ``"train"`` (64 classes), ``"val"`` (16) or ``"test"`` (20).
        image_size: side of the decoded images (the pickles and HDF5 files hold 84 only).
        cache_dir: for the decoded JPEGs (default: `default_cache_dir`).
        workers: decoding processes (see `cached_decode`).

    Raises:
        FileNotFoundError: no layout is there (the message says which files go where).
        ValueError: a split with other than the published number of classes, a file that
            breaks its format (named: a refused pickle, rows out of range or listed twice,
            an empty class, images of another dtype or size), a row naming a missing image,
            or an image that cannot be decoded.
        ImportError: an HDF5 layout without h5py installed.

    Warns:
        UserWarning: a class without the published 600 images.
    """
    root = Path(root)
    check_split(split)
    found = _find(root, split)
    if found is None:
        raise FileNotFoundError(_how_to_get(root, split))
    kind, path = found
    if kind != "csv" and image_size != 84:
        raise ValueError(
            f"{path.name} holds 84x84 images; use image_size=84, or the images/ + csv "
            "layout for other sizes"
        )
    if kind == "cache":
        image_set = _from_cache_pickle(path, split)
    elif kind == "metaoptnet":
        image_set = _from_metaoptnet(path, split)
    elif kind == "hdf5":
        image_set = _from_hdf5(path, split)
    else:
        image_set = _from_csv(root, path, split, image_size, cache_dir, workers)
    check_split_classes(
        _NAME, split, image_set.num_classes, MINI_IMAGENET_CLASSES[split], path.name
    )
    warn_on_counts(image_set, MINI_IMAGENET_IMAGES_PER_CLASS)
    return image_set


def _find(root: Path, split: str) -> tuple[str, Path] | None:
    """The first layout ``root`` holds for ``split``: its kind and the file that names it."""
    candidates = [
        *(("cache", root / name) for name in MINI_IMAGENET_PICKLES[split]),
        *(("metaoptnet", root / name) for name in MINI_IMAGENET_METAOPTNET[split]),
        *(("hdf5", folder / f"{split}_data.hdf5") for folder in (root, root / "miniimagenet")),
    ]
    for kind, path in candidates:
        if path.is_file():
            return kind, path
    if (root / f"{split}.csv").is_file() and (root / "images").is_dir():
        return "csv", root / f"{split}.csv"
    return None


def _how_to_get(root: Path, split: str) -> str:
    return (
        f"mini-ImageNet's {split} split was not found at {root}: put one of "
        f"{' or '.join(MINI_IMAGENET_PICKLES[split])} (Ren et al.'s or learn2learn's pickles), "
        f"{MINI_IMAGENET_METAOPTNET[split][0]} (MetaOptNet's), {split}_data.hdf5 with "
        f"{split}_labels.json (torchmeta's), or images/ with train.csv, val.csv and test.csv "
        "(Ravi and Larochelle's split, github.com/twitter/meta-learning-lstm, images from "
        "image-net.org) in that folder; see docs/datasets.md"
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
    text = read_bytes(listing, limit=64 << 20, what="split file").decode("utf-8", "replace")
    rows = list(csv.reader(io.StringIO(text, newline="")))
    if not rows or [c.strip() for c in rows[0]] != ["filename", "label"]:
        raise ValueError(f"{listing} must start with the header line filename,label")
    seen: dict[str, int] = {}
    for number, row in enumerate(rows[1:], start=2):
        if len(row) != 2:
            raise ValueError(f"{listing} line {number}: expected filename,label, got {row}")
        filename, label = (cell.strip() for cell in row)
        if filename in seen:
            raise ValueError(
                f"{listing} line {number} repeats images/{filename} (line {seen[filename]}): "
                "one image would count twice; re-download the csv files"
            )
        seen[filename] = number
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


def _from_cache_pickle(path: Path, split: str) -> ImageSet:
    """Ren et al.'s / learn2learn's dict: ``image_data [N, 84, 84, 3]``, ``class_dict``."""
    cache = load_pickle(path)
    if not isinstance(cache, dict) or not {"image_data", "class_dict"} <= set(cache):
        raise ValueError(
            f"{path} is not a mini-ImageNet cache: expected a dict with image_data and "
            "class_dict; re-download it"
        )
    data = image_array(path, cache["image_data"], 84, "image_data")
    names, rows = class_rows(path, cache["class_dict"], len(data))
    order = torch.from_numpy(np.concatenate(rows))
    images = torch.from_numpy(data).permute(0, 3, 1, 2)[order].contiguous()
    counts = torch.tensor([len(r) for r in rows], dtype=torch.long)
    return ImageSet(images, counts, tuple(names), _NAME, split)


def _from_metaoptnet(path: Path, split: str) -> ImageSet:
    """MetaOptNet's dict: ``data [N, 84, 84, 3]``, ``labels [N]``, ``catname2label``."""
    archive = load_pickle(path)
    if not isinstance(archive, dict) or not {"data", "labels"} <= set(archive):
        raise ValueError(
            f"{path} is not one of MetaOptNet's mini-ImageNet pickles: expected a dict with "
            "data, labels and catname2label; re-download it"
        )
    data = image_array(path, archive["data"], 84, "data")
    labels = integer_labels(path, archive["labels"], "labels", len(data))
    ids = sorted(set(labels.tolist()))
    names = _label_names(path, archive.get("catname2label"), ids)
    order = sorted(range(len(ids)), key=lambda i: names[i])  # classes by wnid, as elsewhere
    position = {ids[i]: rank for rank, i in enumerate(order)}
    relabel = torch.tensor([position[label] for label in labels.tolist()])
    pixels = torch.from_numpy(data).permute(0, 3, 1, 2)
    return ImageSet.from_labels(pixels, relabel, [names[i] for i in order], name=_NAME, split=split)


def _label_names(path: Path, catname2label: object, ids: list[int]) -> list[str]:
    """The wnid of each label in ``ids`` from ``catname2label`` (``"label i"`` without it)."""
    if catname2label is None:
        return [f"label {i}" for i in ids]
    if not isinstance(catname2label, dict) or not all(
        isinstance(k, str) and isinstance(v, int | np.integer) and not isinstance(v, bool)
        for k, v in catname2label.items()
    ):
        raise ValueError(f"{path}: catname2label must map class names to integer labels; "
                         "re-download it")  # fmt: skip
    by_label: dict[int, str] = {}
    for name, label in ((k, int(v)) for k, v in catname2label.items()):
        if label in by_label:
            raise ValueError(
                f"{path}: catname2label gives label {label} to both {by_label[label]!r} and "
                f"{name!r}; re-download it"
            )
        by_label[label] = name
    if missing := [i for i in ids if i not in by_label]:
        raise ValueError(
            f"{path}: labels holds {missing[0]}, which catname2label does not name; re-download it"
        )
    return [by_label[i] for i in ids]


def _from_hdf5(path: Path, split: str) -> ImageSet:
    """torchmeta's ``{split}_data.hdf5`` (``datasets/<wnid>``) and ``{split}_labels.json``."""
    listing = path.with_name(f"{split}_labels.json")
    if not listing.is_file():
        raise FileNotFoundError(f"{listing} is missing beside {path.name}; torchmeta writes both")
    names = sorted(class_names(listing))
    arrays, _ = class_arrays(path, "datasets", names, 84)
    images = torch.from_numpy(np.concatenate(arrays)).permute(0, 3, 1, 2).contiguous()
    counts = torch.tensor([len(a) for a in arrays], dtype=torch.long)
    return ImageSet(images, counts, tuple(names), _NAME, split)
