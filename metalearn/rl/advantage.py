"""Discounted returns and generalised advantage estimation (Schulman et al., 2016).

On padded episodes ``[..., B, T]``: a step past an episode's end has reward 0 and value 0,
so the sums below stop at each episode's end without Python-level lengths (the value after
the last step is 0, as rllab appends to every path).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["discount_cumsum", "discounted_returns", "gae", "normalize_advantages"]


def discount_cumsum(x: Tensor, discount: float) -> Tensor:
    """``y_t = sum_{l >= 0} discount^l x_{t+l}`` along the last dim: ``[..., T]``."""
    out = torch.zeros_like(x)
    running = torch.zeros_like(x[..., 0])
    for t in range(x.shape[-1] - 1, -1, -1):
        running = x[..., t] + discount * running
        out[..., t] = running
    return out


def discounted_returns(rewards: Tensor, mask: Tensor, discount: float) -> Tensor:
    """The reward-to-go of each step, ``sum_l discount^l r_{t+l}``: ``[..., B, T]``."""
    return discount_cumsum(rewards * mask, discount)


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, discount: float, gae_lambda: float
) -> Tensor:
    """GAE(gamma, lambda) advantages: ``sum_l (gamma lambda)^l delta_{t+l}`` (Eq. 16),
    ``delta_t = r_t + gamma V(s_{t+1}) - V(s_t)``.

    Args:
        rewards: ``[..., B, T]``.
        values: ``[..., B, T]``, the baseline's value of each step's state.
        mask: ``[..., B, T]``.
        discount: gamma.
        gae_lambda: lambda (1: the reward-to-go minus the baseline, maml_rl's setting).

    Returns:
        ``[..., B, T]``, 0 past each episode's end.
    """
    values = values * mask
    next_values = torch.cat([values[..., 1:], torch.zeros_like(values[..., :1])], dim=-1)
    deltas = (rewards + discount * next_values - values) * mask
    return discount_cumsum(deltas, discount * gae_lambda) * mask


def normalize_advantages(
    advantages: Tensor, mask: Tensor, eps: float = 1e-8
) -> tuple[Tensor, Tensor]:
    """Advantages centred and scaled over the valid steps of each task's batch (rllab's
    ``center_adv``).

    Returns:
        ``(normalised [..., B, T], scale [..., 1, 1])``: the divisor, so that other
        estimates of the same gradient can be put on the same scale.
    """
    count = mask.sum(dim=(-2, -1), keepdim=True)
    mean = (advantages * mask).sum(dim=(-2, -1), keepdim=True) / count
    var = (((advantages - mean) * mask) ** 2).sum(dim=(-2, -1), keepdim=True) / count
    scale = var.sqrt() + eps
    return (advantages - mean) / scale * mask, scale
