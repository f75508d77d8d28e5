"""CIFAR-FS (Bertinetto et al., 2019) and FC100 (Oreshkin et al., 2018) from CIFAR-100.

Both use all 600 images (500 train + 100 test) of each CIFAR-100 class, 32x32 colour, and
split the 100 classes for meta-learning:

* CIFAR-FS: 64 / 16 / 20 classes chosen at random (the lists of R2-D2's
  ``splits/bertinetto/{train,val,test}.txt``, written out below);
* FC100: by super-class, so that no super-class spans two splits: 12 / 4 / 4 super-classes,
  60 / 20 / 20 classes (the split of TADAM's supplementary material, as MetaOptNet and
  learn2learn use it).

The layout read is CIFAR-100's own python release, extracted (``cifar-100-python.tar.gz``
from https://www.cs.toronto.edu/~kriz/cifar.html): ``cifar-100-python/{train,test,meta}``,
in the root or the root itself. Classes come out in CIFAR-100's label order (alphabetical).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import torch

from metalearn.data.image_set import ImageSet, check_split, check_split_classes, warn_on_counts

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


def load_cifar_fs(root: str | os.PathLike, split: str) -> ImageSet:
    """One split of CIFAR-FS (64 / 16 / 20 classes) as uint8 ``[N, 3, 32, 32]``.

    Raises:
        FileNotFoundError: CIFAR-100's python files are missing (the message names them).
        ValueError: the release lacks a class of the split, or the split's class count is
            not the published one.
    """
    check_split(split)
    return _load("cifar-fs", Path(root), split, lambda fine, _: fine in CIFAR_FS_CLASSES[split])


def load_fc100(root: str | os.PathLike, split: str) -> ImageSet:
    """One split of FC100 (12 / 4 / 4 super-classes, 60 / 20 / 20 classes) as uint8.

    Raises:
        FileNotFoundError: CIFAR-100's python files are missing (the message names them).
        ValueError: the release lacks a super-class of the split, or the split's class
            count is not the published one.
    """
    check_split(split)
    return _load("fc100", Path(root), split, lambda _, coarse: coarse in FC100_SUPERCLASSES[split])


def _load(name: str, root: Path, split: str, keep) -> ImageSet:
    folder = _folder(root)
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


def _folder(root: Path) -> Path:
    for candidate in (root / "cifar-100-python", root):
        if all((candidate / part).is_file() for part in ("train", "test", "meta")):
            return candidate
    raise FileNotFoundError(
        f"CIFAR-100 was not found at {root}: extract cifar-100-python.tar.gz "
        "(https://www.cs.toronto.edu/~kriz/cifar.html) there, so that "
        "cifar-100-python/train, cifar-100-python/test and cifar-100-python/meta exist; "
        "see docs/datasets.md"
    )


def _unpickle(path: Path) -> dict:
    with open(path, "rb") as f:
        return pickle.load(f, encoding="bytes")  # CIFAR's published format; trusted files only
