"""Backbones for few-shot learning, written for the functional core.

Every model here is meant to be run through `torch.func.functional_call` with a parameter
dict, batched over tasks with `torch.func.vmap` and differentiated to second order. So:

* no module holds buffers that change in ``forward`` (no running statistics, no in-place
  updates);
* batch norm is `batch_norm`, written from elementary ops, because the fused
  ``F.batch_norm(training=True)`` gives wrong second-order gradients under ``vmap``
  (measured on torch 2.13, see `batch_norm`);
* the classifier is a submodule called ``head`` and everything before it ``features``, so
  ANIL adapts ``head.*`` only by passing those keys.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import Tensor, nn

__all__ = ["MLP", "Conv4", "ConvBlock", "MetaBatchNorm", "batch_norm"]


def batch_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """Transductive batch norm: normalise with the statistics of this batch, always.

    This is MAML's batch norm (Finn et al., 2017): no running statistics, the same in
    training and evaluation, so query examples are normalised with their own batch's
    statistics. It equals ``F.batch_norm(x, None, None, weight, bias, training=True,
    eps=eps)`` (biased variance) but is built from sums and elementwise ops, always, so its
    second derivatives are right under ``vmap``. The fused kernel's are not: its vmapped
    mixed second derivative (the outer derivative through the inner gradient of the norm's
    weight, w.r.t. a weight upstream of it) is wrong: on torch 2.13 in float64, a vmapped
    second-order Conv4 meta-gradient through ``F.batch_norm`` missed finite differences by
    10-72% along three random directions, where this form and the looped kernel agreed to
    1e-8 (``tests/test_models.py``). There is no switch to the fused kernel: one form serves the
    vmapped and the looped paths, and nothing global decides between them.

    Args:
        x: input ``[N, C]``, ``[N, C, L]`` or ``[N, C, H, W]``; statistics are taken per
            channel ``C`` over every other dimension (``N``; ``N, L``; ``N, H, W``).
        weight: per-channel scale ``[C]``.
        bias: per-channel shift ``[C]``.
        eps: added to the variance before the square root.

    Returns:
        Tensor shaped like ``x``.
    """
    if x.dim() < 2:
        raise ValueError(
            f"batch_norm expects input [N, C, *], got shape {tuple(x.shape)}; "
            "add a batch dimension (x.unsqueeze(0)) or a channel dimension"
        )
    channels = x.shape[1]
    if weight.shape != (channels,) or bias.shape != (channels,):
        raise ValueError(
            f"weight {tuple(weight.shape)} and bias {tuple(bias.shape)} must both have shape "
            f"({channels},) to match the input's channel dimension (dim 1 of {tuple(x.shape)})"
        )
    dims = (0, *range(2, x.dim()))
    shape = (1, channels) + (1,) * (x.dim() - 2)
    # Means as sums times 1/N: a mean's backward divides a full-size tensor by N (once in
    # the inner gradient, again in its derivative), a sum's backward only expands, and the
    # 1/N lands on the [1, C, 1, 1] statistics. A vmapped second-order conv4 meta-step was
    # 3-7% faster for it (1 query: 165 -> 154 ms, 15 query: 782 -> 724 ms; 2 threads).
    # torch.var_mean, addcmul or square() gained nothing more.
    inv_n = 1.0 / max(x.numel() // channels, 1)  # an empty batch gives an empty output
    centred = x - x.sum(dims, keepdim=True) * inv_n
    var = (centred * centred).sum(dims, keepdim=True) * inv_n
    # Fold the scale into one per-channel factor ([1, C, 1, 1]) before touching the big
    # tensor: two full-size ops (mul, add) instead of three.
    scale = torch.rsqrt(var + eps) * weight.reshape(shape)
    return centred * scale + bias.reshape(shape)


class MetaBatchNorm(nn.Module):
    """`batch_norm` as a module: learnable per-channel ``weight``/``bias``, no buffers.

    Args:
        num_features: number of channels ``C``.
        eps: added to the variance before the square root.

    Shape:
        ``[N, C]``, ``[N, C, L]`` or ``[N, C, H, W]`` in and out.
    """

    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__()
        if num_features < 1:
            raise ValueError(f"num_features must be >= 1, got {num_features}")
        self.num_features = num_features
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))

    def forward(self, x: Tensor) -> Tensor:
        return batch_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}"


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


class MLP(nn.Module):
    """A fully connected network: ``Linear -> activation`` per hidden layer, then ``head``.

    Args:
        in_features: input size ``D``.
        hidden: sizes of the hidden layers, e.g. ``[40, 40]`` for MAML's sine regressor;
            empty for a linear model.
        out_features: output size ``K``.
        activation: module class applied after each hidden layer (``nn.ReLU`` by default).

    Shape:
        ``[B, D] -> [B, K]`` (any leading dimensions ``[*, D] -> [*, K]``).
    """

    def __init__(
        self,
        in_features: int,
        hidden: Sequence[int],
        out_features: int,
        activation: type[nn.Module] | Callable[[], nn.Module] = nn.ReLU,
    ) -> None:
        super().__init__()
        sizes = [in_features, *hidden]
        for size in [*sizes, out_features]:
            if size < 1:
                raise ValueError(
                    f"layer sizes must be >= 1, got in_features={in_features}, "
                    f"hidden={list(hidden)}, out_features={out_features}"
                )
        layers: list[nn.Module] = []
        for n_in, n_out in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(n_in, n_out), activation()]
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(sizes[-1], out_features)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


def _maml_init(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
