"""One entry point to every image data set: load a split by name, or its three samplers.

Typical use (an experiment's ``--dataset`` is one of `IMAGE_SET_NAMES`)::

    from metalearn.data import image_set_samplers, load_image_set

    test = load_image_set("mini-imagenet", "/data/mini-imagenet", "test")
    samplers = image_set_samplers("cifar-fs", "/data", ways=5, shots=1, queries=15, augment=True)
    tasks = samplers["train"].batch(4, torch.Generator().manual_seed(0))

The training sampler augments when asked (each set's standard augmentation,
`metalearn.data.augment.standard_augmentation`); the validation and test samplers never do.
Omniglot keeps its own split and rotations (`omniglot_samplers`, MAML's split).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from metalearn.data.augment import standard_augmentation
from metalearn.data.cifar import load_cifar_fs, load_fc100
from metalearn.data.cub import load_cub
from metalearn.data.image_folder import load_image_folder
from metalearn.data.image_set import IMAGE_SPLITS, ImageSet, check_split
from metalearn.data.mini_imagenet import load_mini_imagenet
from metalearn.data.omniglot import load_omniglot, omniglot_samplers, omniglot_splits
from metalearn.data.sampler import EpisodicSampler
from metalearn.data.tiered_imagenet import load_tiered_imagenet

__all__ = ["IMAGE_SETS", "IMAGE_SET_NAMES", "ImageSetEntry", "image_set_samplers", "load_image_set"]


@dataclass(frozen=True)
class ImageSetEntry:
    """How to load one data set's split and how its training images are augmented."""

    load: Callable[..., ImageSet]
    augmentation: str
    padding: int = 8


def _load_omniglot(root: str | os.PathLike | None, split: str, **options) -> ImageSet:
    """Omniglot's characters of MAML's split (1100 / 100 / 423), without rotations."""
    data = load_omniglot(root, download=False, progress=False, **options)
    index = omniglot_splits(data, "maml")[split]
    images = data.images[index].unsqueeze(2).flatten(0, 1)  # [C * 20, 1, 28, 28]
    counts = torch.full((len(index),), data.images.shape[1], dtype=torch.long)
    names = tuple(data.characters[i] for i in index.tolist())
    return ImageSet(images, counts, names, "omniglot", split, data.fingerprint)


IMAGE_SETS: Mapping[str, ImageSetEntry] = {
    "mini-imagenet": ImageSetEntry(load_mini_imagenet, "pad-crop"),
    "tiered-imagenet": ImageSetEntry(load_tiered_imagenet, "pad-crop"),
    "cifar-fs": ImageSetEntry(load_cifar_fs, "pad-crop", padding=4),
    "fc100": ImageSetEntry(load_fc100, "pad-crop", padding=4),
    "cub": ImageSetEntry(load_cub, "resized-crop"),
    "folder": ImageSetEntry(load_image_folder, "resized-crop"),
    "omniglot": ImageSetEntry(_load_omniglot, "character"),
}
IMAGE_SET_NAMES = tuple(IMAGE_SETS)


def _entry(name: str) -> ImageSetEntry:
    if name not in IMAGE_SETS:
        raise ValueError(f"dataset {name!r}; choose one of {', '.join(IMAGE_SET_NAMES)}")
    return IMAGE_SETS[name]


def load_image_set(name: str, root: str | os.PathLike, split: str, **options) -> ImageSet:
    """One split of a data set by name (``options`` go to its loader, e.g. ``cache_dir``).

    Raises:
        ValueError: an unknown name or split, or what the loader refuses.
        FileNotFoundError: the data is not at ``root`` (the message says what goes where).
    """
    return _entry(name).load(root, check_split(split), **options)


def image_set_samplers(
    name: str,
    root: str | os.PathLike,
    *,
    ways: int,
    shots: int,
    queries: int,
    augment: bool = False,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    **options,
) -> dict[str, EpisodicSampler]:
    """An `EpisodicSampler` per split, like `omniglot_samplers`.

    Args:
        name: one of `IMAGE_SET_NAMES`.
        root: the data set's folder (see docs/datasets.md for each layout).
        ways, shots, queries: N, K, Q of every task.
        augment: give the training sampler the set's standard augmentation.
        dtype, device: of the task images (resident on ``device``).
        options: for the loader (``cache_dir``, ``image_size``, ...).

    Returns:
        ``{"train": ..., "val": ..., "test": ...}``.
    """
    entry = _entry(name)
    augmentation = standard_augmentation(entry.augmentation, padding=entry.padding)
    if name == "omniglot":
        data = load_omniglot(root, download=False, progress=False, **options)
        samplers = omniglot_samplers(
            data, "maml", ways=ways, shots=shots, queries=queries, dtype=dtype, device=device
        )
        samplers["train"].augment = augmentation if augment else None
        return samplers
    return {
        split: entry.load(root, split, **options).sampler(
            ways=ways,
            shots=shots,
            queries=queries,
            augment=augmentation if augment and split == "train" else None,
            dtype=dtype,
            device=device,
        )
        for split in IMAGE_SPLITS
    }
