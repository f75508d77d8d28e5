"""A clipped (PPO-style) outer step: a few first-order epochs on the clipped meta-surrogate.

The meta-surrogate with ``MetaObjective(clip=epsilon)`` is PPO's clipped objective
(Schulman et al., 2017, Eq. 7) on the adapted policies' importance ratios; each epoch
re-adapts from the current theta on the same inner episodes, and theta takes one step of the
given optimiser on minus the surrogate. An alternative to `metalearn.rl.trpo.TRPO` with no
second-order solve in the outer step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

__all__ = ["clipped_outer_step"]


def clipped_outer_step(
    objective: Callable[[Mapping[str, Tensor]], tuple[Tensor, Tensor]],
    params: Mapping[str, Tensor],
    optimizer: torch.optim.Optimizer,
    epochs: int = 5,
) -> list[tuple[float, float]]:
    """Take ``epochs`` optimiser steps on ``-surrogate``; returns each epoch's (surrogate, KL).

    Args:
        objective: ``params -> (clipped surrogate [], mean KL [])``.
        params: theta, the leaf tensors ``optimizer`` updates in place.
        optimizer: e.g. ``torch.optim.Adam(params.values(), lr=...)``.
        epochs: steps on the same samples.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    history = []
    for _ in range(epochs):
        optimizer.zero_grad()
        surrogate, kl = objective(params)
        (-surrogate).backward()
        optimizer.step()
        history.append((float(surrogate.detach()), float(kl.detach())))
    return history
