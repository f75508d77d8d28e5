"""ResNet-12, the residual backbone of modern few-shot learning, and its `ResidualBlock`."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from metalearn.models.norm import MetaBatchNorm, normalise

__all__ = ["ResNet12", "ResidualBlock"]


class ResidualBlock(nn.Module):
    """Three 3x3 convs with batch norm, a 1x1 shortcut, leaky ReLU and a 2x2 max-pool.

    ``conv1 -> norm1 -> lrelu -> conv2 -> norm2 -> lrelu -> conv3 -> norm3``, plus
    ``shortcut_norm(shortcut(x))``, then leaky ReLU and max-pool, as in MetaOptNet's
    ResNet-12 (Lee et al., 2019). Convolutions have no bias (batch norm follows each).

    Args:
        in_channels: input channels.
        out_channels: filters of every convolution in the block.
        norm_layer: builds the normalisation from the channel count; `MetaBatchNorm` by
            default, which is right under vmapped second order.
        negative_slope: slope of the leaky ReLU for negative inputs.

    Shape:
        ``[N, in_channels, H, W] -> [N, out_channels, H // 2, W // 2]``.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        norm_layer: Callable[[int], nn.Module] = MetaBatchNorm,
        negative_slope: float = 0.1,
    ) -> None:
        super().__init__()
        self.negative_slope = negative_slope
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1, bias=False)
        self.norm1 = norm_layer(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.norm2 = norm_layer(out_channels)
        self.conv3 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.norm3 = norm_layer(out_channels)
        self.shortcut = nn.Conv2d(in_channels, out_channels, 1, bias=False)
        self.shortcut_norm = norm_layer(out_channels)

    def forward(self, x: Tensor, norm_rows: int | None = None) -> Tensor:
        """``norm_rows``: batch norm takes its statistics from the first rows alone
        (`metalearn.models.norm.normalise`); None: from the whole batch."""
        slope, rows = self.negative_slope, norm_rows
        out = F.leaky_relu(normalise(self.norm1, self.conv1(x), rows), slope)
        out = F.leaky_relu(normalise(self.norm2, self.conv2(out), rows), slope)
        out = normalise(self.norm3, self.conv3(out), rows)
        out = F.leaky_relu(out + normalise(self.shortcut_norm, self.shortcut(x), rows), slope)
        return F.max_pool2d(out, 2)


class ResNet12(nn.Module):
    """ResNet-12 (Oreshkin et al., 2018; Lee et al., 2019): four `ResidualBlock`s, global
    average pooling and a linear head.

    Widths 64-160-320-640 by default; an 84x84 image shrinks 42 -> 21 -> 10 -> 5 and the
    640 channels are averaged over the 5x5 positions. There is no DropBlock (MetaOptNet
    trains with it): the model holds no randomness, so a task's loss is a function of the
    parameters alone, as the exact second-order tools assume. Batch norm is the
    transductive, elementary `MetaBatchNorm` (no running statistics, see `batch_norm`).
    At the default widths with 3 input channels and 5 ways the model has 12,427,525
    parameters (12,424,320 in the features).

    Convolutions start Kaiming-normal for the leaky ReLU (fan out, as in MetaOptNet), the
    head Xavier-uniform with zero bias, batch norm at weight 1, bias 0.

    Args:
        in_channels: image channels.
        ways: number of classes, the size of the output.
        widths: output channels of the four blocks.
        norm_layer: normalisation in the blocks, `MetaBatchNorm` by default.
        negative_slope: slope of the leaky ReLU for negative inputs.

    Shape:
        ``[B, in_channels, H, W] -> [B, ways]`` (logits), ``H, W >= 16``.
    """

    def __init__(
        self,
        in_channels: int = 3,
        ways: int = 5,
        widths: Sequence[int] = (64, 160, 320, 640),
        norm_layer: Callable[[int], nn.Module] = MetaBatchNorm,
        negative_slope: float = 0.1,
    ) -> None:
        super().__init__()
        widths = tuple(widths)
        if len(widths) != 4 or any(w < 1 for w in widths):
            raise ValueError(
                f"widths must be four positive channel counts, got {widths}; "
                "the standard ResNet-12 uses (64, 160, 320, 640)"
            )
        for name, value in (("in_channels", in_channels), ("ways", ways)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        channels = (in_channels, *widths)
        self.features = nn.Sequential(
            *(
                ResidualBlock(c_in, c_out, norm_layer, negative_slope)
                for c_in, c_out in zip(channels[:-1], channels[1:])
            )
        )
        self.head = nn.Linear(widths[-1], ways)
        _init(self, negative_slope)

    def forward(self, x: Tensor, norm_rows: int | None = None) -> Tensor:
        """Logits ``[B, ways]``; ``norm_rows`` as for `metalearn.models.Conv4`."""
        if x.dim() != 4 or min(x.shape[-2:]) < 16:
            raise ValueError(
                f"ResNet12 expects images [B, C, H, W] with H, W >= 16 (four 2x2 pools), got "
                f"shape {tuple(x.shape)}; add the channel dimension with x.unsqueeze(1) or "
                "resize the images"
            )
        for block in self.features:
            x = block(x, norm_rows)
        return self.head(x.mean((-2, -1)))


def _init(model: nn.Module, negative_slope: float) -> None:
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(
                module.weight, a=negative_slope, mode="fan_out", nonlinearity="leaky_relu"
            )
        elif isinstance(module, nn.Linear):
            nn.init.xavier_uniform_(module.weight)
            nn.init.zeros_(module.bias)
