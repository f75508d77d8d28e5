"""Residual blocks whose body each task may skip: a per-task branch of the network.

A branch is chosen per task, so it reaches the model as a forward keyword argument, the way
the engine passes `metalearn.task.Task.model_kwargs`::

    functional_call(model, params, (x,), {"skip": (True, False)})

`DynamicNet` takes ``skip`` in its ``forward`` and hands each `DynamicBlock` its own flag;
any model of yours that contains `DynamicBlock`s must route the keyword the same way
(``functional_call`` calls only the top module's ``forward``). The branch is Python control
flow, fixed for the whole task, so a task's `task_loss` stays one function: ``meta_batch``
vmaps tasks that share ``model_kwargs`` together and puts each distinct branch in its own
bucket (its bucket key includes ``model_kwargs``).

Skipping a block is the stochastic-depth / "skip a residual block" idea (Huang et al., 2016,
Eq. 2 with the block's survival variable fixed to 0): the block's output is its shortcut.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from metalearn.models import ConvBlock, MetaBatchNorm

__all__ = ["DynamicBlock", "DynamicNet", "dynamic_conv", "dynamic_mlp"]

Skip = bool | Sequence[bool]
"""One flag for every block, or one per block (a tuple keeps ``model_kwargs`` hashable)."""


class DynamicBlock(nn.Module):
    """``body(x) + shortcut(x)``, or only ``shortcut(x)`` when the task skips the block.

    Args:
        body: the residual branch; its output must match ``shortcut(x)`` in shape.
        shortcut: the skip path; the identity by default. Pass a cheap projection (e.g. a
            1x1 convolution or a linear layer) when ``body`` changes the shape.

    Shape:
        ``[N, *] -> [N, *']``, as ``body`` and ``shortcut`` map it.
    """

    def __init__(self, body: nn.Module, shortcut: nn.Module | None = None) -> None:
        super().__init__()
        self.body = body
        self.shortcut = nn.Identity() if shortcut is None else shortcut

    def forward(self, x: Tensor, *, skip: bool = False) -> Tensor:
        """Args: x: the block's input ``[N, *]``; skip: True to bypass ``body``."""
        if not isinstance(skip, bool):
            raise ValueError(
                f"skip must be a Python bool (one branch per task), got {type(skip).__name__}; "
                "choose the branch per task with Task(model_kwargs={'skip': True})"
            )
        identity = self.shortcut(x)
        return identity if skip else self.body(x) + identity


class DynamicNet(nn.Module):
    """``stem -> DynamicBlock ... -> head`` with the branch of every block chosen per call.

    The parameters are named ``stem.*``, ``blocks.<i>.*`` and ``head.*``, so ANIL adapts the
    classifier by the prefix ``"head"``. A skipped block's parameters get a zero inner
    gradient and no meta-gradient from that task.

    Args:
        stem: maps the input to the blocks' shape.
        blocks: the dynamic residual blocks, applied in order.
        head: maps the last block's output to the outputs (e.g. logits).

    Shape:
        ``[N, *] -> [N, K]``, as ``stem``, ``blocks`` and ``head`` map it.
    """

    def __init__(self, stem: nn.Module, blocks: Sequence[DynamicBlock], head: nn.Module) -> None:
        super().__init__()
        if not all(isinstance(b, DynamicBlock) for b in blocks):
            raise ValueError("blocks must all be DynamicBlock; wrap a plain block's body in one")
        self.stem = stem
        self.blocks = nn.ModuleList(blocks)
        self.head = head

    def forward(self, x: Tensor, *, skip: Skip = False) -> Tensor:
        """Args: x: input ``[N, *]``; skip: a bool for all blocks or a sequence, one per block."""
        flags = self._flags(skip)
        h = self.stem(x)
        for block, flag in zip(self.blocks, flags):
            h = block(h, skip=flag)
        return self.head(h)

    def _flags(self, skip: Skip) -> list[bool]:
        if isinstance(skip, bool):
            return [skip] * len(self.blocks)
        flags = list(skip)
        if len(flags) != len(self.blocks):
            raise ValueError(
                f"skip has {len(flags)} flags but the net has {len(self.blocks)} blocks; "
                "pass one bool per block, or a single bool for all of them"
            )
        return flags


def dynamic_mlp(
    in_features: int,
    width: int,
    depth: int,
    out_features: int,
    activation: type[nn.Module] = nn.Tanh,
) -> DynamicNet:
    """A fully connected `DynamicNet`: ``Linear -> act``, ``depth`` blocks, ``Linear`` head.

    Each block's body is ``Linear(width, width) -> act``; the shortcut is the identity.

    Shape:
        ``[N, in_features] -> [N, out_features]``.
    """
    stem = nn.Sequential(nn.Linear(in_features, width), activation())
    blocks = [
        DynamicBlock(nn.Sequential(nn.Linear(width, width), activation())) for _ in range(depth)
    ]
    return DynamicNet(stem, blocks, nn.Linear(width, out_features))


def dynamic_conv(
    in_channels: int = 1, ways: int = 5, hidden: int = 64, depth: int = 2
) -> DynamicNet:
    """A convolutional `DynamicNet`: a strided `ConvBlock` stem, ``depth`` residual blocks,
    the spatial mean and a linear head.

    Each block's body is ``3x3 conv (stride 1) -> MetaBatchNorm -> ReLU``, so it keeps the
    shape and the identity is its shortcut; batch norm is `MetaBatchNorm`, safe under
    vmapped second order.

    Shape:
        ``[N, in_channels, H, W] -> [N, ways]`` (logits).
    """

    def body() -> nn.Module:
        conv = nn.Conv2d(hidden, hidden, 3, padding=1)
        return nn.Sequential(conv, MetaBatchNorm(hidden), nn.ReLU())

    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(hidden, ways))
    blocks = [DynamicBlock(body()) for _ in range(depth)]
    return DynamicNet(ConvBlock(in_channels, hidden), blocks, head)
