"""Evaluation mode for a block of code: dropout off, each module's mode given back after.

metalearn's networks behave the same in training and evaluation mode except for
dropout (batch norm is `MetaBatchNorm`, with no running statistics), so the mode decides
one thing: whether `R2D2Net`'s dropout masks its features. Training runs in training mode
(torch's default); every evaluation metalearn makes (validation, test, ensembles,
`metalearn-evaluate`, the curvature probes, deploy's adaptation to a support set) runs its
learner under `evaluation_mode`, as the reference code calls ``model.eval()`` before it
tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

__all__ = ["evaluation_mode"]


@contextlib.contextmanager
def evaluation_mode(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` and its submodules in evaluation mode inside the block; on leaving (also
    on an exception) each submodule's own ``training`` flag is restored, mixed ones too."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, training in modes:
            m.training = training
