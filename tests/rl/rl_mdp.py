"""A tiny MDP and a tabular softmax policy for the meta-RL tests, with its expected return
computed exactly by enumerating every trajectory (float64)."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

STATES, ACTIONS, HORIZON = 2, 2, 3
NEXT = torch.tensor([[0, 1], [1, 0]])  # NEXT[s, a]: deterministic transitions
REWARD = torch.tensor([[1.0, 0.0], [0.5, 2.0]], dtype=torch.float64)  # REWARD[s, a]


class TinyEnv:
    """``[K, B]`` copies of the MDP, starting in state 0 (a `metalearn.rl.VectorEnv`)."""

    horizon = HORIZON

    def __init__(self, tasks: int, episodes: int):
        self.shape = (tasks, episodes)

    def reset(self) -> Tensor:
        self.state = torch.zeros(self.shape, dtype=torch.long)
        return F.one_hot(self.state, STATES).double()

    def step(self, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        reward = REWARD[self.state, actions]
        self.state = NEXT[self.state, actions]
        done = torch.zeros(self.shape, dtype=torch.bool)
        return F.one_hot(self.state, STATES).double(), reward, done


class TabularSoftmax(nn.Module):
    """pi(a | s) = softmax(logits[s]), observations one-hot states."""

    def __init__(self, logits: Tensor):
        super().__init__()
        self.logits = nn.Parameter(logits.clone())

    def forward(self, obs: Tensor) -> tuple[Tensor]:
        return (obs @ self.logits,)

    @staticmethod
    def log_prob(stats: tuple[Tensor], actions: Tensor) -> Tensor:
        return F.log_softmax(stats[0], -1).gather(-1, actions[..., None])[..., 0]

    @staticmethod
    def kl(old: tuple[Tensor], new: tuple[Tensor]) -> Tensor:
        p_log, q_log = F.log_softmax(old[0], -1), F.log_softmax(new[0], -1)
        return (p_log.exp() * (p_log - q_log)).sum(-1)

    @staticmethod
    def sample(stats: tuple[Tensor], noise: Tensor) -> Tensor:
        cdf = F.softmax(stats[0], -1).cumsum(-1)
        return (cdf < noise[..., None]).sum(-1).clamp(max=ACTIONS - 1)

    def noise(self, generator: torch.Generator, horizon: int, dtype: torch.dtype) -> Tensor:
        return torch.rand(horizon, generator=generator, dtype=dtype)


TRAJECTORIES = list(itertools.product(range(ACTIONS), repeat=HORIZON))


def walk(actions: tuple[int, ...]) -> tuple[list[int], list[float]]:
    """The states visited and rewards of one action sequence."""
    states, rewards, s = [], [], 0
    for a in actions:
        states.append(s)
        rewards.append(float(REWARD[s, a]))
        s = int(NEXT[s, a])
    return states, rewards


def log_likelihood(logits: Tensor, actions: tuple[int, ...]) -> Tensor:
    states, _ = walk(actions)
    log_pi = torch.log_softmax(logits, -1)
    return sum(log_pi[s, a] for s, a in zip(states, actions))


def expected_return(logits: Tensor) -> Tensor:
    """J(logits) = sum over trajectories of p(tau) R(tau), exactly."""
    return sum(log_likelihood(logits, tau).exp() * sum(walk(tau)[1]) for tau in TRAJECTORIES)


def inner_step(logits: Tensor, batch: tuple[tuple[int, ...], ...], lr: float) -> Tensor:
    """phi = theta + lr g_hat, g_hat the REINFORCE estimate on ``batch`` (reward-to-go, no
    baseline, averaged over episodes), differentiable in theta."""
    surrogate = 0.0
    log_pi = torch.log_softmax(logits, -1)
    for tau in batch:
        states, rewards = walk(tau)
        for t, (s, a) in enumerate(zip(states, tau)):
            surrogate = surrogate + log_pi[s, a] * sum(rewards[t:])
    (g,) = torch.autograd.grad(surrogate / len(batch), logits, create_graph=True)
    return logits + lr * g


def post_adaptation_return(logits: Tensor, inner_episodes: int, lr: float) -> Tensor:
    """F(theta) = E_{batch ~ pi_theta} J(theta + lr g_hat(theta, batch)), exactly."""
    total = 0.0
    for batch in itertools.product(TRAJECTORIES, repeat=inner_episodes):
        p = sum(log_likelihood(logits, tau) for tau in batch).exp()
        total = total + p * expected_return(inner_step(logits, batch, lr))
    return total
