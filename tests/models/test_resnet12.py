"""ResNet-12: shapes, the parameter count against the architecture's formula, a block
against a reference written from torch's fused ops, and the functional paths in float64
(vmapped meta-gradient against the loop, second order against finite differences)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from metalearn.algorithms import ANIL
from metalearn.models import ResidualBlock, ResNet12
from tests.models.test_models import (
    image_tasks,
    meta_gradient_errors_against_fd,
    meta_gradients_agree_across_modes,
)

F64 = torch.float64
TINY = (4, 6, 8, 10)


def resnet12_count(in_channels: int, ways: int, widths: tuple[int, ...]) -> int:
    """Parameters of ResNet-12 from its definition: per block three bias-free 3x3 convs, a
    bias-free 1x1 shortcut conv and four batch norms (scale and shift); a linear head."""
    total, c_in = 0, in_channels
    for c in widths:
        convs = 3 * 3 * c_in * c + 2 * (3 * 3 * c * c) + c_in * c
        total += convs + 4 * 2 * c
        c_in = c
    return total + widths[-1] * ways + ways


def test_default_shape_and_parameter_count() -> None:
    model = ResNet12(in_channels=3, ways=5, widths=(64, 160, 320, 640))
    x = torch.randn(2, 3, 84, 84)
    assert model.features(x).shape == (2, 640, 5, 5)  # 84 -> 42 -> 21 -> 10 -> 5
    assert model(x).shape == (2, 5)
    count = sum(p.numel() for p in model.parameters())
    assert count == resnet12_count(3, 5, (64, 160, 320, 640))
    assert count == 12_427_525  # the figure in ResNet12's docstring


@pytest.mark.parametrize(
    ("in_channels", "ways", "widths", "size"), [(3, 5, TINY, 16), (1, 7, (2, 3, 4, 5), 21)]
)
def test_tiny_shapes_and_counts(in_channels: int, ways: int, widths: tuple, size: int) -> None:
    model = ResNet12(in_channels=in_channels, ways=ways, widths=widths)
    assert model(torch.randn(3, in_channels, size, size)).shape == (3, ways)
    assert sum(p.numel() for p in model.parameters()) == resnet12_count(in_channels, ways, widths)


def test_names_no_buffers_and_anil_finds_the_head() -> None:
    model = ResNet12(widths=TINY)
    names = [k for k, _ in model.named_parameters()]
    assert all(k.startswith(("features.", "head.")) for k in names)
    assert [k for k in names if k.startswith("head.")] == ["head.weight", "head.bias"]
    assert list(model.named_buffers()) == []
    assert ANIL(model).adapt_keys == ["head.weight", "head.bias"]


def test_block_equals_a_reference_from_fused_ops() -> None:
    """`ResidualBlock` against the same block spelled with ``F.conv2d``, the fused
    ``F.batch_norm`` (batch statistics) and ``F.leaky_relu``."""
    torch.manual_seed(0)
    block = ResidualBlock(3, 5).double()
    with torch.no_grad():  # non-trivial norms, so a swapped weight would show
        for p in block.parameters():
            if p.dim() == 1:
                p.copy_(torch.rand_like(p) + 0.5)
    x = torch.randn(4, 3, 10, 10, dtype=F64)
    p = dict(block.named_parameters())

    def norm(h: torch.Tensor, name: str) -> torch.Tensor:
        return F.batch_norm(h, None, None, p[f"{name}.weight"], p[f"{name}.bias"], training=True)

    h = F.leaky_relu(norm(F.conv2d(x, p["conv1.weight"], padding=1), "norm1"), 0.1)
    h = F.leaky_relu(norm(F.conv2d(h, p["conv2.weight"], padding=1), "norm2"), 0.1)
    h = norm(F.conv2d(h, p["conv3.weight"], padding=1), "norm3")
    h = F.leaky_relu(h + norm(F.conv2d(x, p["shortcut.weight"]), "shortcut_norm"), 0.1)
    expected = F.max_pool2d(h, 2)
    out = block(x)
    assert out.shape == (4, 5, 5, 5)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_bad_arguments_name_the_fix() -> None:
    with pytest.raises(ValueError, match=r"four positive channel counts.*\(64, 160, 320, 640\)"):
        ResNet12(widths=(64, 160, 320))
    with pytest.raises(ValueError, match="four positive"):
        ResNet12(widths=(64, 0, 320, 640))
    with pytest.raises(ValueError, match="ways must be >= 1"):
        ResNet12(ways=0)
    model = ResNet12(widths=TINY)
    with pytest.raises(ValueError, match="H, W >= 16"):
        model(torch.randn(2, 3, 12, 12))
    with pytest.raises(ValueError, match="unsqueeze"):
        model(torch.randn(3, 16, 16))


def test_vmapped_meta_gradient_equals_loop() -> None:
    torch.manual_seed(0)
    model = ResNet12(in_channels=3, ways=3, widths=TINY).to(F64)
    meta_gradients_agree_across_modes(model, image_tasks(3, 16, ways=3))


def test_second_order_meta_gradient_equals_finite_differences() -> None:
    torch.manual_seed(0)
    model = ResNet12(in_channels=3, ways=3, widths=TINY).to(F64)
    errors = meta_gradient_errors_against_fd(model, image_tasks(3, 16, ways=3), directions=3)
    assert max(errors) < 1e-6, errors


def test_fused_batch_norm_is_refused_under_vmap_for_second_order() -> None:
    """With ``nn.BatchNorm2d`` the planner keeps second order out of vmap (its vmapped
    second derivative is wrong); `MetaBatchNorm`, the default, vmaps."""
    from metalearn.engine import InnerLoop, vmap_blockers

    fused = ResNet12(widths=TINY, norm_layer=lambda c: nn.BatchNorm2d(c, track_running_stats=False))
    fused = fused.double()  # the blockers read the forward on the tasks' float64 inputs
    tasks = image_tasks(3, 16, ways=5, n_tasks=1)
    assert vmap_blockers(fused, tasks, InnerLoop()) != []
    assert vmap_blockers(ResNet12(widths=TINY).double(), tasks, InnerLoop()) == []
