"""The Conv4 backbone of MAML (Omniglot and mini-ImageNet) and its `ConvBlock`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor, nn

from metalearn.models.norm import MetaBatchNorm, normalise

__all__ = ["ACTIVATIONS", "Activation", "Conv4", "ConvBlock", "conv4_output_size"]


Activation = Literal["relu", "leaky_relu"]
ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": torch.relu,
    "leaky_relu": nn.functional.leaky_relu,  # slope 0.01, as the MAML++ reference's F.leaky_relu
}
"""The blocks' nonlinearities by name: MAML's ReLU, MAML++'s leaky ReLU."""


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
        activation: ``"relu"`` or ``"leaky_relu"`` (negative slope 0.01).

    Shape:
        ``[N, in_channels, H, W] -> [N, out_channels, H', W']``.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        pool: Literal["stride", "max"] = "stride",
        norm_layer: Callable[[int], nn.Module] = MetaBatchNorm,
        activation: Activation = "relu",
    ) -> None:
        super().__init__()
        if pool not in ("stride", "max"):
            raise ValueError(f"pool must be 'stride' or 'max', got {pool!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got "
                             f"{activation!r}")  # fmt: skip
        stride = 2 if pool == "stride" else 1
        self.conv = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1)
        self.norm = norm_layer(out_channels)
        self.activation = activation
        self.pool = nn.MaxPool2d(2) if pool == "max" else nn.Identity()

    def forward(self, x: Tensor, norm_rows: int | None = None) -> Tensor:
        """``norm_rows``: batch norm takes its statistics from the first rows alone
        (`metalearn.models.norm.normalise`); None: from the whole batch."""
        h = normalise(self.norm, self.conv(x), norm_rows)
        return self.pool(ACTIVATIONS[self.activation](h))


