"""Labelled image sets for episodic sampling: one uint8 tensor, classes of any sizes.

An `ImageSet` is one split of a benchmark (or of a user's folder): every image as uint8
``[N, ch, H, W]``, class by class, with the number of images of each class. It is what
every loader in `metalearn.data` returns and what `EpisodicSampler` draws tasks from.

Images come either from arrays the data set ships (pickles, ``.npz``), used as they are, or
from image files (JPEG/PNG, or encoded PNG bytes in a pickle) decoded once
(`metalearn.data.decoding.decode_picture`) and cached as Omniglot's are
(`metalearn.data.cache`: a ``.pt`` file keyed on a fingerprint of the sources' paths, sizes
and modification times, so the data root may be read-only and any change to the files
rebuilds the cache). The cache is memory-mapped when read back, so a set larger than memory
(tiered-ImageNet's 9.5 GB of training images) loads pages as tasks touch them.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from metalearn.data.cache import cached, default_cache_dir, fingerprint
from metalearn.data.decoding import UndecodableImage, decode_many, decode_picture
from metalearn.data.sampler import Augmentation, EpisodicSampler

__all__ = [
    "IMAGE_SPLITS",
    "ImageSet",
    "cached_decode",
    "check_split",
    "check_split_classes",
    "decode_picture",
    "image_set_from_files",
    "warn_on_counts",
]

IMAGE_SPLITS = ("train", "val", "test")
_CACHE_FORMAT = 1  # bump when the cached tensors' meaning changes


@dataclass(frozen=True)
class ImageSet:
    """One split of a labelled image set, resident as uint8.

    Attributes:
        images: uint8 ``[N, ch, H, W]``, class-major: class ``c``'s images are rows
            ``offsets[c] : offsets[c] + counts[c]``.
        counts: long ``[C]``, images per class (any sizes >= 1).
        class_names: the classes' names (ImageNet wnids, folder names, ...), ``C`` of them.
        name: the data set (``"mini-imagenet"``, ...).
        split: ``"train"``, ``"val"`` or ``"test"``.
        fingerprint: the decoded cache's key (None for sets read from arrays).
    """

    images: Tensor
    counts: Tensor
    class_names: tuple[str, ...]
    name: str = ""
    split: str = ""
    fingerprint: str | None = None

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.dim() != 4:
            raise ValueError(
                f"ImageSet images must be uint8 [N, ch, H, W], got {self.images.dtype} "
                f"{tuple(self.images.shape)}"
            )
        if len(self.counts) != len(self.class_names) or int(self.counts.sum()) != len(self.images):
            raise ValueError(
                f"ImageSet of {len(self.images)} images has {len(self.counts)} counts summing "
                f"to {int(self.counts.sum())} and {len(self.class_names)} class names; they "
                "must agree"
            )

    @classmethod
    def from_labels(
        cls, images: Tensor, labels: Tensor, class_names: Sequence[str], **fields: str
    ) -> ImageSet:
        """Group ``images [N, ch, H, W]`` by ``labels [N]`` (in ``range(len(class_names))``).

        Images keep their order within a class (a stable sort), so the set is the same
        whatever order the classes were listed in.
        """
        labels = torch.as_tensor(labels, dtype=torch.long)
        order = torch.sort(labels, stable=True).indices
        counts = torch.bincount(labels, minlength=len(class_names))
        if (counts == 0).any():
            empty = class_names[int((counts == 0).nonzero()[0])]
            raise ValueError(f"class {empty!r} has no images; remove it or add its images")
        sorted_images = images if bool((order == torch.arange(len(order))).all()) else images[order]
        return cls(sorted_images, counts, tuple(class_names), **fields)

    @property
    def num_classes(self) -> int:
        """``C``."""
        return len(self.counts)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(ch, H, W)``."""
        return tuple(self.images.shape[1:])

    @property
    def offsets(self) -> Tensor:
        """long ``[C]``: the first row of each class."""
        return torch.cumsum(self.counts, 0) - self.counts

    def labels(self) -> Tensor:
        """long ``[N]``: the class of each row."""
        return torch.arange(self.num_classes).repeat_interleave(self.counts)

    def class_images(self, index: int) -> Tensor:
        """uint8 ``[counts[index], ch, H, W]``: the images of one class."""
        start = int(self.offsets[index])
        return self.images[start : start + int(self.counts[index])]

    def sampler(
        self,
        *,
        ways: int,
        shots: int,
        queries: int,
        rotations: Sequence[int] = (0,),
        augment: Augmentation | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        min_shots: int | None = None,
    ) -> EpisodicSampler:
        """An `EpisodicSampler` over this set's classes (images in [0, 1] as ``dtype``)."""
        return EpisodicSampler(
            self.images.to(device),
            counts=self.counts,
            ways=ways,
            shots=shots,
            queries=queries,
            rotations=rotations,
            dtype=dtype,
            augment=augment,
            class_names=self.class_names,
            min_shots=min_shots,
        )

    def __repr__(self) -> str:
        return (
            f"ImageSet({self.name} {self.split}: {self.num_classes} classes, "
            f"{len(self.images)} images {tuple(self.image_shape)}, "
            f"{int(self.counts.min())}-{int(self.counts.max())} per class)"
        )


def check_split(split: str) -> str:
    """``split`` if it is one of `IMAGE_SPLITS`, else a ValueError naming them."""
    if split not in IMAGE_SPLITS:
        raise ValueError(f"split={split!r}; choose one of {', '.join(IMAGE_SPLITS)}")
    return split


