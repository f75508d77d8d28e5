"""The backbones a run names: Conv4, ResNet-12 or R2-D2's encoder, built from a recipe's
model settings."""

from __future__ import annotations

from typing import Literal

from torch import nn

from metalearn.models.conv4 import Conv4
from metalearn.models.r2d2net import R2D2Net, r2d2_widths
from metalearn.models.resnet12 import ResNet12

__all__ = ["BACKBONES", "Backbone", "build_backbone", "sized_by_image"]

BACKBONES = ("conv4", "resnet12", "rrnet")
Backbone = Literal["conv4", "resnet12", "rrnet"]


def sized_by_image(backbone: str, head: str = "mean") -> bool:
    """Whether the backbone's head is sized for one image side (it needs ``image_size``):
    R2-D2's encoder, and Conv4 with ``head="flatten"``."""
    return backbone == "rrnet" or (backbone == "conv4" and head == "flatten")


def build_backbone(
    backbone: str,
    *,
    in_channels: int,
    ways: int,
    hidden: int,
    pool: Literal["stride", "max"] = "stride",
    head: Literal["mean", "flatten"] = "mean",
    image_size: int | None = None,
    activation: Literal["relu", "leaky_relu"] = "relu",
    dropout: float = 0.0,
) -> nn.Module:
    """A fresh backbone (weights from torch's global generator: seed first).

    Args:
        backbone: ``"conv4"``, ``"resnet12"`` or ``"rrnet"`` (`R2D2Net`).
        in_channels: image channels.
        ways: classes of the linear head.
        hidden: Conv4's filters per block; ResNet-12's first stage width, the stages being
            ``(h, 2.5h, 5h, 10h)`` (64 gives the usual 64-160-320-640); R2-D2's
            `r2d2_widths` ``(1.5h, 3h, 6h, 8h)`` (64 gives its 96-192-384-512).
        pool, head, image_size, activation: Conv4's down-sampling, classifier input, image
            side and nonlinearity (`Conv4`); ResNet-12 takes none of them, R2-D2's encoder
            the image side.
        dropout: R2-D2's encoder only: the dropout after its blocks 3 and 4 (`R2D2Net`).

    Returns:
        A model mapping ``[B, in_channels, S, S]`` to logits ``[B, ways]``.

    Raises:
        ValueError: an unknown backbone, an activation ResNet-12 or R2-D2's encoder does
            not take, dropout for a backbone other than R2-D2's, or R2-D2's without
            ``image_size``.
    """
    if backbone != "rrnet" and dropout != 0.0:
        raise ValueError(f"--dropout {dropout}: only backbone rrnet (R2-D2's encoder) has "
                         f"dropout, {backbone} has none; drop --dropout or pass --backbone "
                         "rrnet")  # fmt: skip
    if backbone == "conv4":
        return Conv4(in_channels=in_channels, ways=ways, hidden=hidden, pool=pool, head=head,
                     image_size=image_size, activation=activation)  # fmt: skip
    if backbone != "conv4" and activation != "relu":
        raise ValueError(f"activation {activation!r} is a setting of conv4; {backbone} has "
                         "its own (drop --activation)")  # fmt: skip
    if backbone == "resnet12":
        widths = (hidden, hidden * 5 // 2, hidden * 5, hidden * 10)
        return ResNet12(in_channels=in_channels, ways=ways, widths=widths)
    if backbone == "rrnet":
        if image_size is None:
            raise ValueError("backbone 'rrnet' sizes its head from the image: pass image_size")
        return R2D2Net(in_channels=in_channels, ways=ways, image_size=image_size,
                       widths=r2d2_widths(hidden), dropout=dropout)  # fmt: skip
    raise ValueError(f"backbone {backbone!r}; choose one of {', '.join(BACKBONES)}")
