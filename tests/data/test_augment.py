"""Augmentations against slow per-pixel references in float64, and their parameter draws.

Each augmentation's `apply` is checked against an obvious loop over images and pixels for
the parameters its `params` drew; the draws are checked for their ranges and for being the
same under the same seed.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from metalearn.data import (
    ColorJitter,
    Compose,
    HorizontalFlip,
    PadCrop,
    RandomResizedCrop,
    SmallAffine,
    standard_augmentation,
)


def _images(batch=4, channels=3, size=7, seed=0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(batch, channels, size, size, generator=generator, dtype=torch.float64)


def _bilinear_reference(image: np.ndarray, theta: np.ndarray) -> np.ndarray:
    """Sample ``image [ch, H, W]`` at ``theta`` (output -> input, [-1, 1], pixel centres)."""
    channels, height, width = image.shape
    out = np.zeros_like(image)
    for i in range(height):
        for j in range(width):
            x, y = (2 * j + 1) / width - 1, (2 * i + 1) / height - 1
            u, v = theta @ np.array([x, y, 1.0])
            px, py = ((u + 1) * width - 1) / 2, ((v + 1) * height - 1) / 2
            x0, y0 = math.floor(px), math.floor(py)
            for dy, dx in ((0, 0), (0, 1), (1, 0), (1, 1)):
                weight = (1 - abs(px - x0 - dx)) * (1 - abs(py - y0 - dy))
                if 0 <= y0 + dy < height and 0 <= x0 + dx < width:  # zeros outside
                    out[:, i, j] += weight * image[:, y0 + dy, x0 + dx]
    return out


@pytest.mark.parametrize("augmentation", [RandomResizedCrop(), SmallAffine(degrees=30)])
def test_affine_augmentations_equal_bilinear_sampling(augmentation):
    x = _images()
    theta = augmentation.params(len(x), torch.Generator().manual_seed(1))
    out = augmentation.apply(x, theta)
    for image, t, got in zip(x.numpy(), theta.numpy(), out.numpy()):
        np.testing.assert_allclose(got, _bilinear_reference(image, t), atol=1e-12)


def test_resized_crop_boxes_lie_inside_with_the_asked_area():
    theta = RandomResizedCrop(scale=(0.2, 0.6)).params(2000, torch.Generator().manual_seed(0))
    width, height, cx, cy = theta[:, 0, 0], theta[:, 1, 1], theta[:, 0, 2], theta[:, 1, 2]
    assert bool(
        ((cx.abs() + width) <= 1 + 1e-12).all() and ((cy.abs() + height) <= 1 + 1e-12).all()
    )
    inside = (width < 1) & (height < 1)  # boxes not clipped to the image keep their area
    area = (width * height)[inside]
    assert (
        bool(((area >= 0.2 - 1e-12) & (area <= 0.6 + 1e-12)).all()) and inside.float().mean() > 0.9
    )
    identity = RandomResizedCrop(scale=(1.0, 1.0), ratio=(1.0, 1.0))
    x = _images()
    torch.testing.assert_close(identity(x, torch.Generator().manual_seed(0)), x, rtol=0, atol=1e-12)


def test_small_affine_draws_a_bounded_rotation_shear_scale_and_shift():
    augmentation = SmallAffine(degrees=10, shear=10, scale=(0.9, 1.1), translate=0.1)
    theta = augmentation.params(1000, torch.Generator().manual_seed(0))
    forward = torch.linalg.inv(theta[:, :, :2])
    determinant = torch.linalg.det(forward)  # rotation and shear keep area: scale ** 2
    assert bool(((determinant >= 0.81 - 1e-9) & (determinant <= 1.21 + 1e-9)).all())
    shift = -(theta[:, :, :2].inverse() @ theta[:, :, 2:]).squeeze(-1)
    assert bool((shift.abs() <= 0.1 + 1e-12).all()) and shift.abs().max() > 0.09
    none = SmallAffine(degrees=0, shear=0, scale=(1, 1), translate=0)
    x = _images()
    torch.testing.assert_close(none(x, torch.Generator().manual_seed(0)), x, rtol=0, atol=1e-12)


def test_pad_crop_equals_padding_and_slicing():
    x = _images(batch=6)
    augmentation = PadCrop(padding=2)
    offsets = augmentation.params(len(x), torch.Generator().manual_seed(0))
    assert bool(((offsets >= 0) & (offsets <= 4)).all())
    out = augmentation.apply(x, offsets)
    for image, (top, left), got in zip(x.numpy(), offsets.tolist(), out.numpy()):
        padded = np.pad(image, ((0, 0), (2, 2), (2, 2)))
        assert np.array_equal(got, padded[:, top : top + 7, left : left + 7])


def test_flip_mirrors_the_drawn_images():
    x = _images(batch=8)
    flip = HorizontalFlip().params(len(x), torch.Generator().manual_seed(2))
    assert 0 < int(flip.sum()) < 8
    out = HorizontalFlip().apply(x, flip)
    for image, flipped, got in zip(x.numpy(), flip.tolist(), out.numpy()):
        assert np.array_equal(got, image[:, :, ::-1] if flipped else image)


@pytest.mark.parametrize("channels", [3, 1])
def test_color_jitter_equals_the_per_pixel_formulas(channels):
    x = _images(channels=channels)
    jitter = ColorJitter(brightness=0.5, contrast=0.5, saturation=0.5)
    factors = jitter.params(len(x), torch.Generator().manual_seed(0))
    assert bool(((factors >= 0.5) & (factors <= 1.5)).all())
    out = jitter.apply(x, factors)
    for image, (b, c, s), got in zip(x.numpy(), factors.tolist(), out.numpy()):
        gray = lambda im: (  # noqa: E731
            0.299 * im[0] + 0.587 * im[1] + 0.114 * im[2] if channels == 3 else im[0]
        )
        ref = np.clip(image * b, 0, 1)
        ref = np.clip(c * ref + (1 - c) * gray(ref).mean(), 0, 1)
        if channels == 3:
            ref = np.clip(s * ref + (1 - s) * gray(ref)[None], 0, 1)
        np.testing.assert_allclose(got, ref, atol=1e-12)


@pytest.mark.parametrize("kind", ["pad-crop", "resized-crop", "character"])
def test_presets_are_reproducible_change_images_and_keep_shapes(kind):
    augmentation = standard_augmentation(kind, padding=1)
    x = _images(channels=1 if kind == "character" else 3).float()
    one = augmentation(x, torch.Generator().manual_seed(3))
    two = augmentation(x, torch.Generator().manual_seed(3))
    other = augmentation(x, torch.Generator().manual_seed(4))
    assert one.shape == x.shape and one.dtype == x.dtype
    assert torch.equal(one, two) and not torch.equal(one, other) and not torch.equal(one, x)
    assert 0 <= float(one.min()) and float(one.max()) <= 1


def test_presets_and_refusals():
    assert standard_augmentation("none") is None
    natural = standard_augmentation("pad-crop", padding=4)
    assert isinstance(natural, Compose) and natural.steps[0] == PadCrop(4)
    with pytest.raises(ValueError, match="augmentation 'mixup'; choose one of none, pad-crop"):
        standard_augmentation("mixup")
    with pytest.raises(ValueError, match=r"floating images \[B, ch, H, W\], got torch.uint8"):
        PadCrop()(torch.zeros(2, 1, 4, 4, dtype=torch.uint8), torch.Generator())
    with pytest.raises(ValueError, match="expected a torch.Generator, got int"):
        HorizontalFlip()(torch.zeros(2, 1, 4, 4), 0)
