"""The backbones a run names: Conv4 or ResNet-12, built from a recipe's model settings."""

from __future__ import annotations

from typing import Literal

from torch import nn

from metalearn.models.conv4 import Conv4
from metalearn.models.resnet12 import ResNet12

__all__ = ["BACKBONES", "Backbone", "build_backbone"]

BACKBONES = ("conv4", "resnet12")
Backbone = Literal["conv4", "resnet12"]


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
) -> nn.Module:
    """A fresh backbone (weights from torch's global generator: seed first).

    Args:
        backbone: ``"conv4"`` or ``"resnet12"``.
        in_channels: image channels.
        ways: classes of the linear head.
        hidden: Conv4's filters per block; ResNet-12's first stage width, the stages being
            ``(h, 2.5h, 5h, 10h)`` (64 gives the usual 64-160-320-640).
        pool, head, image_size, activation: Conv4's down-sampling, classifier input, image
            side and nonlinearity (`Conv4`); ResNet-12 takes none of them.

    Returns:
        A model mapping ``[B, in_channels, S, S]`` to logits ``[B, ways]``.

    Raises:
        ValueError: an unknown backbone, or an activation ResNet-12 does not take.
    """
    if backbone == "conv4":
        return Conv4(in_channels=in_channels, ways=ways, hidden=hidden, pool=pool, head=head,
                     image_size=image_size, activation=activation)  # fmt: skip
    if backbone == "resnet12":
        if activation != "relu":
            raise ValueError(f"activation {activation!r} is a setting of conv4; ResNet-12 "
                             "has its own (drop --activation)")  # fmt: skip
        widths = (hidden, hidden * 5 // 2, hidden * 5, hidden * 10)
        return ResNet12(in_channels=in_channels, ways=ways, widths=widths)
    raise ValueError(f"backbone {backbone!r}; choose one of {', '.join(BACKBONES)}")
