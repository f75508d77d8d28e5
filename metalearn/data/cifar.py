"""CIFAR-FS (Bertinetto et al., 2019) and FC100 (Oreshkin et al., 2018) from CIFAR-100.

Both use all 600 images (500 train + 100 test) of each CIFAR-100 class, 32x32 colour, and
split the 100 classes for meta-learning:

* CIFAR-FS: 64 / 16 / 20 classes chosen at random (the lists of R2-D2's
  ``splits/bertinetto/{train,val,test}.txt``, written out below);
* FC100: by super-class, so that no super-class spans two splits: 12 / 4 / 4 super-classes,
  60 / 20 / 20 classes (the split of TADAM's supplementary material, as MetaOptNet and
  learn2learn use it).

Both read CIFAR-100's own python release, extracted (``cifar-100-python.tar.gz`` from
https://www.cs.toronto.edu/~kriz/cifar.html): ``cifar-100-python/{train,test,meta}``, in the
root or the root itself; classes then come out in CIFAR-100's label order (alphabetical).
Failing that, CIFAR-FS reads R2-D2's release (PNG folders and split lists) and FC100
MetaOptNet's pickles, the files learn2learn reads.
"""

from __future__ import annotations

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
    "CIFAR100_SUPERCLASSES",
    "CIFAR_FS_CLASSES",
    "FC100_SUPERCLASSES",
    "load_cifar_fs",
    "load_fc100",
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
    root or in ``cifarfs/`` inside it (PNGs decoded once and cached).

    Raises:
        FileNotFoundError: neither release is there (the message names the files).
        ValueError: the release lacks a class of the split, its split list differs from the
            published one, or the split's class count is not the published one.
    """
    check_split(split)
    root = Path(root)
    if (folder := _cifar100_folder(root)) is not None:
        keep = lambda fine, _: fine in CIFAR_FS_CLASSES[split]  # noqa: E731
        return _load("cifar-fs", folder, split, keep)
    for candidate in (root, root / "cifarfs"):
        if (candidate / "cifar100" / "splits" / "bertinetto").is_dir():
            return _from_r2d2(candidate / "cifar100", split, cache_dir, workers)
    raise FileNotFoundError(
        _how_to_get(
            root,
            "or cifar100/data/<class>/*.png with cifar100/splits/bertinetto/"
            f"{split}.txt (R2-D2's release, github.com/bertinetto/r2d2)",
        )
    )


def load_fc100(root: str | os.PathLike, split: str) -> ImageSet:
    """One split of FC100 (12 / 4 / 4 super-classes, 60 / 20 / 20 classes) as uint8.

    Reads CIFAR-100's python release, else MetaOptNet's ``FC100_{split}.pickle`` (the files
    learn2learn reads: ``data`` uint8 ``[N, 32, 32, 3]`` and ``labels``; classes are then
    named by their label ids).

    Raises:
        FileNotFoundError: neither release is there (the message names the files).
        ValueError: the release lacks a super-class of the split, or the split's class
            count is not the published one.
    """
    check_split(split)
    root = Path(root)
    if (folder := _cifar100_folder(root)) is not None:
        keep = lambda _, coarse: coarse in FC100_SUPERCLASSES[split]  # noqa: E731
        return _load("fc100", folder, split, keep)
    pickled = root / f"FC100_{split}.pickle"
    if pickled.is_file():
        return _from_fc100_pickle(pickled, split)
    raise FileNotFoundError(
        _how_to_get(
            root, f"or FC100_{split}.pickle (MetaOptNet's release, github.com/kjunelee/MetaOptNet)"
        )
    )


def _from_r2d2(folder: Path, split: str, cache_dir, workers) -> ImageSet:
    """R2-D2's CIFAR-FS: the split's class list, then each class's PNGs (32x32)."""
    listing = folder / "splits" / "bertinetto" / f"{split}.txt"
    if not listing.is_file():
        raise FileNotFoundError(f"{listing} is missing; re-extract R2-D2's cifar100.zip")
    names = sorted(line.strip() for line in listing.read_text().splitlines() if line.strip())
    check_split_classes("cifar-fs", split, len(names), len(CIFAR_FS_CLASSES[split]), listing.name)
    if names != list(CIFAR_FS_CLASSES[split]):
        odd = sorted(set(names) ^ set(CIFAR_FS_CLASSES[split]))
        raise ValueError(
            f"{listing} differs from the published CIFAR-FS {split} split ({', '.join(odd[:5])}); "
            "re-download R2-D2's cifar100.zip"
        )
    classes = [(n, sorted((folder / "data" / n).glob("*.png"))) for n in names]
    image_set = image_set_from_files(
        "cifar-fs", split, folder, classes, size=32, cache_dir=cache_dir, workers=workers
    )
    warn_on_counts(image_set, _IMAGES_PER_CLASS)
    return image_set


