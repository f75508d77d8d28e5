"""Data augmentation on batches of images with torch ops, seeded by a ``torch.Generator``.

Each augmentation is a small frozen dataclass called as ``aug(x, generator)`` on
``x [B, ch, H, W]`` in [0, 1]; it draws one set of parameters per image (`params`) and
applies them (`apply`), so tests can check the two halves separately. The standard
choices of the few-shot literature are here:

* natural images: `PadCrop` (zero padding then a random crop of the original size, as
  torchvision's ``RandomCrop(size, padding)``; MetaOptNet and CIFAR-FS use it) or
  `RandomResizedCrop` (as ``RandomResizedCrop``; Chen et al., 2019 use it on CUB), then
  `HorizontalFlip` and `ColorJitter` (brightness, contrast, saturation, in that order);
* characters: `SmallAffine` (a small rotation, shear, scale and shift with zero fill,
  since Omniglot's background is 0).

`standard_augmentation` gives the preset for a kind of data. The sampler applies it per task
(`metalearn.data.EpisodicSampler`, ``augment=``), at training only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from metalearn.data.sampler import Augmentation, check_generator

__all__ = [
    "AUGMENTATION_KINDS",
    "ColorJitter",
    "Compose",
    "HorizontalFlip",
    "PadCrop",
    "RandomResizedCrop",
    "SmallAffine",
    "affine_resample",
    "standard_augmentation",
]

AUGMENTATION_KINDS = ("none", "pad-crop", "resized-crop", "character")
_GRAY = (0.299, 0.587, 0.114)  # ITU-R 601 luma, as PIL's and torchvision's grayscale


def _uniform(generator: torch.Generator, n: int, low: float, high: float) -> Tensor:
    """``[n]`` float64 draws from U(low, high) on the generator's device."""
    u = torch.rand(n, dtype=torch.float64, generator=generator, device=generator.device)
    return low + (high - low) * u


def _check_batch(x: Tensor) -> None:
    if x.dim() != 4 or not x.is_floating_point():
        raise ValueError(
            f"augmentations take floating images [B, ch, H, W], got {x.dtype} {tuple(x.shape)}"
        )


def affine_resample(x: Tensor, theta: Tensor) -> Tensor:
    """Bilinear resampling of ``x [B, ch, H, W]`` at ``theta [B, 2, 3]``, zeros outside.

    ``theta`` maps output coordinates to input coordinates in ``[-1, 1]`` units (pixel
    centres, ``align_corners=False``), as ``torch.nn.functional.affine_grid`` reads it.
    """
    theta = theta.to(device=x.device, dtype=x.dtype)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


class _Augmentation:
    """One batched augmentation: ``params`` draws every image's parameters from the
    generator, ``apply`` uses them, so a test can replay ``apply`` on known parameters."""

    def params(self, batch: int, generator: torch.Generator) -> Tensor:
        raise NotImplementedError

    def apply(self, x: Tensor, params: Tensor) -> Tensor:
        raise NotImplementedError

    def __call__(self, x: Tensor, generator: torch.Generator) -> Tensor:
        """Augment images ``x [B, ch, H, W]`` in [0, 1]; all randomness from ``generator``."""
        _check_batch(x)
        return self.apply(x, self.params(len(x), check_generator(generator)))


@dataclass(frozen=True)
class PadCrop(_Augmentation):
    """Zero-pad by ``padding`` pixels, then crop ``H x W`` at a random offset."""

    padding: int = 8

    def params(self, batch: int, generator: torch.Generator) -> Tensor:
        """long ``[B, 2]``: top and left offsets into the padded image, in ``[0, 2 p]``."""
        draw = dict(generator=generator, device=generator.device)
        return torch.randint(2 * self.padding + 1, (batch, 2), **draw)

    def apply(self, x: Tensor, offsets: Tensor) -> Tensor:
        p, (height, width) = self.padding, x.shape[-2:]
        padded = F.pad(x, (p, p, p, p))
        offsets = offsets.to(x.device)
        rows = offsets[:, :1] + torch.arange(height, device=x.device)  # [B, H]
        cols = offsets[:, 1:] + torch.arange(width, device=x.device)  # [B, W]
        batch = torch.arange(len(x), device=x.device)[:, None, None]
        # Advanced indices split by a slice put their dimensions first: [B, H, W, ch].
        return padded[batch, :, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)


@dataclass(frozen=True)
class RandomResizedCrop(_Augmentation):
    """Crop a random box of ``scale`` of the area and ``ratio`` aspect, resize to ``H x W``.

    Unlike torchvision, which retries a box that does not fit ten times and then falls back
    to a centre crop, a box wider or taller than the image is clipped to it.
    """

    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)

    def params(self, batch: int, generator: torch.Generator) -> Tensor:
        """float64 ``[B, 2, 3]``: the crop as an affine map, output -> input in [-1, 1]."""
        area = _uniform(generator, batch, *self.scale)
        log_ratio = _uniform(generator, batch, math.log(self.ratio[0]), math.log(self.ratio[1]))
        aspect = log_ratio.exp()
        width = (area * aspect).sqrt().clamp(max=1.0)  # fractions of the image side
        height = (area / aspect).sqrt().clamp(max=1.0)
        cx = _uniform(generator, batch, -1.0, 1.0) * (1 - width)
        cy = _uniform(generator, batch, -1.0, 1.0) * (1 - height)
        zero = torch.zeros_like(width)
        rows = [torch.stack([width, zero, cx], -1), torch.stack([zero, height, cy], -1)]
        return torch.stack(rows, 1)

    def apply(self, x: Tensor, theta: Tensor) -> Tensor:
        return affine_resample(x, theta)


