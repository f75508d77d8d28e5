"""One entry point to every image data set: load a split by name, or its three samplers.

Typical use (an experiment's ``--dataset`` is one of `IMAGE_SET_NAMES`)::

    from metalearn.data import image_set_samplers, load_image_set

    test = load_image_set("mini-imagenet", "/data/mini-imagenet", "test")
    samplers = image_set_samplers("cifar-fs", "/data", ways=5, shots=1, queries=15, augment=True)
    tasks = samplers["train"].batch(4, torch.Generator().manual_seed(0))

`image_set_samplers` is how an experiment's arguments become its samplers (training queries
for train, ``eval_queries`` for val and test), so a run and a later evaluation of its
checkpoint draw from the same samplers. The training sampler augments when asked (each
set's standard augmentation, `metalearn.data.augment.standard_augmentation`); the
validation and test samplers never do. Which image shapes a set can give is
`image_options`' decision alone. Omniglot keeps its own split and rotations
(`omniglot_samplers`; MAML's split unless told otherwise).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from metalearn.data.augment import standard_augmentation
from metalearn.data.cifar import load_cifar_fs, load_fc100
from metalearn.data.cub import load_cub
from metalearn.data.decoding import MAX_IMAGE_SIZE, OMNIGLOT_FORMAT, ImageFormat
from metalearn.data.image_folder import load_image_folder
from metalearn.data.image_set import IMAGE_SPLITS, ImageSet, check_split
from metalearn.data.mini_imagenet import load_mini_imagenet
from metalearn.data.omniglot import load_omniglot, omniglot_samplers, omniglot_splits
from metalearn.data.sampler import Augmentation, EpisodicSampler
from metalearn.data.tiered_imagenet import load_tiered_imagenet

__all__ = [
    "IMAGE_SETS",
    "IMAGE_SET_NAMES",
    "ImageSetEntry",
    "image_format",
    "image_options",
    "image_set_samplers",
    "image_shape",
    "load_image_set",
    "set_augmentation",
]


@dataclass(frozen=True)
class ImageSetEntry:
    """How to load one data set's split, the images it gives and how training ones are augmented.

    Attributes:
        load: ``load(root, split, **options) -> ImageSet``.
        augmentation: the set's standard augmentation (`standard_augmentation`'s kind).
        shape: ``(channels, side)`` of the images the loader gives by default.
        resizable: the loader decodes image files at any side (its ``image_size`` option);
            the others hold fixed arrays (pickles, npz, CIFAR batches).
        grayscale: the loader also reads the images as one channel (its ``channels`` option).
        padding: of the pad-crop augmentation.
        invert: the images are ink on paper, stored inverted (Omniglot).
    """

    load: Callable[..., ImageSet]
    augmentation: str
    shape: tuple[int, int]
    resizable: bool = False
    grayscale: bool = False
    padding: int = 8
    invert: bool = False


def _load_omniglot(root: str | os.PathLike | None, split: str, **options) -> ImageSet:
    """Omniglot's characters of MAML's split (1100 / 100 / 423), without rotations."""
    data = load_omniglot(root, download=False, progress=False, **options)
    index = omniglot_splits(data, "maml")[split]
    images = data.images[index].unsqueeze(2).flatten(0, 1)  # [C * 20, 1, 28, 28]
    counts = torch.full((len(index),), data.images.shape[1], dtype=torch.long)
    names = tuple(data.characters[i] for i in index.tolist())
    return ImageSet(images, counts, names, "omniglot", split, data.fingerprint)


IMAGE_SETS: Mapping[str, ImageSetEntry] = {
    "mini-imagenet": ImageSetEntry(load_mini_imagenet, "pad-crop", (3, 84), resizable=True),
    "tiered-imagenet": ImageSetEntry(load_tiered_imagenet, "pad-crop", (3, 84)),
    "cifar-fs": ImageSetEntry(load_cifar_fs, "pad-crop", (3, 32), padding=4),
    "fc100": ImageSetEntry(load_fc100, "pad-crop", (3, 32), padding=4),
    "cub": ImageSetEntry(load_cub, "resized-crop", (3, 84), resizable=True),
    "folder": ImageSetEntry(load_image_folder, "resized-crop", (3, 84), resizable=True,
                            grayscale=True),
    "omniglot": ImageSetEntry(_load_omniglot, "character",
                              (OMNIGLOT_FORMAT.channels, OMNIGLOT_FORMAT.size), resizable=True,
                              invert=OMNIGLOT_FORMAT.invert),
}  # fmt: skip
IMAGE_SET_NAMES = tuple(IMAGE_SETS)


def set_augmentation(name: str) -> Augmentation | None:
    """The standard training augmentation of data set ``name`` (`ImageSetEntry.augmentation`)."""
    entry = _entry(name)
    return standard_augmentation(entry.augmentation, padding=entry.padding)


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


def image_shape(name: str, image_size: int | None = None, channels: int | None = None
                ) -> tuple[int, int]:  # fmt: skip
    """``(channels, side)`` of the images: each one given, else the data set's default."""
    default_channels, side = _entry(name).shape
    return channels or default_channels, image_size or side


def image_format(name: str, image_size: int | None = None, channels: int | None = None
                 ) -> ImageFormat:  # fmt: skip
    """How data set ``name``'s images are decoded at that shape (None: the set's own).

    Raises:
        ValueError: an unknown name, or a shape the data set cannot give (`image_options`).
    """
    image_options(name, image_size, channels)
    channels, side = image_shape(name, image_size, channels)
    return ImageFormat(side, channels, invert=_entry(name).invert)


