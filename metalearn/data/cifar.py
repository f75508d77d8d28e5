"""CIFAR-FS (Bertinetto et al., 2019) and FC100 (Oreshkin et al., 2018) from CIFAR-100.

Both use all 600 images (500 train + 100 test) of each CIFAR-100 class, 32x32 colour, and
split the 100 classes for meta-learning:

* CIFAR-FS: 64 / 16 / 20 classes chosen at random (the lists of R2-D2's
  ``splits/bertinetto/{train,val,test}.txt``, written out below);
* FC100: by super-class, so that no super-class spans two splits: 12 / 4 / 4 super-classes,
  60 / 20 / 20 classes (the split of TADAM's supplementary material, as MetaOptNet and
  learn2learn use it).

Both read, the first the root holds (docs/datasets.md has the file names):

* CIFAR-100's own python release, extracted (``cifar-100-python.tar.gz`` from
  https://www.cs.toronto.edu/~kriz/cifar.html): ``cifar-100-python/{train,test,meta}``, in
  the root or the root itself;
* for CIFAR-FS, R2-D2's release (PNG folders and split lists, the one learn2learn reads);
* torchmeta's HDF5 conversion of CIFAR-100: ``cifar100/data.hdf5`` (a group per super-class,
  a uint8 ``[600, 32, 32, 3]`` dataset per class), with ``cifar100/cifar-fs/`` or
  ``cifar100/fc100/{split}_labels.json`` (needs h5py: ``pip install metalearn[h5]``);
* MetaOptNet's pickles, ``CIFAR_FS_{split}.pickle`` and ``FC100_{split}.pickle`` (the FC100
  ones learn2learn reads): ``data`` uint8 ``[N, 32, 32, 3]`` and ``labels``; they hold no
  class names, so classes are named by their label ids (``"label 3"``).

From the first three, classes come out in CIFAR-100's label order (alphabetical) with their
images in the release's order (train batch, then test batch), so they give the same set;
each is checked against the split written below, class by class. Pickles are read by
`metalearn.data.safe_pickle.load_pickle` (no code runs from them).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from metalearn.data.checks import image_array, integer_labels
from metalearn.data.hdf5 import class_arrays, read_json_list
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
    "CIFAR100_SUPERCLASSES",
    "CIFAR_FS_CLASSES",
    "FC100_SUPERCLASSES",
    "load_cifar_fs",
    "load_fc100",
    "split_classes",
]

# CIFAR-100's 20 super-classes and their 5 classes each, as in the release's meta file.
CIFAR100_SUPERCLASSES = {
    "aquatic_mammals": ("beaver", "dolphin", "otter", "seal", "whale"),
    "fish": ("aquarium_fish", "flatfish", "ray", "shark", "trout"),
    "flowers": ("orchid", "poppy", "rose", "sunflower", "tulip"),
    "food_containers": ("bottle", "bowl", "can", "cup", "plate"),
    "fruit_and_vegetables": ("apple", "mushroom", "orange", "pear", "sweet_pepper"),
    "household_electrical_devices": ("clock", "keyboard", "lamp", "telephone", "television"),
    "household_furniture": ("bed", "chair", "couch", "table", "wardrobe"),
    "insects": ("bee", "beetle", "butterfly", "caterpillar", "cockroach"),
    "large_carnivores": ("bear", "leopard", "lion", "tiger", "wolf"),
    "large_man-made_outdoor_things": ("bridge", "castle", "house", "road", "skyscraper"),
    "large_natural_outdoor_scenes": ("cloud", "forest", "mountain", "plain", "sea"),
    "large_omnivores_and_herbivores": ("camel", "cattle", "chimpanzee", "elephant", "kangaroo"),
    "medium_mammals": ("fox", "porcupine", "possum", "raccoon", "skunk"),
    "non-insect_invertebrates": ("crab", "lobster", "snail", "spider", "worm"),
    "people": ("baby", "boy", "girl", "man", "woman"),
    "reptiles": ("crocodile", "dinosaur", "lizard", "snake", "turtle"),
    "small_mammals": ("hamster", "mouse", "rabbit", "shrew", "squirrel"),
    "trees": ("maple_tree", "oak_tree", "palm_tree", "pine_tree", "willow_tree"),
    "vehicles_1": ("bicycle", "bus", "motorcycle", "pickup_truck", "train"),
    "vehicles_2": ("lawn_mower", "rocket", "streetcar", "tank", "tractor"),
}

_CIFAR_FS_VAL = (
    "beaver", "otter", "flatfish", "shark", "lamp", "television", "beetle", "butterfly",
    "sea", "camel", "cattle", "crab", "crocodile", "maple_tree", "motorcycle", "tractor",
)  # fmt: skip
_CIFAR_FS_TEST = (
    "whale", "poppy", "rose", "sweet_pepper", "telephone", "bed", "table", "wardrobe",
    "leopard", "plain", "chimpanzee", "fox", "snail", "worm", "baby", "man", "woman",
    "bicycle", "pickup_truck", "rocket",
)  # fmt: skip
_ALL_CLASSES = tuple(sorted(c for cs in CIFAR100_SUPERCLASSES.values() for c in cs))
CIFAR_FS_CLASSES = {
    "train": tuple(c for c in _ALL_CLASSES if c not in {*_CIFAR_FS_VAL, *_CIFAR_FS_TEST}),
    "val": tuple(sorted(_CIFAR_FS_VAL)),
    "test": tuple(sorted(_CIFAR_FS_TEST)),
}
FC100_SUPERCLASSES = {
    "train": (
        "fish", "flowers", "food_containers", "fruit_and_vegetables",
        "household_electrical_devices", "household_furniture",
        "large_man-made_outdoor_things", "large_natural_outdoor_scenes", "reptiles", "trees",
        "vehicles_1", "vehicles_2",
    ),
    "val": (
        "large_carnivores", "large_omnivores_and_herbivores", "non-insect_invertebrates",
        "small_mammals",
    ),
    "test": ("aquatic_mammals", "insects", "medium_mammals", "people"),
}  # fmt: skip
_PUBLISHED_CLASSES = {"cifar-fs": (64, 16, 20), "fc100": (60, 20, 20)}
_IMAGES_PER_CLASS = 600
_SUPERCLASS_OF = {fine: coarse for coarse, fs in CIFAR100_SUPERCLASSES.items() for fine in fs}
_FIX = "the file is not the published one: re-download it (docs/datasets.md)"


def split_classes(name: str, split: str) -> tuple[str, ...]:
    """The CIFAR-100 classes of a split of ``"cifar-fs"`` or ``"fc100"``, sorted."""
    if name == "cifar-fs":
        return CIFAR_FS_CLASSES[split]
    return tuple(sorted(c for s in FC100_SUPERCLASSES[split] for c in CIFAR100_SUPERCLASSES[s]))


def load_cifar_fs(
    root: str | os.PathLike,
    split: str,
    *,
    cache_dir: str | os.PathLike | None = None,
    workers: int | None = None,
) -> ImageSet:
    """One split of CIFAR-FS (64 / 16 / 20 classes) as uint8 ``[N, 3, 32, 32]``.

    Reads CIFAR-100's python release, else R2-D2's release (the one learn2learn reads):
    ``cifar100/data/<class>/*.png`` with ``cifar100/splits/bertinetto/{split}.txt``, in the
    root or in ``cifarfs/`` inside it (32x32 PNGs decoded once and cached), else torchmeta's
    ``cifar100/data.hdf5``, else MetaOptNet's ``CIFAR_FS_{split}.pickle``.

    Raises:
        FileNotFoundError: no release is there (the message names the files).
        ValueError: the release lacks a class of the split, its split list differs from the
            published one, the split's class count is not the published one, or a file
            breaks its format (named).
        ImportError: the HDF5 layout without h5py installed.
    """
    check_split(split)
    root = Path(root)
    if (folder := _cifar100_folder(root)) is not None:
        return _load("cifar-fs", folder, split)
    for candidate in (root, root / "cifarfs"):
        if (candidate / "cifar100" / "splits" / "bertinetto").is_dir():
            return _from_r2d2(candidate / "cifar100", split, cache_dir, workers)
    if (folder := _torchmeta_folder(root)) is not None:
        return _from_hdf5("cifar-fs", folder, split)
    if (pickled := root / f"CIFAR_FS_{split}.pickle").is_file():
        return _from_metaoptnet("cifar-fs", pickled, split)
    raise FileNotFoundError(
        _how_to_get(
            root,
            "cifar100/data/<class>/*.png with cifar100/splits/bertinetto/"
            f"{split}.txt (R2-D2's release, github.com/bertinetto/r2d2), cifar100/data.hdf5 "
            f"(torchmeta's), or CIFAR_FS_{split}.pickle (MetaOptNet's)",
        )
    )


def load_fc100(root: str | os.PathLike, split: str) -> ImageSet:
    """One split of FC100 (12 / 4 / 4 super-classes, 60 / 20 / 20 classes) as uint8.

    Reads CIFAR-100's python release, else torchmeta's ``cifar100/data.hdf5``, else
    MetaOptNet's ``FC100_{split}.pickle`` (the files learn2learn reads: ``data`` uint8
    ``[N, 32, 32, 3]`` and ``labels``; classes are then named by their label ids).

    Raises:
        FileNotFoundError: no release is there (the message names the files).
        ValueError: the release lacks a class of the split, the split's class count is not
            the published one, or a file breaks its format (named).
        ImportError: the HDF5 layout without h5py installed.
    """
    check_split(split)
    root = Path(root)
    if (folder := _cifar100_folder(root)) is not None:
        return _load("fc100", folder, split)
    if (folder := _torchmeta_folder(root)) is not None:
        return _from_hdf5("fc100", folder, split)
    if (pickled := root / f"FC100_{split}.pickle").is_file():
        return _from_metaoptnet("fc100", pickled, split)
    raise FileNotFoundError(
        _how_to_get(
            root,
            f"cifar100/data.hdf5 (torchmeta's), or FC100_{split}.pickle (MetaOptNet's release, "
            "github.com/kjunelee/MetaOptNet)",
        )
    )


def _from_r2d2(folder: Path, split: str, cache_dir, workers) -> ImageSet:
    """R2-D2's CIFAR-FS: the split's class list, then each class's PNGs (32x32)."""
    listing = folder / "splits" / "bertinetto" / f"{split}.txt"
    if not listing.is_file():
        raise FileNotFoundError(f"{listing} is missing; re-extract R2-D2's cifar100.zip")
    text = read_bytes(listing, limit=1 << 20, what="class list").decode("utf-8", "replace")
    names = sorted(line.strip() for line in text.splitlines() if line.strip())
    check_split_classes("cifar-fs", split, len(names), len(CIFAR_FS_CLASSES[split]), listing.name)
    if names != list(CIFAR_FS_CLASSES[split]):
        odd = sorted(set(names) ^ set(CIFAR_FS_CLASSES[split]))
        raise ValueError(
            f"{listing} differs from the published CIFAR-FS {split} split ({', '.join(odd[:5])}); "
            "re-download R2-D2's cifar100.zip"
        )
    classes = [(n, sorted((folder / "data" / n).glob("*.png"))) for n in names]
    image_set = image_set_from_files(
        "cifar-fs", split, folder, classes, size=32, cache_dir=cache_dir, workers=workers,
        exact=True,
    )  # fmt: skip
    warn_on_counts(image_set, _IMAGES_PER_CLASS)
    return image_set


def _from_metaoptnet(name: str, path: Path, split: str) -> ImageSet:
    """MetaOptNet's dict: ``data`` uint8 ``[N, 32, 32, 3]`` and ``labels [N]``."""
    archive = load_pickle(path)
    if not isinstance(archive, dict) or not {"data", "labels"} <= set(archive):
        raise ValueError(f"{path}: expected a dict with data and labels; {_FIX}")
    data = image_array(path, archive["data"], 32, "data")
    labels = integer_labels(path, archive["labels"], "labels", len(data))
    ids = sorted(set(labels.tolist()))
    published = _PUBLISHED_CLASSES[name][("train", "val", "test").index(split)]
    check_split_classes(name, split, len(ids), published, path.name)
    relabel = torch.from_numpy(np.searchsorted(ids, labels))
    pixels = torch.from_numpy(data).permute(0, 3, 1, 2)
    names = [f"label {i}" for i in ids]
    image_set = ImageSet.from_labels(pixels, relabel, names, name=name, split=split)
    warn_on_counts(image_set, _IMAGES_PER_CLASS)
    return image_set


def _from_hdf5(name: str, folder: Path, split: str) -> ImageSet:
    """torchmeta's ``data.hdf5`` (``<super-class>/<class>``), the split's classes only."""
    wanted = split_classes(name, split)
    listing = folder / name / f"{split}_labels.json"
    if listing.is_file():  # torchmeta's list of [super-class, class]: must be the published
        pairs = read_json_list(listing)
        if not all(isinstance(p, list) and [type(x) for x in p] == [str, str] for p in pairs):
            raise ValueError(f"{listing} must list [super-class, class] pairs; {_FIX}")
        if sorted(tuple(p) for p in pairs) != sorted((_SUPERCLASS_OF[c], c) for c in wanted):
            odd = sorted({str(p[1]) for p in pairs} ^ set(wanted))
            raise ValueError(
                f"{listing} differs from the published {name} {split} split "
                f"({', '.join(odd[:5]) or 'super-classes'}); {_FIX}"
            )
    path = folder / "data.hdf5"
    keys = [f"{_SUPERCLASS_OF[c]}/{c}" for c in wanted]
    arrays, _ = class_arrays(path, "", keys, 32)  # names from the root
    images = torch.from_numpy(np.concatenate(arrays)).permute(0, 3, 1, 2).contiguous()
    counts = torch.tensor([len(a) for a in arrays], dtype=torch.long)
    image_set = ImageSet(images, counts, wanted, name, split)
    warn_on_counts(image_set, _IMAGES_PER_CLASS)
    return image_set


def _load(name: str, folder: Path, split: str) -> ImageSet:
    """CIFAR-100's python release: the split's classes, train images then test images."""
    fine_names, coarse_names = _meta(folder / "meta")
    wanted = split_classes(name, split)
    if missing := [c for c in wanted if c not in fine_names]:
        raise ValueError(
            f"{folder / 'meta'} lacks {name} {split} classes {', '.join(missing[:5])}; it is "
            "not CIFAR-100's release: re-download cifar-100-python.tar.gz"
        )
    images, fine = [], []
    for part in ("train", "test"):
        pixels, labels = _batch(folder / part, fine_names, coarse_names)
        images.append(pixels)
        fine.append(labels)
    fine_all = np.concatenate(fine)
    classes = sorted({int(f) for f in np.unique(fine_all) if fine_names[f] in wanted})
    published = _PUBLISHED_CLASSES[name][("train", "val", "test").index(split)]
    check_split_classes(name, split, len(classes), published, f"{folder}")
    rows = np.isin(fine_all, classes)
    relabel = {label: i for i, label in enumerate(classes)}
    labels = torch.tensor([relabel[int(f)] for f in fine_all[rows]])
    pixels = torch.from_numpy(np.concatenate(images)[rows])
    image_set = ImageSet.from_labels(
        pixels, labels, [fine_names[c] for c in classes], name=name, split=split
    )
    warn_on_counts(image_set, _IMAGES_PER_CLASS)
    return image_set


def _meta(path: Path) -> tuple[list[str], list[str]]:
    """The 100 class and 20 super-class names of CIFAR-100's ``meta`` file."""
    meta = load_pickle(path, encoding="bytes")
    names = []
    for key, count in ((b"fine_label_names", 100), (b"coarse_label_names", 20)):
        found = meta.get(key) if isinstance(meta, dict) else None
        if not isinstance(found, list) or len(found) != count:
            raise ValueError(f"{path}: expected {key.decode()}, {count} names; {_FIX}")
        names.append([_text(n) for n in found])
    return names[0], names[1]


def _batch(
    path: Path, fine_names: list[str], coarse_names: list[str]
) -> tuple[np.ndarray, np.ndarray]:
    """One CIFAR-100 batch: uint8 ``[N, 3, 32, 32]`` and its class labels ``[N]``.

    Each image's super-class label must be its class's CIFAR-100 super-class: a file that
    says otherwise would move classes between FC100's splits.
    """
    batch = load_pickle(path, encoding="bytes")
    data = batch.get(b"data") if isinstance(batch, dict) else None
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or (
        data.shape[1] != 3072
    ):  # fmt: skip
        got = f"{data.dtype} {list(data.shape)}" if isinstance(data, np.ndarray) else "none"
        raise ValueError(f"{path}: data must be uint8 [N, 3072], got {got}; {_FIX}")
    fine = integer_labels(path, batch.get(b"fine_labels"), "fine_labels", len(data))
    coarse = integer_labels(path, batch.get(b"coarse_labels"), "coarse_labels", len(data))
    if fine.max(initial=0) >= 100 or coarse.max(initial=0) >= 20:
        raise ValueError(
            f"{path}: labels beyond CIFAR-100's 100 classes / 20 super-classes; {_FIX}"
        )
    for f, c in np.unique(np.stack([fine, coarse]), axis=1).T.tolist():
        if _SUPERCLASS_OF.get(fine_names[f]) not in (None, coarse_names[c]):
            raise ValueError(
                f"{path}: images of {fine_names[f]!r} are labelled super-class "
                f"{coarse_names[c]!r}, CIFAR-100 has it under {_SUPERCLASS_OF[fine_names[f]]!r}; "
                f"{_FIX}"
            )
    return data.reshape(-1, 3, 32, 32), fine


def _text(name: Any) -> str:
    return name.decode("latin1") if isinstance(name, bytes) else str(name)


def _cifar100_folder(root: Path) -> Path | None:
    for candidate in (root / "cifar-100-python", root):
        if all((candidate / part).is_file() for part in ("train", "test", "meta")):
            return candidate
    return None


def _torchmeta_folder(root: Path) -> Path | None:
    for candidate in (root / "cifar100", root):
        if (candidate / "data.hdf5").is_file():
            return candidate
    return None


def _how_to_get(root: Path, alternatives: str) -> str:
    return (
        f"CIFAR-100 was not found at {root}: extract cifar-100-python.tar.gz "
        "(https://www.cs.toronto.edu/~kriz/cifar.html) there, so that "
        "cifar-100-python/train, cifar-100-python/test and cifar-100-python/meta exist, "
        f"or put {alternatives} there; see docs/datasets.md"
    )