@dataclass(frozen=True)
class HorizontalFlip(_Augmentation):
    """Mirror each image left-right with probability ``p``."""

    p: float = 0.5

    def params(self, batch: int, generator: torch.Generator) -> Tensor:
        """bool ``[B]``: which images flip."""
        return _uniform(generator, batch, 0.0, 1.0) < self.p

    def apply(self, x: Tensor, flip: Tensor) -> Tensor:
        return torch.where(flip.to(x.device)[:, None, None, None], x.flip(-1), x)


@dataclass(frozen=True)
class ColorJitter(_Augmentation):
    """Scale brightness, contrast and saturation by factors from ``U(1 - s, 1 + s)``.

    Applied in that order, each clamped to [0, 1] as torchvision's ``ColorJitter``: brightness
    scales the pixels; contrast blends with the image's mean gray level; saturation blends
    with the image's grayscale (nothing to do on one channel).
    """

    brightness: float = 0.4
    contrast: float = 0.4
    saturation: float = 0.4

    def params(self, batch: int, generator: torch.Generator) -> Tensor:
        """float64 ``[B, 3]``: brightness, contrast and saturation factors."""
        factors = [_uniform(generator, batch, 1 - s, 1 + s) for s in self._strengths()]
        return torch.stack(factors, -1)

    def _strengths(self) -> tuple[float, float, float]:
        return (self.brightness, self.contrast, self.saturation)

    def apply(self, x: Tensor, factors: Tensor) -> Tensor:
        f = factors.to(device=x.device, dtype=x.dtype)[:, :, None, None, None]  # [B, 3, 1, 1, 1]
        x = (x * f[:, 0]).clamp(0, 1)
        mean = _gray(x).mean(dim=(-3, -2, -1), keepdim=True)
        x = (f[:, 1] * x + (1 - f[:, 1]) * mean).clamp(0, 1)
        if x.shape[1] == 3:
            x = (f[:, 2] * x + (1 - f[:, 2]) * _gray(x)).clamp(0, 1)
        return x


def _gray(x: Tensor) -> Tensor:
    """``[B, 1, H, W]``: luma of RGB images, or the single channel itself."""
    if x.shape[1] != 3:
        return x
    weights = torch.tensor(_GRAY, dtype=x.dtype, device=x.device)
    return (x * weights[:, None, None]).sum(1, keepdim=True)


@dataclass(frozen=True)
class SmallAffine(_Augmentation):
    """A small random rotation, shear, scale and shift, bilinear, zero outside.

    The forward map is ``p -> R(angle) Sh(shear) S(scale) p + shift`` about the image
    centre (shift in fractions of the half-side); the image is resampled through its
    inverse.
    """

    degrees: float = 10.0
    shear: float = 10.0
    scale: tuple[float, float] = (0.9, 1.1)
    translate: float = 0.1

    def params(self, batch: int, generator: torch.Generator) -> Tensor:
        """float64 ``[B, 2, 3]``: the inverse map, output -> input in [-1, 1]."""
        angle = _uniform(generator, batch, -self.degrees, self.degrees).deg2rad()
        shear = _uniform(generator, batch, -self.shear, self.shear).deg2rad().tan()
        scale = _uniform(generator, batch, *self.scale)
        shift = torch.stack(
            [_uniform(generator, batch, -self.translate, self.translate) for _ in range(2)], -1
        )
        cos, sin = angle.cos(), angle.sin()
        zero, one = torch.zeros_like(angle), torch.ones_like(angle)
        rotate = torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], 1)
        skew = torch.stack([torch.stack([one, shear], -1), torch.stack([zero, one], -1)], 1)
        forward = rotate @ skew * scale[:, None, None]
        inverse = torch.linalg.inv(forward)
        return torch.cat([inverse, -(inverse @ shift[:, :, None])], dim=2)

    def apply(self, x: Tensor, theta: Tensor) -> Tensor:
        return affine_resample(x, theta)


@dataclass(frozen=True)
class Compose:
    """Apply ``steps`` in order, each drawing from the same generator."""

    steps: Sequence[Augmentation]

    def __call__(self, x: Tensor, generator: torch.Generator) -> Tensor:
        for step in self.steps:
            x = step(x, generator)
        return x


def standard_augmentation(kind: str, *, padding: int = 8) -> Augmentation | None:
    """The usual training augmentation for a kind of data (None for ``"none"``).

    Args:
        kind: ``"pad-crop"`` (`PadCrop`, flip, jitter: mini-/tiered-ImageNet, CIFAR-FS,
            FC100), ``"resized-crop"`` (`RandomResizedCrop`, flip, jitter: CUB),
            ``"character"`` (`SmallAffine`: Omniglot) or ``"none"``.
        padding: of `PadCrop` (8 for 84x84 images, 4 for CIFAR's 32x32).
    """
    if kind == "none":
        return None
    natural = (HorizontalFlip(), ColorJitter())
    if kind == "pad-crop":
        return Compose((PadCrop(padding), *natural))
    if kind == "resized-crop":
        return Compose((RandomResizedCrop(), *natural))
    if kind == "character":
        return SmallAffine()
    raise ValueError(f"augmentation {kind!r}; choose one of {', '.join(AUGMENTATION_KINDS)}")