def check_split_classes(name: str, split: str, found: int, expected: int, source: str) -> None:
    """Refuse a split whose class count is not the published one, naming where it came from.

    Raises:
        ValueError: ``found != expected``.
    """
    if found != expected:
        raise ValueError(
            f"{name} {split} split: {source} gives {found} classes, the published split has "
            f"{expected}; the files are incomplete or from another split: re-download them "
            "(see docs/datasets.md)"
        )


def warn_on_counts(image_set: ImageSet, expected: int) -> None:
    """Warn, naming a class, when images per class differ from the published ``expected``."""
    odd = (image_set.counts != expected).nonzero().flatten()
    if len(odd):
        first = int(odd[0])
        warnings.warn(
            f"{image_set.name} {image_set.split}: {len(odd)} of {image_set.num_classes} classes "
            f"do not hold the published {expected} images, e.g. {image_set.class_names[first]!r} "
            f"holds {int(image_set.counts[first])}; results will not be comparable to papers",
            stacklevel=3,
        )


def cached_decode(
    name: str,
    root: Path,
    files: Sequence[Path],
    sources: Callable[[], Sequence[str | bytes]],
    *,
    size: int,
    channels: int = 3,
    key: str = "",
    cache_dir: str | os.PathLike | None = None,
    workers: int | None = None,
    exact: bool = False,
    describe: Callable[[int], str] | None = None,
) -> tuple[Tensor, str]:
    """Decoded images of ``sources()``, from the cache or decoded once and cached.

    A cache that cannot be written (a full disk, a read-only folder) leaves the images
    decoded in memory: the run goes on uncached, with a warning naming the cache file.

    Args:
        name: the data set, in the cache file's name and in messages.
        root: the data root; ``files`` are fingerprinted relative to it.
        files: every file the images come from (the image files, or the pickle holding
            encoded images): their paths, sizes and mtimes key the cache.
        sources: called on a cache miss only: the image paths or encoded bytes, in order.
        size, channels: of the decoded images (`decode_picture`).
        key: anything else that changes the decoded tensor (the split, the class order).
        cache_dir: where the cache lives (default: `default_cache_dir`).
        workers: decoding processes (None: the CPU count, at most 8, for 2000 images or
            more; 0: decode in this process).
        exact: refuse images not already ``size`` square (see `decode_picture`).
        describe: names the source at a position for messages (encoded images held in one
            file: the file and the image's index in it); paths name themselves.

    Returns:
        uint8 ``[N, channels, size, size]`` (memory-mapped from the cache) and the fingerprint.

    Raises:
        ValueError: a source that does not decode (named).

    Warns:
        UserWarning: the cache could not be written.
    """
    fingerprinted = fingerprint(root, files, f"{_CACHE_FORMAT}|{size}|{channels}|{key}")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    decode = partial(decode_picture, size=size, channels=channels, exact=exact)

    def build() -> dict:
        try:
            return {"images": decode_many(sources(), decode, workers=workers, desc=name)}
        except UndecodableImage as bad:
            message = str(bad) if describe is None else f"{describe(bad.position)}: {bad}"
            raise ValueError(message) from None

    path = cache / f"{name}-{size}px-{fingerprinted[:20]}.pt"
    check = partial(_cache_problem, shape=[channels, size, size])
    found = cached(path, fingerprinted, build, what=name, mmap=True, check=check)
    return found["images"], fingerprinted


def _cache_problem(found: dict, shape: list[int]) -> str | None:
    """What a cache whose fingerprint matches lacks to hold images decoded at ``shape``
    (``[channels, size, size]``): uint8 ``[N, *shape]`` (None: nothing)."""
    images = found.get("images")
    if isinstance(images, Tensor):
        if images.dtype == torch.uint8 and images.dim() == 4 and list(images.shape[1:]) == shape:
            return None
        held = f"{str(images.dtype).removeprefix('torch.')} {list(images.shape)}"
    else:
        held = "missing" if images is None else type(images).__name__
    return f"its images are {held}, where the files decode to uint8 [N, *{shape}]"


def image_set_from_files(
    name: str,
    split: str,
    root: Path,
    classes: Sequence[tuple[str, Sequence[Path]]],
    *,
    size: int,
    channels: int = 3,
    cache_dir: str | os.PathLike | None = None,
    workers: int | None = None,
    exact: bool = False,
) -> ImageSet:
    """An `ImageSet` of image files, ``(class name, its files)`` per class, decoded and cached.

    ``exact`` refuses images not already ``size`` square (sets published at one size).

    Raises:
        ValueError: a class without files (named), or a file that cannot be decoded (named).
    """
    for class_name, files in classes:
        if not files:
            raise ValueError(f"{name} {split}: class {class_name!r} has no images; add them")
    files = [path for _, paths in classes for path in paths]
    images, fingerprint = cached_decode(
        name,
        root,
        files,
        lambda: [str(path) for path in files],
        size=size,
        channels=channels,
        key=f"{split}|" + "|".join(class_name for class_name, _ in classes),
        cache_dir=cache_dir,
        workers=workers,
        exact=exact,
    )
    counts = torch.tensor([len(paths) for _, paths in classes])
    return ImageSet(images, counts, tuple(c for c, _ in classes), name, split, fingerprint)
