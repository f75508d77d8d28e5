"""The Conv4 backbone of MAML on Omniglot and its `ConvBlock`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor, nn

from metalearn.models.norm import MetaBatchNorm

__all__ = ["Conv4", "ConvBlock"]


class ConvBlock(nn.Module):
    """3x3 conv -> batch norm -> ReLU (-> 2x2 max-pool), one block of `Conv4`.

    Args:
        in_channels: input channels.
        out_channels: filters of the 3x3 convolution.
        pool: ``"stride"`` (conv with stride 2, padding 1: halves H and W, rounding up) or
            ``"max"`` (conv with stride 1, padding 1, then 2x2 max-pool: halves, rounding
            down).
        norm_layer: builds the normalisation from the channel count; `MetaBatchNorm` by
            default. Pass e.g. ``lambda c: nn.BatchNorm2d(c, track_running_stats=False)``
            to compare against the fused kernel (not safe under vmapped second order).

    Shape:
        ``[N, in_channels, H, W] -> [N, out_channels, H', W']``.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        pool: Literal["stride", "max"] = "stride",
        norm_layer: Callable[[int], nn.Module] = MetaBatchNorm,
    ) -> None:
        super().__init__()
        if pool not in ("stride", "max"):
            raise ValueError(f"pool must be 'stride' or 'max', got {pool!r}")
        stride = 2 if pool == "stride" else 1
        self.conv = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1)
        self.norm = norm_layer(out_channels)
        self.pool = nn.MaxPool2d(2) if pool == "max" else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.pool(torch.relu(self.norm(self.conv(x))))


class Conv4(nn.Module):
    """The four-block convolutional backbone of MAML on Omniglot (Finn et al., 2017).

    Four `ConvBlock`s of ``hidden`` 3x3 filters, then the mean over the remaining spatial
    positions and a linear classifier. With ``pool="stride"`` (MAML's Omniglot net) a
    28x28 input shrinks 14 -> 7 -> 4 -> 2; with ``pool="max"`` (the variant of Vinyals et
    al. and most later papers) 14 -> 7 -> 3 -> 1 at about 3x the compute. The default
    (hidden 64, 5 ways, one input channel) has 112,261 parameters.

    Conv and linear weights start Xavier-uniform with zero biases, as in MAML's code; batch
    norm starts at weight 1, bias 0.

    Args:
        in_channels: image channels (1 for Omniglot, 3 for mini-ImageNet).
        ways: number of classes, the size of the output.
        hidden: filters per convolution.
        pool: ``"stride"`` or ``"max"``, see `ConvBlock`.
        norm_layer: normalisation per block, `MetaBatchNorm` by default (see `ConvBlock`).

    Shape:
        ``[B, in_channels, H, W] -> [B, ways]`` (logits).
    """

    def __init__(
        self,
        in_channels: int = 1,
        ways: int = 5,
        hidden: int = 64,
        pool: Literal["stride", "max"] = "stride",
        norm_layer: Callable[[int], nn.Module] = MetaBatchNorm,
    ) -> None:
        super().__init__()
        for name, value in (("in_channels", in_channels), ("ways", ways), ("hidden", hidden)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.features = nn.Sequential(
            ConvBlock(in_channels, hidden, pool, norm_layer),
            ConvBlock(hidden, hidden, pool, norm_layer),
            ConvBlock(hidden, hidden, pool, norm_layer),
            ConvBlock(hidden, hidden, pool, norm_layer),
        )
        self.head = nn.Linear(hidden, ways)
        _maml_init(self)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4:
            raise ValueError(
                f"Conv4 expects images [B, C, H, W], got shape {tuple(x.shape)}; "
                "add the channel dimension with x.unsqueeze(1) for grayscale"
            )
        return self.head(self.features(x).mean((-2, -1)))


def _maml_init(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