def _from_fc100_pickle(path: Path, split: str) -> ImageSet:
    with open(path, "rb") as f:
        archive = pickle.load(f, encoding="latin1")  # published as a pickle; trusted files only
    data = np.asarray(archive["data"], dtype=np.uint8)
    labels = np.asarray(archive["labels"], dtype=np.int64)
    if data.ndim != 4 or data.shape[1:] != (32, 32, 3) or len(labels) != len(data):
        raise ValueError(
            f"{path}: expected data uint8 [N, 32, 32, 3] and N labels, got {data.shape} and "
            f"{len(labels)}; re-download it"
        )
    ids = sorted(set(labels.tolist()))
    published = _PUBLISHED_CLASSES["fc100"][("train", "val", "test").index(split)]
    check_split_classes("fc100", split, len(ids), published, path.name)
    relabel = torch.from_numpy(np.searchsorted(ids, labels))
    pixels = torch.from_numpy(data).permute(0, 3, 1, 2)
    names = [f"label {i}" for i in ids]
    image_set = ImageSet.from_labels(pixels, relabel, names, name="fc100", split=split)
    warn_on_counts(image_set, _IMAGES_PER_CLASS)
    return image_set


def _load(name: str, folder: Path, split: str, keep) -> ImageSet:
    meta = _unpickle(folder / "meta")
    fine_names = [n.decode() for n in meta[b"fine_label_names"]]
    coarse_names = [n.decode() for n in meta[b"coarse_label_names"]]
    wanted = CIFAR_FS_CLASSES[split] if name == "cifar-fs" else FC100_SUPERCLASSES[split]
    known = fine_names if name == "cifar-fs" else coarse_names
    if missing := [c for c in wanted if c not in known]:
        raise ValueError(
            f"{folder / 'meta'} lacks {name} {split} classes {', '.join(missing[:5])}; it is "
            "not CIFAR-100's release: re-download cifar-100-python.tar.gz"
        )
    images, fine, coarse = [], [], []
    for part in ("train", "test"):
        batch = _unpickle(folder / part)
        images.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
        fine.append(np.asarray(batch[b"fine_labels"]))
        coarse.append(np.asarray(batch[b"coarse_labels"]))
    fine_all, coarse_all = np.concatenate(fine), np.concatenate(coarse)
    classes = sorted(
        {int(f) for f, c in zip(fine_all, coarse_all) if keep(fine_names[f], coarse_names[c])}
    )
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


def _cifar100_folder(root: Path) -> Path | None:
    for candidate in (root / "cifar-100-python", root):
        if all((candidate / part).is_file() for part in ("train", "test", "meta")):
            return candidate
    return None


def _how_to_get(root: Path, alternative: str) -> str:
    return (
        f"CIFAR-100 was not found at {root}: extract cifar-100-python.tar.gz "
        "(https://www.cs.toronto.edu/~kriz/cifar.html) there, so that "
        "cifar-100-python/train, cifar-100-python/test and cifar-100-python/meta exist, "
        f"{alternative}; see docs/datasets.md"
    )


def _unpickle(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f, encoding="bytes")  # CIFAR's published format; trusted files only
