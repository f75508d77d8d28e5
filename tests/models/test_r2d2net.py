"""R2-D2's encoder (`metalearn.models.R2D2Net`) against its layers written out in plain
torch.nn as ``bertinetto/r2d2``'s ``RRFeatures`` composes them (conv, batch norm, max-pool,
leaky ReLU, dropout; block 3 pooled again and concatenated with block 4), with the same
weights: the same features and logits, in training and with dropout."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from metalearn.models import R2D2Net, build_backbone
from metalearn.models.r2d2net import r2d2_feature_size, r2d2_widths


class WrittenOut(nn.Module):
    """The reference's blocks, each an nn.Sequential, and its forward."""

    def __init__(self, in_channels: int, widths: tuple[int, ...], slope: float, drop: float):
        super().__init__()
        channels = (in_channels, *widths)

        def block(i: int, stride: int, dropout: bool) -> nn.Sequential:
            layers = [nn.Conv2d(channels[i], channels[i + 1], 3, padding=1),
                      nn.BatchNorm2d(channels[i + 1], momentum=0.1),
                      nn.MaxPool2d(2, stride=stride), nn.LeakyReLU(slope)]  # fmt: skip
            return nn.Sequential(*layers, *([nn.Dropout(drop)] if dropout else []))

        self.blocks = nn.ModuleList([block(0, 2, False), block(1, 2, False), block(2, 2, True),
                                     block(3, 1, True)])  # fmt: skip
        self.pool3 = nn.MaxPool2d(2, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks[:3]:
            x = b(x)
        x3 = self.pool3(x).view(x.size(0), -1)
        x4 = self.blocks[3](x).view(x.size(0), -1)
        return torch.cat((x3, x4), 1)


def copied(model: R2D2Net, ref: WrittenOut) -> WrittenOut:
    with torch.no_grad():
        for i, b in enumerate(ref.blocks):
            b[0].weight.copy_(model.features.convs[i].weight)
            b[0].bias.copy_(model.features.convs[i].bias)
            b[1].weight.copy_(torch.rand_like(b[1].weight) + 0.5)  # not the identity
            b[1].bias.copy_(torch.randn_like(b[1].bias))
            model.features.norms[i].weight.copy_(b[1].weight)
            model.features.norms[i].bias.copy_(b[1].bias)
    return ref


def test_the_reference_widths_and_feature_sizes():
    # bertinetto/r2d2 train.py: model.out_dim 1536 + 2048 (Omniglot), 31104 + 41472 (mini).
    assert r2d2_widths(64) == (96, 192, 384, 512)
    assert r2d2_feature_size(28, r2d2_widths(64)) == 1536 + 2048
    assert r2d2_feature_size(84, r2d2_widths(64)) == 31104 + 41472
    model = build_backbone("rrnet", in_channels=1, ways=5, hidden=64, image_size=28)
    assert model.head.in_features == 3584
    assert model(torch.randn(3, 1, 28, 28)).shape == (3, 5)
    with pytest.raises(ValueError, match="image_size 12: R2-D2's encoder needs at least 16"):
        R2D2Net(image_size=12)
    with pytest.raises(ValueError, match="built for 28x28 images"):
        model(torch.randn(3, 1, 84, 84))
    with pytest.raises(ValueError, match="pass image_size"):
        build_backbone("rrnet", in_channels=1, ways=5, hidden=64)


@pytest.mark.parametrize(("image_size", "drop"), [(28, 0.0), (84, 0.0), (32, 0.3)])
def test_equals_the_written_out_layers_with_the_same_weights(image_size, drop):
    torch.manual_seed(0)
    widths = r2d2_widths(8)  # 12-24-48-64: the layers, not the width, are under test
    model = R2D2Net(in_channels=3, ways=4, image_size=image_size, widths=widths,
                    dropout=drop).double()  # fmt: skip
    ref = copied(model, WrittenOut(3, widths, 0.1, drop).double())
    x = torch.randn(6, 3, image_size, image_size, dtype=torch.float64)
    torch.manual_seed(1)
    ours = model.features(x)
    torch.manual_seed(1)
    theirs = ref(x)
    assert ours.shape == (6, r2d2_feature_size(image_size, widths))
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    logits = model(x) if drop == 0 else None
    if logits is not None:
        torch.testing.assert_close(logits, theirs @ model.head.weight.T + model.head.bias)
    if drop:  # dropout acts: another draw gives other features
        assert not torch.allclose(model.features(x), ours)
