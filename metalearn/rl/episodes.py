"""What a rollout returns and what the policy-gradient estimators read.

Shapes are batch-first: ``[..., B, T]`` with B episodes of horizon T, any leading dims
(the meta-batch's tasks, K). An episode that ends before T (2D navigation's goal reached)
is padded: its ``mask`` is 0 from the step after its last, and its padded rewards are 0.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from torch import Tensor

__all__ = ["Episodes", "PolicyBatch", "VectorEnv", "mean_returns"]


class Episodes(NamedTuple):
    """A batch of episodes (a pytree: `torch.func.vmap` maps over its leading dim)."""

    obs: Tensor
    """``[..., B, T, obs_dim]``: the observation each action was taken in."""
    actions: Tensor
    """``[..., B, T, *action_shape]``: the policy's actions (before the env clips them)."""
    rewards: Tensor
    """``[..., B, T]``: rewards, 0 where ``mask`` is 0."""
    mask: Tensor
    """``[..., B, T]``: 1 for a step taken, 0 after the episode ended (same dtype as rewards)."""


class PolicyBatch(NamedTuple):
    """Episodes ready for a policy-gradient surrogate: advantages computed, nothing to sample.

    Everything here is a constant for autograd: a function of the samples only.
    """

    obs: Tensor
    """``[..., B, T, obs_dim]``."""
    actions: Tensor
    """``[..., B, T, *action_shape]``."""
    advantages: Tensor
    """``[..., B, T]``: the advantage estimate of each step, 0 where ``mask`` is 0."""
    mask: Tensor
    """``[..., B, T]``."""
    returns: Tensor
    """``[..., B]``: each episode's discounted return from its first step."""


class VectorEnv(Protocol):
    """A batch of environments stepped together: ``[K, B]`` episodes (K tasks, B each)."""

    horizon: int
    """The most steps an episode takes."""

    def reset(self) -> Tensor:
        """Start every episode; returns the first observations ``[K, B, obs_dim]``."""
        ...

    def step(self, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Apply ``actions [K, B, *action_shape]``; returns ``(obs [K, B, obs_dim],
        reward [K, B], done [K, B] bool)``. Steps after ``done`` are masked by the caller."""
        ...


def mean_returns(episodes: Episodes) -> Tensor:
    """``[...]``: the mean over each leading index's episodes of their undiscounted return,
    the sum of the rewards (what maml_rl reports as the average return); an empty episode
    (mask 0 from its first step: the padding of a step budget's batch) does not count."""
    return episodes.rewards.sum((-2, -1)) / episodes.mask[..., 0].sum(-1)
