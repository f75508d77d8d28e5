"""CUB-200-2011 (Wah et al., 2011) with the few-shot split of Hilliard et al. (2018).

200 bird species, 11,788 photos, not the same number per species. The few-shot split
used by Chen et al. (2019, "A Closer Look at Few-shot Classification") and later papers
takes the species folders in sorted order (``001.Black_footed_Albatross`` ...
``200.Common_Yellowthroat``) and assigns folder ``i`` (0-based) to train when ``i`` is even
(100 species), to validation when ``i % 4 == 1`` (50) and to test when ``i % 4 == 3`` (50).
(learn2learn's ``CUBirds200`` uses Meta-Dataset's 140 / 30 / 30 split instead.)

Layout: ``CUB_200_2011/images/<species>/*.jpg`` from ``CUB_200_2011.tgz``, in the root or in
``cubirds200/`` inside it (where learn2learn's ``CUBirds200`` extracts it); the root may also
be ``CUB_200_2011/`` itself. Photos are decoded once to ``image_size`` squares and cached.
"""

from __future__ import annotations

import os
from pathlib import Path

from metalearn.data.image_set import (
    ImageSet,
    check_split,
    check_split_classes,
    image_set_from_files,
)

__all__ = ["CUB_CLASSES", "CUB_SPECIES", "cub_split_of", "load_cub"]

CUB_SPECIES = 200
CUB_CLASSES = {"train": 100, "val": 50, "test": 50}
_NAME = "cub"


def cub_split_of(index: int) -> str:
    """The split of the species folder at ``index`` (0-based) in sorted order."""
    return "train" if index % 2 == 0 else ("val" if index % 4 == 1 else "test")


def load_cub(
    root: str | os.PathLike,
    split: str,
    *,
    image_size: int = 84,
    cache_dir: str | os.PathLike | None = None,
    workers: int | None = None,
) -> ImageSet:
    """One split of CUB-200-2011 as uint8 ``[N, 3, S, S]``, species in folder order.

    Raises:
        FileNotFoundError: no ``images/`` folder (the message says where it goes).
        ValueError: other than 200 species folders numbered 001 to 200, a species without
            photos, or a photo that cannot be decoded.
    """
    check_split(split)
    images = _images_folder(Path(root))
    species = sorted(p for p in images.iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(species) != CUB_SPECIES:
        raise ValueError(
            f"{images} holds {len(species)} species folders, CUB-200-2011 has {CUB_SPECIES}; the "
            "split is defined on all 200 in sorted order: re-extract CUB_200_2011.tgz"
        )
    if odd := [f.name for i, f in enumerate(species) if not f.name.startswith(f"{i + 1:03d}.")]:
        raise ValueError(
            f"{images}: species folder {odd[0]!r} breaks CUB-200-2011's numbering (001.<name> "
            "to 200.<name>, in order), on which the split is defined; re-extract "
            "CUB_200_2011.tgz"
        )
    classes = [
        (folder.name, sorted(p for p in folder.glob("*.jpg") if not p.name.startswith(".")))
        for i, folder in enumerate(species)
        if cub_split_of(i) == split
    ]
    check_split_classes(_NAME, split, len(classes), CUB_CLASSES[split], f"{images}")
    return image_set_from_files(
        _NAME, split, images.parent, classes, size=image_size, cache_dir=cache_dir, workers=workers
    )


def _images_folder(root: Path) -> Path:
    for candidate in (
        root / "CUB_200_2011" / "images",
        root / "cubirds200" / "CUB_200_2011" / "images",  # learn2learn's root
        root / "images",
    ):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"CUB-200-2011 was not found at {root}: extract CUB_200_2011.tgz (from "
        "https://www.vision.caltech.edu/datasets/cub_200_2011/) there, so that "
        "CUB_200_2011/images/<species>/*.jpg exist (or cubirds200/CUB_200_2011/images/..., "
        "learn2learn's layout); see docs/datasets.md"
    )
