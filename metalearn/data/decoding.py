"""How an image file becomes a network's input: a run's `ImageFormat`.

A run records the format its training images had (`metalearn.runs.recipe`), and everything
that later feeds the network files (a deployed model's support folder, a transfer check)
decodes them with `ImageFormat.decode`, the same code that built the training data:

* Omniglot: grayscale, resized, inverted so that ink is 255 and paper 0
  (`metalearn.data.omniglot.decode_image`, which builds the Omniglot cache);
* every other data set: RGB or grayscale, resized with Pillow's LANCZOS filter
  (`metalearn.data.image_set.decode_picture`, which builds the decoded caches; the sets
  shipped as arrays were resized the same way by their authors).

The network sees ``uint8 / 255``, values in [0, 1], with no per-channel normalisation: the
backbones' batch norm normalises.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from metalearn.data.image_set import decode_picture
from metalearn.data.omniglot import RESAMPLE_FILTERS, decode_image

__all__ = ["ImageFormat"]


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
        if self.size < 1 or self.channels not in (1, 3):
            raise ValueError(
                f"an image format needs size >= 1 and 1 or 3 channels, got size {self.size} "
                f"and {self.channels} channels"
            )
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
