"""The Gaussian MLP policy of the MAML paper, written for `torch.func.functional_call`.

Finn et al. (2017, Sec. 5.3): "a neural network policy with two hidden layers of size 100,
with ReLU nonlinearities"; the mean is the network's output and the log standard deviation a
learned vector independent of the observation (rllab's ``GaussianMLPPolicy``, initial
std 1, as the paper's reference code ``maml_rl``'s ``MAMLGaussianMLPPolicy``; weights
Xavier-uniform, biases zero, rllab's initialisation).

A policy here is an ``nn.Module`` whose ``forward(obs)`` returns the distribution's
statistics (a tuple of tensors), with four methods on those statistics that the sampler
and the estimators use: ``log_prob``, ``kl``, ``sample`` (from noise drawn up front, so an
episode's randomness is its seed's) and ``noise``. Any module with these methods (a
tabular softmax policy, say) goes through the same sampler, surrogates and TRPO step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

__all__ = ["GaussianMLPPolicy", "Stats"]

Stats = tuple[Tensor, ...]
"""A distribution's statistics over ``[..., *action_shape]`` (the Gaussian's: mean, log_std)."""

_ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh}


class GaussianMLPPolicy(nn.Module):
    """pi(a | s) = N(mu(s), diag(exp(log_std))^2), mu an MLP.

    Args:
        obs_dim: observation size.
        action_dim: action size.
        hidden: hidden layer sizes (the paper's (100, 100)).
        activation: ``"relu"`` (the paper's) or ``"tanh"``.
        init_std: the initial standard deviation of every action dimension.
    """

    def __init__(
        self,
        obs_dim: int,
        action_dim: int,
        hidden: Sequence[int] = (100, 100),
        activation: str = "relu",
        init_std: float = 1.0,
    ):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(
                f"unknown activation {activation!r}; choose one of {list(_ACTIVATIONS)}"
            )
        sizes = [obs_dim, *hidden, action_dim]
        layers: list[nn.Module] = []
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            linear = nn.Linear(n_in, n_out)
            nn.init.xavier_uniform_(linear.weight)
            nn.init.zeros_(linear.bias)
            layers.append(linear)
            if i < len(sizes) - 2:
                layers.append(_ACTIVATIONS[activation]())
        self.mean = nn.Sequential(*layers)
        self.log_std = nn.Parameter(torch.full((action_dim,), math.log(init_std)))
        self.action_dim = action_dim

    def forward(self, obs: Tensor) -> Stats:
        """``obs [..., obs_dim]`` -> ``(mean [..., action_dim], log_std [..., action_dim])``."""
        mean = self.mean(obs)
        return mean, self.log_std.expand_as(mean)

    @staticmethod
    def log_prob(stats: Stats, actions: Tensor) -> Tensor:
        """log pi(a | s), summed over action dims: ``[...]``."""
        mean, log_std = stats
        z = (actions - mean) * torch.exp(-log_std)
        return (-0.5 * z**2 - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)

    @staticmethod
    def kl(old: Stats, new: Stats) -> Tensor:
        """KL(old || new) of the two diagonal Gaussians, summed over action dims: ``[...]``."""
        (m0, s0), (m1, s1) = old, new
        var_ratio = torch.exp(2 * (s0 - s1))
        return (0.5 * (var_ratio + (m0 - m1) ** 2 * torch.exp(-2 * s1) - 1) + s1 - s0).sum(-1)

    @staticmethod
    def sample(stats: Stats, noise: Tensor) -> Tensor:
        """The action mean + std * noise, ``noise [..., action_dim]`` standard normal."""
        mean, log_std = stats
        return mean + torch.exp(log_std) * noise

    def noise(self, generator: torch.Generator, horizon: int, dtype: torch.dtype) -> Tensor:
        """One episode's noise, ``[horizon, action_dim]``, from its own generator."""
        return torch.randn(horizon, self.action_dim, generator=generator, dtype=dtype)
