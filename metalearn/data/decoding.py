"""How an image file becomes uint8 pixels: the one decoder of every data set and run.

Two decodings, each one function:

* Omniglot's ink (`decode_image`): grayscale, resized, inverted so that ink is 255 and paper
  0, as MAML's data generator computes ``1 - png / 255``;
* every other image (`decode_picture`): RGB or grayscale, resized with Pillow's LANCZOS
  filter (the preprocessing of mini-ImageNet's 84x84 images; the sets shipped as arrays
  were resized the same way by their authors).

A run records the format its training images had (`ImageFormat`, in its recipe), and
everything that later feeds the network files (a deployed model's support folder, a
transfer check) decodes them with `ImageFormat.decode`, the same code that built the
training cache. `decode_many` decodes a whole data set, in a forked process pool when it is
large; the loaders cache what it returns (`metalearn.data.cache`).

The network sees ``uint8 / 255``, values in [0, 1], with no per-channel normalisation: the
backbones' batch norm normalises.
"""

from __future__ import annotations

import io
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from metalearn.files import read_bytes

__all__ = [
    "MAX_IMAGE_SIZE",
    "OMNIGLOT_FORMAT",
    "RESAMPLE_FILTERS",
    "ImageFormat",
    "UndecodableImage",
    "decode_image",
    "decode_many",
    "decode_picture",
    "open_image",
]

RESAMPLE_FILTERS = ("lanczos", "bilinear", "nearest")
IMAGE_BYTES = 64 << 20
"""The most bytes one image file may hold (the published sets' largest are a few MB)."""
IMAGE_PIXELS = 40_000_000
"""The most pixels one image may decode to (a 6000 x 6000 photograph is 36 million): a
small file that inflates past this (a decompression bomb) is refused before decoding."""
MAX_IMAGE_SIZE = 1024
"""The largest side an image is decoded at: 12 times mini-ImageNet's 84, where 60,000 RGB
images already take 180 GB decoded; a larger side is a typo or a damaged record."""
_POOL_MIN_IMAGES = 2000  # below this, process start-up costs more than it saves
_CHUNK = 256  # images per job handed to a worker


def open_image(source: str | os.PathLike | bytes) -> Any:
    """A Pillow image of a file (read as `metalearn.files.read_bytes` reads: a regular file
    of at most `IMAGE_BYTES`) or of encoded bytes, its size checked against `IMAGE_PIXELS`
    from its header, before any pixel is decoded.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a regular file, too large, not an image, or more than
            `IMAGE_PIXELS` pixels (each named).
    """
    from PIL import Image

    data = source if isinstance(source, bytes) else read_bytes(source, limit=IMAGE_BYTES,
                                                                   what="image")  # fmt: skip
    what = "an encoded image" if isinstance(source, bytes) else str(source)
    try:
        with warnings.catch_warnings():  # Pillow's own bomb warning: refused below instead
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except Exception as err:  # any decoder failure: name the file, then stop
        raise ValueError(f"cannot decode {what} ({type(err).__name__}: {err}); the file is "
                         "corrupt or not an image: replace or remove it") from None  # fmt: skip
    width, height = image.size
    if width * height > IMAGE_PIXELS:
        raise ValueError(f"{what} is {width}x{height} pixels, more than the "
                         f"{IMAGE_PIXELS:,} an image may decode to; shrink it first (or it "
                         "is a decompression bomb)")  # fmt: skip
    return image


def decode_image(path: str, size: int, resample: str) -> np.ndarray:
    """Decode one drawing as Omniglot's are: grayscale, resized, inverted to ink.

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
            message names it; see `open_image`).
    """
    from PIL import Image

    if resample not in RESAMPLE_FILTERS:
        raise ValueError(f"resample must be one of {RESAMPLE_FILTERS}, got {resample!r}")

    filters = {"lanczos": Image.Resampling.LANCZOS, "bilinear": Image.Resampling.BILINEAR}
    opened = open_image(path)
    try:
        with opened as image:
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


def decode_picture(
    source: str | bytes, size: int, channels: int = 3, *, exact: bool = False
) -> np.ndarray:
    """Decode one image file (a path, or its encoded bytes) to uint8 ``[channels, size, size]``.

    Colour images are converted to RGB (``channels=3``) or grayscale (``1``) and resized to a
    ``size`` square with Pillow's LANCZOS filter (the preprocessing of mini-ImageNet's
    84x84 images); an image already that size is left untouched.

    Args:
        exact: refuse an image that is not already ``size`` square (sets published at one
            size: tiered-ImageNet's PNGs, R2-D2's CIFAR-FS) instead of resizing it.

    Raises:
        ValueError: the image cannot be opened or decoded, or ``exact`` and it has another
            size (the message names it).
    """
    from PIL import Image

    what = "an encoded image" if isinstance(source, bytes) else source
    opened = open_image(source)
    try:
        with opened as image:
            found = image.size
            image = image.convert("RGB" if channels == 3 else "L")
            if image.size != (size, size) and not exact:
                image = image.resize((size, size), Image.Resampling.LANCZOS)
            pixels = np.asarray(image)
    except Exception as err:  # any decoder failure: name the file, then stop
        raise ValueError(
            f"cannot decode {what} ({type(err).__name__}: {err}); the file is corrupt: "
            "re-extract or re-download it"
        ) from None
    if exact and found != (size, size):
        raise ValueError(
            f"{what} is {found[0]}x{found[1]} pixels, the published images are {size}x{size}; "
            "the file is not the published one: re-download it"
        )
    return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)