class Conv4(nn.Module):
    """The four-block convolutional backbone of MAML (Finn et al., 2017).

    Four `ConvBlock`s of ``hidden`` 3x3 filters, then a linear classifier on either the
    mean over the remaining spatial positions (``head="mean"``, the default) or all of them
    flattened (``head="flatten"``). With ``pool="stride"`` (MAML's Omniglot net) a 28x28
    input shrinks 14 -> 7 -> 4 -> 2; with ``pool="max"`` (the variant of Vinyals et al. and
    most later papers) 14 -> 7 -> 3 -> 1 at about 3x the compute. The default (hidden 64,
    5 ways, one input channel) has 112,261 parameters.

    MAML's mini-ImageNet network is ``Conv4(in_channels=3, ways=5, hidden=32, pool="max",
    head="flatten", image_size=84)``: 84 -> 42 -> 21 -> 10 -> 5, and the 5x5x32 = 800
    features go flattened (channel-major) into the linear head; 32,901 parameters.

    MAML++'s network (Antoniou et al., 2019; ``VGGReLUNormNetwork`` of its reference code
    with ``max_pooling`` and ``conv_padding``) is ``Conv4(hidden=64, pool="max",
    activation="leaky_relu")`` on Omniglot (48 filters and ``head="flatten"``,
    ``image_size=84`` on mini-ImageNet): 3x3 convolutions with bias, stride 1, padding 1,
    batch norm, leaky ReLU, 2x2 max-pool, then a linear layer on the flattened features.

    Conv and linear weights start Xavier-uniform with zero biases, as in MAML's code (and
    MAML++'s); batch norm starts at weight 1, bias 0.

    Args:
        in_channels: image channels (1 for Omniglot, 3 for mini-ImageNet).
        ways: number of classes, the size of the output.
        hidden: filters per convolution.
        pool: ``"stride"`` or ``"max"``, see `ConvBlock`.
        norm_layer: normalisation per block, `MetaBatchNorm` by default (see `ConvBlock`).
        activation: the blocks' nonlinearity, ``"relu"`` or ``"leaky_relu"``.
        head: ``"mean"`` (average the final positions: any image size) or ``"flatten"``
            (flatten them: the head is sized for ``image_size`` and accepts only it).
        image_size: input height and width (an int for square images); required by
            ``head="flatten"``, and checked to leave at least one position after the four
            blocks whichever the head.

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
        head: Literal["mean", "flatten"] = "mean",
        image_size: int | tuple[int, int] | None = None,
        activation: Activation = "relu",
    ) -> None:
        super().__init__()
        for name, value in (("in_channels", in_channels), ("ways", ways), ("hidden", hidden)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if head not in ("mean", "flatten"):
            raise ValueError(f"head must be 'mean' or 'flatten', got {head!r}")
        if head == "flatten" and image_size is None:
            raise ValueError(
                "head='flatten' sizes its linear layer from the input: pass image_size "
                "(e.g. image_size=84 for mini-ImageNet)"
            )
        self.head_kind = head
        self.image_size = None if image_size is None else _pair(image_size)
        self.features = nn.Sequential(  # first: ConvBlock refuses an unknown pool
            ConvBlock(in_channels, hidden, pool, norm_layer, activation),
            ConvBlock(hidden, hidden, pool, norm_layer, activation),
            ConvBlock(hidden, hidden, pool, norm_layer, activation),
            ConvBlock(hidden, hidden, pool, norm_layer, activation),
        )
        positions = 1
        if self.image_size is not None:
            out_h, out_w = conv4_output_size(self.image_size, pool)
            positions = out_h * out_w if head == "flatten" else 1
        self.head = nn.Linear(hidden * positions, ways)
        _maml_init(self)

    def forward(self, x: Tensor, norm_rows: int | None = None) -> Tensor:
        """Logits ``[B, ways]``; with ``norm_rows``, every batch norm normalises the batch
        with the statistics of its first ``norm_rows`` images (a support set's, for the
        query images after it)."""
        if x.dim() != 4:
            raise ValueError(
                f"Conv4 expects images [B, C, H, W], got shape {tuple(x.shape)}; "
                "add the channel dimension with x.unsqueeze(1) for grayscale"
            )
        if self.head_kind == "flatten" and tuple(x.shape[-2:]) != self.image_size:
            raise ValueError(
                f"Conv4 with head='flatten' was built for {self.image_size[0]}x"
                f"{self.image_size[1]} images, got {x.shape[-2]}x{x.shape[-1]}; resize the "
                "images or build the model with image_size set to their size"
            )
        features = x
        for block in self.features:
            features = block(features, norm_rows)
        if self.head_kind == "flatten":
            return self.head(features.flatten(1))
        return self.head(features.mean((-2, -1)))


def conv4_output_size(image_size: int | tuple[int, int], pool: str = "stride") -> tuple[int, int]:
    """Height and width of `Conv4`'s features for an input of ``image_size``.

    Each block halves: ``"stride"`` rounds up (stride-2 conv, padding 1), ``"max"`` rounds
    down (2x2 max-pool), so 84 gives 5 with ``"max"`` and 6 with ``"stride"``.

    Raises:
        ValueError: if the four blocks leave no position (e.g. under 16 pixels with
            ``"max"``), naming the smallest size that fits.
    """
    size = _pair(image_size)
    out = list(size)
    for _ in range(4):
        out = [(s + 1) // 2 if pool == "stride" else s // 2 for s in out]
    if min(out) < 1:
        smallest = 1 if pool == "stride" else 16
        raise ValueError(
            f"image_size {size[0]}x{size[1]} is too small for Conv4 with pool={pool!r}: four "
            f"blocks leave {out[0]}x{out[1]} positions; use images of at least "
            f"{smallest}x{smallest}"
        )
    return out[0], out[1]


def _pair(size: int | tuple[int, int]) -> tuple[int, int]:
    pair = (size, size) if isinstance(size, int) else tuple(size)
    if len(pair) != 2 or any(not isinstance(s, int) or s < 1 for s in pair):
        raise ValueError(f"image_size must be a positive int or (height, width), got {size!r}")
    return pair  # type: ignore[return-value]


def _maml_init(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
