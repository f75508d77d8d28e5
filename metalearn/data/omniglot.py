"""Omniglot (Lake et al., 2015): find or download, decode once to 28x28, cache, split.

The data root holds the standard extracted layout of the official zips::

    images_background/<Alphabet>/characterNN/*.png   30 alphabets, 964 characters
    images_evaluation/<Alphabet>/characterNN/*.png   20 alphabets, 659 characters

with 20 drawings (105x105, 1-bit, white background) per character. The root comes from an
explicit argument (an experiment's ``--data-root``), else ``$METALEARN_DATA``, else
``<cache dir>/omniglot``; a folder ``omniglot/`` holding the layout inside it also counts.
A missing or empty root is filled by downloading the official zips when the network allows.

Pixels, and how they relate to MAML's reference code (cbfinn/maml):

* Resizing is ``PIL`` ``LANCZOS`` on the grayscale (``"L"``) image by default, so strokes
  are anti-aliased. MAML's ``resize_images.py`` asks for ``LANCZOS`` too, but on the 1-bit
  PNG, where Pillow silently uses ``NEAREST`` (it always does for mode ``"1"``): MAML's
  28x28 images are binary. ``resample="nearest"`` reproduces those pixels exactly.
* Strokes are 1 and background 0: MAML's data generator computes ``1.0 - png / 255``
  (its comment: "invert"). The cache stores this ink in uint8 (255 = stroke).

Decoding 32,460 PNGs (`metalearn.data.decoding`, by `OMNIGLOT_FORMAT` or another
`ImageFormat`, the code that later decodes a deployed model's support images) takes a few
seconds on two cores; the result is cached as one uint8 tensor (`metalearn.data.cache`), so
the data root may be read-only and any change to the files rebuilds the cache. Downloading
and extracting the zips is `metalearn.data.download`'s.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from metalearn.data.cache import cached, default_cache_dir, fingerprint
from metalearn.data.decoding import (
    OMNIGLOT_FORMAT,
    RESAMPLE_FILTERS,
    ImageFormat,
    decode_image,
    decode_many,
)
from metalearn.data.download import ZipSource, download_folders, safe_extract
from metalearn.data.sampler import Augmentation, EpisodicSampler

__all__ = [
    "OMNIGLOT_FORMAT",
    "OMNIGLOT_ZIPS",
    "RESAMPLE_FILTERS",
    "SPLITS",
    "SUBSETS",
    "OmniglotImages",
    "SPLIT_ROTATIONS",
    "ZipSource",
    "decode_image",
    "default_cache_dir",
    "download_omniglot",
    "ensure_omniglot",
    "load_omniglot",
    "omniglot_samplers",
    "omniglot_splits",
    "resolve_data_root",
    "root_is_default",
    "safe_extract",
]

SUBSETS = ("images_background", "images_evaluation")
SPLITS = ("maml", "alphabet")
# Quarter turns that make new classes, per split: MAML rotates (Santoro et al., 2016);
# Lake et al.'s background/evaluation protocol does not.
SPLIT_ROTATIONS = {"maml": (0, 1, 2, 3), "alphabet": (0,)}
_URL = "https://github.com/brendenlake/omniglot/raw/master/python/{}.zip"
# MD5s as published in torchvision's `Omniglot.zips_md5` (torchvision/datasets/omniglot.py);
# they could not be re-checked against a download from this workplace (no network).
OMNIGLOT_ZIPS: Mapping[str, ZipSource] = {
    "images_background": ZipSource(
        _URL.format("images_background"), "68d2efa1b9178cc56df9314c21c6e718"
    ),
    "images_evaluation": ZipSource(
        _URL.format("images_evaluation"), "6b91aef0f799c5bb55b94e3f2daec811"
    ),
}


@dataclass(frozen=True)
class OmniglotImages:
    """Every Omniglot drawing, decoded and resized, in memory.

    Attributes:
        images: ink, uint8 ``[C, M, S, S]`` (255 = stroke, 0 = background); ``C``
            characters (1623 for the full set), ``M`` drawings each (20), ``S`` pixels a side.
        characters: ``"<Alphabet>/characterNN"`` per character, background subset first,
            each subset sorted by alphabet then character.
        alphabets: the alphabet of each character.
        background: bool ``[C]``, True for characters of ``images_background``.
        fingerprint: the source fingerprint the cache was keyed on.
        drawers: long ``[C, M]``, who drew each drawing, from its file name
            ``<character id>_<drawer>.png`` (None when some file is named otherwise).
    """

    images: Tensor
    characters: tuple[str, ...]
    alphabets: tuple[str, ...]
    background: Tensor
    fingerprint: str
    drawers: Tensor | None = None

    def to_float(
        self,
        index: Tensor | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> Tensor:
        """Characters ``index`` (all when None) as ``[c, M, 1, S, S]`` in [0, 1], strokes 1."""
        images = self.images if index is None else self.images[index]
        return images.to(device=device, dtype=dtype).div_(255).unsqueeze(2)


def resolve_data_root(data_root: str | os.PathLike | None = None) -> Path:
    """The data root: ``data_root``, else ``$METALEARN_DATA``, else ``<cache>/omniglot``."""
    if data_root is not None:
        return Path(data_root).expanduser()
    env = os.environ.get("METALEARN_DATA")
    return Path(env).expanduser() if env else default_cache_dir() / "omniglot"


def root_is_default(data_root: str | os.PathLike | None = None) -> bool:
    """Whether `resolve_data_root` falls back to the cache folder.

    Experiments create and download into that folder only: a folder the user named
    (argument or ``$METALEARN_DATA``) that does not exist is more likely a typo than a wish
    for a 10 MB download into it.
    """
    return data_root is None and not os.environ.get("METALEARN_DATA")


def _layout_at(root: Path) -> Path | None:
    """``root`` (or ``root/omniglot``) if it holds both subsets, else None."""
    for candidate in (root, root / "omniglot"):
        if all((candidate / subset).is_dir() for subset in SUBSETS):
            return candidate
    return None


def _how_to_get(root: Path, sources: Mapping[str, ZipSource]) -> str:
    urls = " and ".join(source.url for source in sources.values())
    return (
        f"Omniglot was not found at {root} (expected {' and '.join(s + '/' for s in SUBSETS)} "
        f"there). Download {urls}, unzip both into one folder, and point the data root at it "
        "(--data-root, or the METALEARN_DATA environment variable); or, with network "
        "access, leave both unset to have them downloaded into "
        f"{default_cache_dir() / 'omniglot'}."
    )


def ensure_omniglot(
    data_root: str | os.PathLike | None = None,
    *,
    download: bool = True,
    sources: Mapping[str, ZipSource] = OMNIGLOT_ZIPS,
) -> Path:
    """Find the Omniglot layout, downloading it into an empty or missing root if allowed.

    Args:
        data_root: see `resolve_data_root`.
        download: fetch the official zips when the root is missing or empty.
        sources: zip URL and MD5 per subset (tests point these at local ``file://`` zips).

    Returns:
        The folder that holds ``images_background/`` and ``images_evaluation/``.

    Raises:
        FileNotFoundError: the layout is absent and cannot be downloaded (no network,
            ``download=False``, or a non-empty root without the layout); the message
            gives the URLs and the ways to point at a copy.
        ValueError: a downloaded zip fails its checksum or integrity check, or is unsafe.
    """
    root = resolve_data_root(data_root)
    found = _layout_at(root)
    if found is not None:
        return found
    if root.exists() and not root.is_dir():
        raise FileNotFoundError(f"{_how_to_get(root, sources)} {root} is a file, not a folder.")
    missing = [subset for subset in SUBSETS if not (root / subset).is_dir()]
    foreign = (
        sorted(
            p.name for p in root.iterdir() if p.name not in SUBSETS and not p.name.startswith(".")
        )
        if root.is_dir()
        else []
    )
    if not download or foreign:
        why = (
            f" The folder is not empty ({', '.join(foreign[:5])}), so nothing was downloaded."
            if foreign
            else ""
        )
        raise FileNotFoundError(_how_to_get(root, sources) + why)
    download_omniglot(root, sources=sources, subsets=missing)
    return root


def download_omniglot(
    root: str | os.PathLike,
    *,
    sources: Mapping[str, ZipSource] = OMNIGLOT_ZIPS,
    subsets: Sequence[str] = SUBSETS,
) -> dict[str, str]:
    """Download, verify and safely extract the official zips into ``root``.

    Each zip is checked against its MD5 (when known) and its members' CRCs, then extracted
    into a temporary folder inside ``root`` and moved into place, so an interrupted
    download never leaves a half-extracted subset that looks complete
    (`metalearn.data.download.download_folders`).

    Returns:
        The SHA-256 of each downloaded zip, by subset (to record alongside a run).
    """
    wanted = {subset: sources[subset] for subset in subsets}
    return download_folders(root, wanted, how_to_get=_how_to_get(Path(root), sources))


def _scan(root: Path) -> list[tuple[str, str, bool, list[Path]]]:
    """``(character, alphabet, is_background, sorted png paths)`` per character folder."""
    found = []
    for subset in SUBSETS:
        for alphabet in sorted(p for p in (root / subset).iterdir() if p.is_dir()):
            for character in sorted(p for p in alphabet.iterdir() if p.is_dir()):
                pngs = sorted(character.glob("*.png"))
                if not pngs:
                    raise ValueError(f"{character} holds no .png drawings; re-extract {subset}.zip")
                key = f"{alphabet.name}/{character.name}"
                found.append((key, alphabet.name, subset == SUBSETS[0], pngs))
    if not found:
        raise FileNotFoundError(f"no character folders under {root}/{{{','.join(SUBSETS)}}}")
    counts = {len(pngs) for *_, pngs in found}
    if len(counts) > 1:
        odd = next(c for c in found if len(c[3]) != len(found[0][3]))
        raise ValueError(
            f"characters hold different numbers of drawings ({sorted(counts)}), e.g. "
            f"{odd[0]} has {len(odd[3])} and {found[0][0]} {len(found[0][3])}; "
            "the extraction is incomplete: re-extract the zips"
        )
    return found


def load_omniglot(
    data_root: str | os.PathLike | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    image_size: int = OMNIGLOT_FORMAT.size,
    resample: str = OMNIGLOT_FORMAT.resample,
    download: bool = True,
    workers: int | None = None,
    progress: bool = True,
) -> OmniglotImages:
    """All of Omniglot as a uint8 tensor, from the cache or decoded once and cached.

    Args:
        data_root: see `resolve_data_root` (may be read-only).
        cache_dir: where the decoded tensor is cached (default: `default_cache_dir`).
        image_size: side of the resized square images (`OMNIGLOT_FORMAT`'s 28, as in MAML).
        resample: ``"lanczos"`` (`OMNIGLOT_FORMAT`'s), ``"bilinear"`` or ``"nearest"``
            (MAML's actual binary pixels, see the module docstring).
        download: download the official zips into a missing or empty root.
        workers: decoding processes; 0 decodes in this process; None picks the CPU count
            (at most 8) for the full set and 0 for small trees.
        progress: show a progress bar while decoding.

    Raises:
        FileNotFoundError: no data and no way to download it (see `ensure_omniglot`).
        ValueError: a corrupt drawing (named), an incomplete tree, or a bad argument.

    Warns:
        UserWarning: the cache could not be written (the set is then used uncached).
    """
    if resample not in RESAMPLE_FILTERS:
        raise ValueError(f"resample={resample!r}; choose one of {RESAMPLE_FILTERS}")
    if image_size < 1:
        raise ValueError(f"image_size must be >= 1, got {image_size}")
    image = ImageFormat(image_size, 1, invert=True, resample=resample)
    root = ensure_omniglot(data_root, download=download)
    characters = _scan(root)
    pngs = [path for *_, paths in characters for path in paths]
    key = fingerprint(root, pngs, f"{image_size}|{resample}")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()

    def decode() -> dict:
        ink = decode_many([str(p) for p in pngs], image.decode, workers=workers,
                          desc="Omniglot", progress=progress)  # fmt: skip
        return {
            "images": ink.view(len(characters), -1, image_size, image_size),  # [C, M, S, S]
            "characters": [c[0] for c in characters],
            "alphabets": [c[1] for c in characters],
            "background": torch.tensor([c[2] for c in characters]),
        }

    path = cache / f"omniglot-{image_size}px-{resample}-{key[:20]}.pt"
    check = partial(_cache_problem, characters=characters, side=image_size)
    cached_set = cached(path, key, decode, what="Omniglot", check=check)
    return OmniglotImages(
        images=cached_set["images"],
        characters=tuple(cached_set["characters"]),
        alphabets=tuple(cached_set["alphabets"]),
        background=cached_set["background"],
        fingerprint=key,
        drawers=_drawers(characters),
    )


def _cache_problem(found: dict, characters: list[tuple[str, str, bool, list[Path]]],
                   side: int) -> str | None:  # fmt: skip
    """What a cached Omniglot whose fingerprint matches lacks to be the one ``characters``
    (`_scan`'s) decode to at ``side`` pixels: uint8 images ``[C, M, side, side]``, the
    characters' names and alphabets in order, their background flags (None: nothing)."""
    shape = [len(characters), len(characters[0][3]), side, side]
    images, background = found.get("images"), found.get("background")
    if not isinstance(images, Tensor) or images.dtype != torch.uint8 or list(images.shape) != shape:
        held = _described(images)
        return f"its images are {held}, where the files decode to uint8 {shape}"
    names = ([c[0] for c in characters], [c[1] for c in characters])
    if (found.get("characters"), found.get("alphabets")) != names:
        return "its characters or alphabets are not the folder's"
    flags = torch.tensor([c[2] for c in characters])
    if not isinstance(background, Tensor) or not torch.equal(background, flags):
        held = _described(background)
        return f"its background flags are {held}, not the folder's bool [{len(flags)}]"
    return None


def _described(value: object) -> str:
    """A tensor as ``dtype [shape]``; anything else by its type."""
    if isinstance(value, Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} {list(value.shape)}"
    return "missing" if value is None else type(value).__name__


def _drawers(characters: list[tuple[str, str, bool, list[Path]]]) -> Tensor | None:
    """Drawer of each drawing ``[C, M]`` from ``<id>_<drawer>.png`` (None if any is not so)."""
    found = [[re.fullmatch(r"\d+_(\d+)\.png", p.name) for p in pngs] for *_, pngs in characters]
    if not all(all(found_one) for found_one in found):
        return None
    return torch.tensor([[int(m.group(1)) for m in row] for row in found])


def omniglot_splits(
    data: OmniglotImages,
    split: str = "maml",
    *,
    seed: int = 1,
    sizes: tuple[int, int] = (1100, 100),
    val_alphabets: int = 5,
    trainval: bool = False,
) -> dict[str, Tensor]:
    """Character indices of the meta-train, -validation and -test sets.

    * ``"maml"`` (Finn et al., 2017, following Santoro et al., 2016): all characters in a
      seeded random order; the first ``sizes[0]`` train (1100), the next ``sizes[1]``
      validate (100), the rest test (423). MAML shuffles ``os.listdir`` order with
      ``random.seed(1)``, which depends on the file system, so its exact split cannot be
      reproduced; this shuffles the sorted characters with ``torch.randperm``.
    * ``"alphabet"`` (Lake et al., 2015): ``images_background`` alphabets train,
      ``images_evaluation`` alphabets test; ``val_alphabets`` whole background alphabets,
      chosen with ``seed``, validate (0: no validation set, an empty tensor).

    Rotations (new classes) are the sampler's business, see `omniglot_samplers`.

    ``trainval``: the validation characters join the training ones and no validation set is
    left (an empty tensor), the test set unchanged: a final model trained on both, as
    Prototypical Networks' reference retrains (``jakesnell/prototypical-networks``,
    ``scripts/train/few_shot/trainval.py``: ``data.trainval``, the ``trainval.txt`` split,
    ``train.txt`` and ``val.txt`` together).

    Returns:
        ``{"train", "val", "test"}`` -> long tensors of indices into ``data.characters``.
    """
    splits = _splits(data, split, seed, sizes, val_alphabets)
    if trainval:
        joined = torch.cat([splits["train"], splits["val"]]).sort().values
        return {"train": joined, "val": splits["val"][:0], "test": splits["test"]}
    return splits


def _splits(
    data: OmniglotImages, split: str, seed: int, sizes: tuple[int, int], val_alphabets: int
) -> dict[str, Tensor]:
    """`omniglot_splits` without ``trainval``."""
    generator = torch.Generator().manual_seed(seed)
    count = len(data.characters)
    if split == "maml":
        if sum(sizes) >= count:
            raise ValueError(
                f"sizes={sizes} leave no test characters out of {count}; the full set has "
                "1623 (1100 train, 100 validation, 423 test)"
            )
        order = torch.randperm(count, generator=generator)
        return {
            "train": order[: sizes[0]].sort().values,
            "val": order[sizes[0] : sum(sizes)].sort().values,
            "test": order[sum(sizes) :].sort().values,
        }
    if split == "alphabet":
        background = sorted({a for a, b in zip(data.alphabets, data.background.tolist()) if b})
        if not 0 <= val_alphabets < len(background):
            raise ValueError(
                f"val_alphabets={val_alphabets}, but there are {len(background)} background "
                "alphabets; choose 0 (no validation) or fewer"
            )
        picks = torch.randperm(len(background), generator=generator)[:val_alphabets]
        held = {background[i] for i in picks.tolist()}
        is_val = torch.tensor([a in held for a in data.alphabets], dtype=torch.bool)
        return {
            "train": torch.nonzero(data.background & ~is_val).flatten(),
            "val": torch.nonzero(is_val).flatten(),
            "test": torch.nonzero(~data.background).flatten(),
        }
    raise ValueError(f"split={split!r}; choose one of {SPLITS}")


def omniglot_samplers(
    data: OmniglotImages,
    split: str = "maml",
    *,
    ways: int,
    shots: int,
    queries: int,
    seed: int = 1,
    rotations: Sequence[int] | None = None,
    augment: Augmentation | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    min_shots: int | None = None,
    trainval: bool = False,
) -> dict[str, EpisodicSampler]:
    """One `EpisodicSampler` per non-empty set of `omniglot_splits`.

    Args:
        data: from `load_omniglot`.
        split: ``"maml"`` or ``"alphabet"`` (record it in the run's config).
        ways, shots, queries: N, K, Q of every task.
        seed: the split's seed (not the sampling seed: sampling takes a generator).
        rotations: quarter turns as new classes (None: `SPLIT_ROTATIONS` of ``split``).
        augment: for the ``"train"`` sampler only (e.g. `metalearn.data.SmallAffine`).
        dtype: of the task images (in [0, 1], strokes 1, background 0).
        device: where the images stay resident and tasks are made.
        min_shots: for the ``"train"`` sampler only: random shots (`EpisodicSampler`).
        trainval: train on the training and validation characters together, no ``"val"``
            sampler (`omniglot_splits`).

    Returns:
        ``{"train": ..., "val": ..., "test": ...}`` (``"val"`` absent when empty).
    """
    rotations = SPLIT_ROTATIONS.get(split, (0,)) if rotations is None else rotations
    samplers = {}
    for name, index in omniglot_splits(data, split, seed=seed, trainval=trainval).items():
        if len(index):
            # uint8 stays resident (a quarter of float's memory); tasks come out as dtype.
            images = data.images[index].unsqueeze(2).to(device)
            samplers[name] = EpisodicSampler(
                images, ways=ways, shots=shots, queries=queries, rotations=rotations, dtype=dtype,
                augment=augment if name == "train" else None,
                min_shots=min_shots if name == "train" else None,
            )  # fmt: skip
    return samplers