def image_options(name: str, image_size: int | None = None, channels: int | None = None
                  ) -> dict[str, int]:  # fmt: skip
    """The loader options that give images of ``image_size`` and ``channels`` (None: the
    data set's own); the one place that says which data set can give which shape.

    Raises:
        ValueError: a shape the data set cannot give (fixed arrays of another side, or
            channels other than its own and, for a folder, 1).
    """
    entry = _entry(name)
    default_channels, side = entry.shape
    if image_size is not None and not 1 <= image_size <= MAX_IMAGE_SIZE:
        raise ValueError(f"image_size {image_size}: must be from 1 to {MAX_IMAGE_SIZE} pixels, "
                         "or unset")  # fmt: skip
    if image_size not in (None, side) and not entry.resizable:
        raise ValueError(f"image_size {image_size}: {name} holds {side}x{side} images; "
                         "leave image_size unset")  # fmt: skip
    if channels not in (None, default_channels) and not (entry.grayscale and channels == 1):
        raise ValueError(f"channels {channels}: {name} gives {default_channels}"
                         f"{' or 1' if entry.grayscale else ''}; leave channels unset")  # fmt: skip
    options = {"image_size": image_size} if entry.resizable and image_size else {}
    return {**options, **({"channels": channels} if entry.grayscale and channels else {})}


def image_set_samplers(
    name: str,
    root: str | os.PathLike | None,
    *,
    ways: int,
    shots: int,
    queries: int,
    eval_queries: int | None = None,
    augment: bool = False,
    image_size: int | None = None,
    channels: int | None = None,
    splits: Sequence[str] = IMAGE_SPLITS,
    omniglot_split: str = "maml",
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    train_ways: int | None = None,
    train_shots: int | None = None,
    train_min_shots: int | None = None,
    **options,
) -> dict[str, EpisodicSampler]:
    """An `EpisodicSampler` per split, as an experiment trains, validates and tests on them.

    Args:
        name: one of `IMAGE_SET_NAMES`.
        root: the data set's folder (see docs/datasets.md for each layout); None for
            Omniglot only (`resolve_data_root`: ``$METALEARN_DATA``, else the cache).
        ways, shots: N, K of every task.
        queries: Q of the training tasks.
        eval_queries: Q of the validation and test tasks (None: ``queries``).
        augment: give the training sampler the set's standard augmentation.
        image_size, channels: of the images (None: the set's; see `image_options`).
        splits: the splits wanted (a test alone skips loading the others where it can).
        omniglot_split: Omniglot's class split, ``"maml"`` or ``"alphabet"``
            (`omniglot_splits`); Omniglot keeps its rotations (`omniglot_samplers`).
        dtype, device: of the task images (resident on ``device``).
        train_ways: N of the training tasks (None: ``ways``), for learners that size their
            head per task.
        train_shots: K of the training tasks (None: ``shots``), e.g. MetaOptNet's training
            with more shots than it tests.
        train_min_shots: random shots for the training tasks (`EpisodicSampler`'s
            ``min_shots``; None: every training task ``train_shots``).
        options: for the loader (``cache_dir``, ``workers``, ...).

    Returns:
        ``{split: sampler}`` for each of ``splits`` (Omniglot's alphabet split has no val).

    Raises:
        ValueError: an unknown name or split, a shape the set cannot give, or what the
            loader refuses.
        FileNotFoundError: the data is not at ``root`` (the message says what goes where).
    """
    entry = _entry(name)
    options = {**options, **image_options(name, image_size, channels)}
    eval_queries = queries if eval_queries is None else eval_queries
    augmentation = set_augmentation(name)
    common = dict(shots=shots, dtype=dtype, device=device)
    train_ways = ways if train_ways is None else train_ways
    train_shots = shots if train_shots is None else train_shots
    if name == "omniglot":
        data = load_omniglot(root, download=False, progress=False, **options)
        samplers = omniglot_samplers(data, omniglot_split, queries=queries, ways=ways, **common)
        if eval_queries != queries:
            evaluation = omniglot_samplers(data, omniglot_split, queries=eval_queries, ways=ways,
                                           **common)  # fmt: skip
            samplers.update({s: v for s, v in evaluation.items() if s != "train"})
        if (train_ways, train_shots, train_min_shots) != (ways, shots, None):
            wide = omniglot_samplers(data, omniglot_split, queries=queries, ways=train_ways,
                                     min_shots=train_min_shots,
                                     **{**common, "shots": train_shots})  # fmt: skip
            samplers["train"] = wide["train"]
        samplers["train"].augment = augmentation if augment else None
        return {s: samplers[s] for s in map(check_split, splits) if s in samplers}
    if omniglot_split != "maml":
        raise ValueError(f"omniglot_split {omniglot_split!r}: {name} has one published split; "
                         "leave omniglot_split unset")  # fmt: skip
    return {
        split: entry.load(root, split, **options).sampler(
            queries=queries if split == "train" else eval_queries,
            augment=augmentation if augment and split == "train" else None,
            ways=train_ways if split == "train" else ways,
            min_shots=train_min_shots if split == "train" else None,
            **{**common, "shots": train_shots if split == "train" else shots},
        )
        for split in map(check_split, splits)
    }
