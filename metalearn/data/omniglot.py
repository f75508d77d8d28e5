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

Decoding 32,460 PNGs takes a few seconds on two cores; the result is cached as one uint8
tensor in a writable cache directory (``$METALEARN_CACHE`` or ``~/.cache/metalearn``), keyed
on a fingerprint of the file list, sizes and modification times, so the data root may be
read-only and any change to the files rebuilds the cache.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import re
import stat
import sys
import tempfile
import urllib.error
import urllib.request
import warnings
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
import torch
from torch import Tensor

from metalearn.checkpoint import save_checkpoint
from metalearn.data.sampler import Augmentation, EpisodicSampler

__all__ = [
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
RESAMPLE_FILTERS = ("lanczos", "bilinear", "nearest")
# Quarter turns that make new classes, per split: MAML rotates (Santoro et al., 2016);
# Lake et al.'s background/evaluation protocol does not.
SPLIT_ROTATIONS = {"maml": (0, 1, 2, 3), "alphabet": (0,)}
_CACHE_FORMAT = 1  # bump when the cached tensor's meaning changes
_POOL_MIN_FILES = 2000  # below this, process start-up costs more than it saves


@dataclass(frozen=True)
class ZipSource:
    """Where one official zip lives and its expected MD5 (None: not checked)."""

    url: str
    md5: str | None


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


def default_cache_dir() -> Path:
    """``$METALEARN_CACHE`` if set, else ``~/.cache/metalearn``."""
    env = os.environ.get("METALEARN_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "metalearn"


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
        "(--data-root, or the METALEARN_DATA environment variable); or give an empty or "
        "missing folder with download=True and network access to have them downloaded."
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
    download never leaves a half-extracted subset that looks complete.

    Returns:
        The SHA-256 of each downloaded zip, by subset (to record alongside a run).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    digests = {}
    for subset in subsets:
        source = sources[subset]
        zip_path = root / f".{subset}.zip"
        digests[subset] = _fetch(source, zip_path, root, sources)
        with tempfile.TemporaryDirectory(dir=root, prefix=".extract-") as tmp:
            safe_extract(zip_path, tmp)
            if not (Path(tmp) / subset).is_dir():
                raise ValueError(f"{source.url} does not contain the folder {subset}/")
            os.replace(Path(tmp) / subset, root / subset)
        zip_path.unlink()
    return digests


def _fetch(source: ZipSource, dest: Path, root: Path, sources: Mapping[str, ZipSource]) -> str:
    """Stream ``source.url`` to ``dest``, check its MD5, return its SHA-256."""
    md5, sha256 = hashlib.md5(), hashlib.sha256()
    part = dest.with_suffix(".part")
    try:
        with urllib.request.urlopen(source.url, timeout=60) as response, open(part, "wb") as f:
            while chunk := response.read(1 << 20):
                md5.update(chunk)
                sha256.update(chunk)
                f.write(chunk)
    except (urllib.error.URLError, http.client.HTTPException, TimeoutError, ConnectionError) as err:
        part.unlink(missing_ok=True)
        raise FileNotFoundError(
            f"Downloading {source.url} failed ({err}). {_how_to_get(root, sources)}"
        ) from err
    if source.md5 is not None and md5.hexdigest() != source.md5:
        part.unlink()
        raise ValueError(
            f"{source.url} has MD5 {md5.hexdigest()}, expected {source.md5}: the download is "
            "corrupt or the file changed upstream; retry, or download and unzip it by hand"
        )
    os.replace(part, dest)
    return sha256.hexdigest()


def safe_extract(zip_path: str | os.PathLike, target: str | os.PathLike) -> list[str]:
    """Extract a zip, refusing any member that could land outside ``target``.

    Rejects absolute paths, drive letters, ``..`` components and symbolic links before
    writing anything, and checks every member's CRC (``ZipFile.testzip``).

    Returns:
        The member names extracted.

    Raises:
        ValueError: an unsafe member (named) or a corrupt archive.
    """
    with zipfile.ZipFile(zip_path) as archive:
        names = archive.namelist()
        for info in archive.infolist():
            _check_member(info, zip_path)
        bad = archive.testzip()
        if bad is not None:
            raise ValueError(
                f"{zip_path} is corrupt: member {bad!r} fails its CRC check; delete it and "
                "download again"
            )
        archive.extractall(target)
    return names


def _check_member(info: zipfile.ZipInfo, zip_path: str | os.PathLike) -> None:
    name = info.filename.replace("\\", "/")
    parts = PurePosixPath(name).parts
    is_link = stat.S_ISLNK(info.external_attr >> 16)
    if name.startswith("/") or (parts and ":" in parts[0]) or ".." in parts or is_link:
        raise ValueError(
            f"refusing to extract {zip_path}: member {info.filename!r} is "
            f"{'a symbolic link' if is_link else 'a path outside the target folder'}; "
            "the archive is not the official Omniglot zip"
        )


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


def _fingerprint(root: Path, characters: list[tuple[str, str, bool, list[Path]]], key: str) -> str:
    """SHA-256 of relative paths, sizes and mtimes (not contents: stat-only, so cheap)."""
    digest = hashlib.sha256(f"{_CACHE_FORMAT}|{key}".encode())
    for *_, pngs in characters:
        for path in pngs:
            st = path.stat()
            digest.update(f"{path.relative_to(root)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def decode_image(path: str, size: int, resample: str) -> np.ndarray:
    """Decode one drawing as `load_omniglot` does: grayscale, resized, inverted to ink.

    `metalearn.deploy` decodes support images with it too, so a deployed model sees its
    inputs exactly as it saw them in training.

    Args:
        path: an image file PIL can open (Omniglot's are binary PNGs, black strokes on white).
        size: side of the square output, in pixels.
        resample: one of `RESAMPLE_FILTERS`: ``"lanczos"`` or ``"bilinear"`` resize the
            grayscale image; ``"nearest"`` resizes the image in its own mode (binary for
            Omniglot) as MAML's preprocessing did, then converts it to grayscale.

    Returns:
        uint8 ``[size, size]``: the ink, 255 on a stroke and 0 on the background.

    Raises:
        ValueError: ``resample`` is unknown, or the file cannot be opened or decoded (the
            message names it).
    """
    from PIL import Image

    if resample not in RESAMPLE_FILTERS:
        raise ValueError(f"resample must be one of {RESAMPLE_FILTERS}, got {resample!r}")

    filters = {"lanczos": Image.Resampling.LANCZOS, "bilinear": Image.Resampling.BILINEAR}
    try:
        with Image.open(path) as image:
            if resample == "nearest":  # what MAML's script got: mode "1" forces NEAREST
                small = image.resize((size, size), Image.Resampling.NEAREST)
                gray = np.asarray(small.convert("L"))
            else:
                gray = np.asarray(image.convert("L").resize((size, size), filters[resample]))
    except Exception as err:  # any decoder failure: name the file, then stop
        raise ValueError(
            f"cannot decode {path} ({type(err).__name__}: {err}); the file is corrupt: "
            "re-extract or re-download its zip"
        ) from None
    return 255 - gray


def _decode_character(job: tuple[list[str], int, str]) -> np.ndarray:
    paths, size, resample = job
    return np.stack([decode_image(path, size, resample) for path in paths])


def _decode_all(
    characters: list[tuple[str, str, bool, list[Path]]],
    size: int,
    resample: str,
    workers: int | None,
    progress: bool,
) -> Tensor:
    """Decode every drawing, in a process pool when there are many; ``[C, M, S, S]``."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from PIL import Image  # noqa: F401  (imported before forking, not in each child)
    from tqdm.auto import tqdm

    jobs = [([str(p) for p in pngs], size, resample) for *_, pngs in characters]
    files = sum(len(job[0]) for job in jobs)
    # fork, as torch's DataLoader does on Linux: spawn/forkserver children re-import the
    # caller's __main__ (fails from stdin) and pay torch's import; the children only run
    # PIL and numpy. Elsewhere fork is unsafe (macOS) or absent (Windows): decode here.
    can_fork = sys.platform.startswith("linux")
    if workers is None:
        workers = min(os.cpu_count() or 1, 8) if files >= _POOL_MIN_FILES and can_fork else 0
    bar = dict(total=len(jobs), desc="Omniglot: decoding", unit="char", disable=not progress)
    if workers <= 1 or not can_fork:
        arrays = [_decode_character(job) for job in tqdm(jobs, **bar)]
    else:
        # An executor, not multiprocessing.Pool: a killed worker raises instead of hanging.
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
        try:
            arrays = list(tqdm(pool.map(_decode_character, jobs, chunksize=16), **bar))
        finally:  # on a corrupt file, stop now rather than after decoding the rest
            pool.shutdown(cancel_futures=True)
    return torch.from_numpy(np.stack(arrays))


def _load_cache(
    path: Path, fingerprint: str, *, what: str = "Omniglot", mmap: bool = False
) -> dict | None:
    """The cached dict if ``path`` is a readable cache for ``fingerprint``, else None.

    ``what`` names the data in the warning; ``mmap`` maps the tensors from the file instead
    of reading them (pages load on first touch: for sets larger than memory).
    """
    if not path.is_file():
        return None
    try:
        cached = torch.load(path, weights_only=True, mmap=mmap)
    except Exception as err:  # a truncated or foreign file: rebuild it, but say so
        warnings.warn(
            f"ignoring unreadable {what} cache {path} ({err}); rebuilding it", stacklevel=3
        )
        return None
    if not isinstance(cached, dict) or cached.get("fingerprint") != fingerprint:
        return None
    return cached


def _write_cache(path: Path, cached: dict, what: str = "Omniglot") -> bool:
    """Write a decoded cache; if that fails, warn and go on uncached. Returns whether written.

    The decoded tensors are in memory already, so a full disk or a read-only cache folder
    costs the next run a decode, not this run its data.
    """
    try:
        save_checkpoint(path, cached)
    except (OSError, RuntimeError) as err:  # torch.save's zip writer raises RuntimeError
        why = " ".join(str(err).split())
        warnings.warn(
            f"cannot write the {what} cache {path} ({type(err).__name__}: {why}); running "
            "uncached (the images are decoded again next time): free disk space or point "
            "METALEARN_CACHE at a writable folder",
            stacklevel=3,
        )
        return False
    return True


def load_omniglot(
    data_root: str | os.PathLike | None = None,
    *,
    cache_dir: str | os.PathLike | None = None,
    image_size: int = 28,
    resample: str = "lanczos",
    download: bool = True,
    workers: int | None = None,
    progress: bool = True,
) -> OmniglotImages:
    """All of Omniglot as a uint8 tensor, from the cache or decoded once and cached.

    Args:
        data_root: see `resolve_data_root` (may be read-only).
        cache_dir: where the decoded tensor is cached (default: `default_cache_dir`).
        image_size: side of the resized square images (28 as in MAML).
        resample: ``"lanczos"`` (default), ``"bilinear"`` or ``"nearest"`` (MAML's actual
            binary pixels, see the module docstring).
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
    root = ensure_omniglot(data_root, download=download)
    characters = _scan(root)
    fingerprint = _fingerprint(root, characters, f"{image_size}|{resample}")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache / f"omniglot-{image_size}px-{resample}-{fingerprint[:20]}.pt"
    cached = _load_cache(path, fingerprint)
    if cached is None:
        images = _decode_all(characters, image_size, resample, workers, progress)
        cached = {
            "images": images,
            "characters": [c[0] for c in characters],
            "alphabets": [c[1] for c in characters],
            "background": torch.tensor([c[2] for c in characters]),
            "fingerprint": fingerprint,
        }
        _write_cache(path, cached)
    return OmniglotImages(
        images=cached["images"],
        characters=tuple(cached["characters"]),
        alphabets=tuple(cached["alphabets"]),
        background=cached["background"],
        fingerprint=fingerprint,
        drawers=_drawers(characters),
    )


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

    Returns:
        ``{"train", "val", "test"}`` -> long tensors of indices into ``data.characters``.
    """
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

    Returns:
        ``{"train": ..., "val": ..., "test": ...}`` (``"val"`` absent when empty).
    """
    rotations = SPLIT_ROTATIONS.get(split, (0,)) if rotations is None else rotations
    samplers = {}
    for name, index in omniglot_splits(data, split, seed=seed).items():
        if len(index):
            # uint8 stays resident (a quarter of float's memory); tasks come out as dtype.
            images = data.images[index].unsqueeze(2).to(device)
            samplers[name] = EpisodicSampler(
                images, ways=ways, shots=shots, queries=queries, rotations=rotations, dtype=dtype,
                augment=augment if name == "train" else None,
            )  # fmt: skip
    return samplers
