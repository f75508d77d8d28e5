"""R2-D2's encoder (Bertinetto et al., 2019): four wide conv blocks whose last two feature
maps are concatenated into the features."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metalearn.models.norm import MetaBatchNorm, normalise

__all__ = ["R2D2Features", "R2D2Net", "r2d2_feature_size", "r2d2_widths"]


def r2d2_widths(hidden: int) -> tuple[int, int, int, int]:
    """The four blocks' filters for ``--hidden h``: ``(1.5h, 3h, 6h, 8h)``, so 64 gives the
    reference's 96-192-384-512 (``bertinetto/r2d2``, ``load_model.py``, ``RRNet``)."""
    return (hidden * 3 // 2, hidden * 3, hidden * 6, hidden * 8)


def r2d2_feature_size(image_size: int, widths: Sequence[int]) -> int:
    """Features of a ``image_size`` square image: block 3's map max-pooled 2x2 at stride 1,
    and block 4's (pooled 2x2 at stride 1), flattened and concatenated.

    28 (Omniglot) gives 384 * 2 * 2 + 512 * 2 * 2 = 3584 at the reference's widths; 84
    (mini-ImageNet) 384 * 9 * 9 + 512 * 9 * 9 = 72,576 (its ``model.out_dim``, ``train.py``).

    Raises:
        ValueError: an image too small to leave a position after the four blocks.
    """
    side = image_size // 2 // 2 // 2  # blocks 1-3: 2x2 max-pool at stride 2
    if side < 2:
        raise ValueError(f"image_size {image_size}: R2-D2's encoder needs at least 16 pixels "
                         "a side (three halvings, then 2x2 pools at stride 1)")  # fmt: skip
    return (widths[2] + widths[3]) * (side - 1) ** 2


class R2D2Features(nn.Module):
    """R2-D2's four blocks and its concatenated features (`R2D2Net`'s ``features``).

    Shape:
        ``[B, in_channels, image_size, image_size] -> [B, r2d2_feature_size(...)]``.
    """

    def __init__(self, in_channels: int, image_size: int, widths: tuple[int, ...],
                 negative_slope: float, dropout: float,
                 norm_layer: Callable[[int], nn.Module]) -> None:  # fmt: skip
        super().__init__()
        self.image_size, self.negative_slope, self.dropout = image_size, negative_slope, dropout
        channels = (in_channels, *widths)
        self.convs = nn.ModuleList(
            nn.Conv2d(c_in, c_out, 3, padding=1) for c_in, c_out in zip(channels, widths)
        )
        self.norms = nn.ModuleList(norm_layer(c) for c in widths)

    def _block(self, x: Tensor, index: int, norm_rows: int | None) -> Tensor:
        x = normalise(self.norms[index], self.convs[index](x), norm_rows)
        x = F.max_pool2d(x, 2, stride=1 if index == 3 else 2)
        x = F.leaky_relu(x, self.negative_slope)
        if index >= 2 and self.dropout > 0:  # the reference's dropout closes blocks 3, 4
            x = F.dropout(x, self.dropout, self.training)
        return x

    def forward(self, x: Tensor, norm_rows: int | None = None) -> Tensor:
        """``norm_rows``: batch norm takes its statistics from the first rows alone
        (`metalearn.models.norm.normalise`); None: from the whole batch."""
        if x.dim() != 4 or tuple(x.shape[-2:]) != (self.image_size, self.image_size):
            raise ValueError(f"R2D2Net was built for {self.image_size}x{self.image_size} images "
                             f"[B, C, H, W], got shape {tuple(x.shape)}")  # fmt: skip
        for index in range(3):
            x = self._block(x, index, norm_rows)
        third = F.max_pool2d(x, 2, stride=1).flatten(1)
        return torch.cat((third, self._block(x, 3, norm_rows).flatten(1)), 1)


class R2D2Net(nn.Module):
    """R2-D2's encoder and a linear head on its features.

    Each block is 3x3 conv (padding 1, with bias) -> batch norm -> 2x2 max-pool (stride 2;
    block 4: stride 1) -> leaky ReLU (slope 0.1), blocks 3 and 4 then dropout; the features
    are block 3's output max-pooled 2x2 at stride 1 and block 4's output, each flattened
    (channel-major) and concatenated, as ``RRFeatures.forward`` (``bertinetto/r2d2``,
    ``fewshots/models/load_model.py``). Weights start at torch's defaults, as there.

    Dropout acts in training mode only, as ``nn.Dropout`` there: metalearn evaluates under
    `metalearn.models.evaluation_mode` (the reference calls ``model.eval()``). Under vmap each
    task draws its own masks (the engine's ``randomness="different"``), from torch's global
    generator, which a run's checkpoint keeps.

    Departure: batch norm is the transductive `MetaBatchNorm` (the reference's
    ``BatchNorm2d`` keeps running statistics for evaluation).

    Args:
        in_channels: image channels.
        ways: classes of the linear head.
        image_size: side of the square images (the head is sized for it and accepts only it).
        widths: the four blocks' filters (`r2d2_widths`: 96-192-384-512 for hidden 64).
        negative_slope: the leaky ReLU's slope (the reference's ``model.lrelu`` 0.1).
        dropout: probability of blocks 3 and 4's dropout (the reference's ``model.drop``:
            0 for Omniglot, 0.1 mini-ImageNet, 0.4 CIFAR-FS; 0, no dropout, by default).
        norm_layer: builds the normalisation from the channel count.

    Shape:
        ``[B, in_channels, image_size, image_size] -> [B, ways]`` (logits).
    """

    def __init__(
        self,
        in_channels: int = 3,
        ways: int = 5,
        image_size: int = 84,
        widths: Sequence[int] = (96, 192, 384, 512),
        negative_slope: float = 0.1,
        dropout: float = 0.0,
        norm_layer: Callable[[int], nn.Module] = MetaBatchNorm,
    ) -> None:
        super().__init__()
        widths = tuple(widths)
        if len(widths) != 4 or any(w < 1 for w in widths):
            raise ValueError(f"widths must be four positive channel counts, got {widths}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"--dropout {dropout}: a probability in [0, 1) (0: none)")
        size = r2d2_feature_size(image_size, widths)
        self.features = R2D2Features(in_channels, image_size, widths, negative_slope, dropout,
                                     norm_layer)  # fmt: skip
        self.head = nn.Linear(size, ways)

    def forward(self, x: Tensor, norm_rows: int | None = None) -> Tensor:
        """Logits ``[B, ways]``; ``norm_rows`` as for `metalearn.models.Conv4`."""
        return self.head(self.features(x, norm_rows))