@dataclass(frozen=True)
class ImageFormat:
    """The decoding of a run's images.

    Attributes:
        size: side of the square image in pixels.
        channels: 1 (grayscale) or 3 (RGB).
        invert: ink is bright (Omniglot: dark strokes on white become 255 on 0).
        resample: the resizing filter, one of `RESAMPLE_FILTERS` (only ``"lanczos"``
            without ``invert``).
    """

    size: int
    channels: int
    invert: bool = False
    resample: str = "lanczos"

    def __post_init__(self) -> None:
        if not _is_int(self.size) or not 1 <= self.size <= MAX_IMAGE_SIZE:
            raise ValueError(f"size: {self.size!r} is not a whole number of pixels from 1 to "
                             f"{MAX_IMAGE_SIZE}")  # fmt: skip
        if not _is_int(self.channels) or self.channels not in (1, 3):
            raise ValueError(f"channels: {self.channels!r} is neither 1 (grayscale) nor 3 (RGB)")
        if not isinstance(self.invert, bool):
            raise ValueError(f"invert: {self.invert!r} is not true or false")
        if self.resample not in RESAMPLE_FILTERS or (self.resample != "lanczos"
                                                     and not self.invert):  # fmt: skip
            raise ValueError(
                f"resample {self.resample!r}: inverted (Omniglot) images take one of "
                f"{', '.join(RESAMPLE_FILTERS)}, the others lanczos"
            )
        if self.invert and self.channels != 1:
            raise ValueError("an inverted (Omniglot) format is grayscale: channels must be 1")

    def decode(self, path: str | os.PathLike) -> np.ndarray:
        """One file as the network's training images were made: uint8 ``[channels, S, S]``.

        Raises:
            ValueError: the file cannot be opened or decoded (named).
        """
        if self.invert:
            return decode_image(str(path), self.size, self.resample)[None]
        # A writable copy: Pillow's buffer is read-only, which torch.from_numpy warns about.
        return np.array(decode_picture(str(path), self.size, self.channels))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


OMNIGLOT_FORMAT = ImageFormat(28, 1, invert=True)
"""Omniglot's images as MAML trains on them: 28 px, grayscale, ink 255 on 0, LANCZOS."""


class UndecodableImage(ValueError):
    """A source that does not decode; ``position`` is its index in `decode_many`'s sources."""

    def __init__(self, position: int, message: str) -> None:
        super().__init__(message)
        self.position = position

    def __reduce__(self):  # rebuilt from (position, message) when a worker process raises it
        return type(self), (self.position, str(self))


def _decode_chunk(job: tuple[Callable[..., np.ndarray], Sequence, int]) -> np.ndarray:
    decode, sources, first = job
    pictures = []
    for offset, source in enumerate(sources):
        try:
            pictures.append(decode(source))
        except ValueError as err:  # carries the position back from a worker process
            raise UndecodableImage(first + offset, str(err)) from None
    return np.stack(pictures)


def decode_many(
    sources: Sequence[str | bytes],
    decode: Callable[[str | bytes], np.ndarray],
    *,
    workers: int | None = None,
    desc: str = "images",
    progress: bool = False,
) -> Tensor:
    """Decode every source, in a forked process pool when there are many.

    Args:
        sources: image paths or encoded images, in order.
        decode: one source to a uint8 array, the same shape for all (`decode_image` or
            `decode_picture` with their sizes bound by `functools.partial`: it is sent to
            the worker processes, so a module-level function, not a lambda).
        workers: decoding processes; 0 decodes in this process; None picks the CPU count
            (at most 8) for 2000 sources or more and 0 below.
        desc: the data set, in the progress bar and messages.
        progress: show a progress bar.

    Returns:
        uint8 ``[N, *decode's shape]``, row ``i`` decoded from ``sources[i]``.

    Raises:
        UndecodableImage: a source that does not decode (a ValueError carrying its position
            in ``sources``; the message names the file).
        ValueError: no sources.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from PIL import Image  # noqa: F401  (imported before forking, not in each child)
    from tqdm.auto import tqdm

    if not len(sources):
        raise ValueError(f"{desc}: no images to decode")
    jobs = [(decode, sources[i : i + _CHUNK], i) for i in range(0, len(sources), _CHUNK)]
    # fork, as torch's DataLoader does on Linux: spawn/forkserver children re-import the
    # caller's __main__ (fails from stdin) and pay torch's import; the children only run
    # PIL and numpy. Elsewhere fork is unsafe (macOS) or absent (Windows): decode here.
    can_fork = sys.platform.startswith("linux")
    if workers is None:
        many = len(sources) >= _POOL_MIN_IMAGES and can_fork
        workers = min(os.cpu_count() or 1, 8) if many else 0
    bar = tqdm(total=len(sources), desc=f"{desc}: decoding", unit="img", disable=not progress)
    arrays = []
    with bar:
        if workers <= 1 or not can_fork:
            for job in jobs:
                arrays.append(_decode_chunk(job))
                bar.update(len(arrays[-1]))
        else:
            # An executor, not multiprocessing.Pool: a killed worker raises instead of hanging.
            pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
            try:
                for array in pool.map(_decode_chunk, jobs):
                    arrays.append(array)
                    bar.update(len(array))
            finally:  # on a corrupt file, stop now rather than after decoding the rest
                pool.shutdown(cancel_futures=True)
    return torch.from_numpy(np.concatenate(arrays))
