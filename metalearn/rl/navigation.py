"""2D navigation (Finn et al., 2017, Sec. 5.3): a point agent moves to a goal in the plane.

As the MAML paper's reference environment (maml_rl's ``PointEnvRandGoal`` under rllab's
``normalize`` wrapper): the agent starts at the origin, observes its position, and its
action ``a`` moves it by ``clip(0.1 a, -0.1, 0.1)`` per coordinate (``normalize`` maps the
policy's [-1, 1] onto the action box [-0.1, 0.1] and clips). The reward is minus the
Euclidean distance to the goal after the move; an episode ends when both coordinates are
within 0.01 of the goal, or at the horizon of 100 steps. Goals are uniform in
[-0.5, 0.5]^2, each drawn from its task's seed.

Batched in torch across tasks and episodes: one `NavigationEnv` steps ``[K, B]`` agents.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from metalearn.rl.seeds import generator

__all__ = ["Navigation2D", "NavigationEnv"]


@dataclass(frozen=True)
class Navigation2D:
    """The task distribution: a task is a goal, uniform in ``[-goal_range, goal_range]^2``."""

    horizon: int = 100
    goal_range: float = 0.5
    action_bound: float = 0.1
    """The action box [-bound, bound]^2 the scaled action is clipped to."""
    goal_radius: float = 0.01
    """An episode ends when both coordinates are within this of the goal."""
    obs_dim: int = 2
    action_dim: int = 2

    def sample_goals(self, seeds: Sequence[int], dtype: torch.dtype = torch.float32) -> Tensor:
        """One goal per task seed: ``[K, 2]``."""
        goals = [
            torch.rand(2, generator=generator(s), dtype=torch.float64) for s in seeds
        ]  # drawn in float64 so a goal does not depend on the env's dtype
        return ((torch.stack(goals) * 2 - 1) * self.goal_range).to(dtype)

    def dims(self) -> tuple[int, int]:
        """``(obs_dim, action_dim)`` of the environment (as `MujocoTasks.dims`)."""
        return self.obs_dim, self.action_dim

    def make_env(self, goals: Tensor, episodes: int) -> NavigationEnv:
        """An env of ``[K, episodes]`` agents, task k's agents heading to ``goals[k]``."""
        return NavigationEnv(self, goals, episodes)


class NavigationEnv:
    """``[K, B]`` point agents (a `metalearn.rl.episodes.VectorEnv`)."""

    def __init__(self, task: Navigation2D, goals: Tensor, episodes: int):
        if goals.dim() != 2 or goals.shape[1] != 2:
            raise ValueError(f"goals must be [K, 2], got {tuple(goals.shape)}")
        if episodes < 1:
            raise ValueError(f"episodes must be >= 1, got {episodes}")
        self.task = task
        self.horizon = task.horizon
        self.goals = goals[:, None, :]  # [K, 1, 2]
        self.shape = (goals.shape[0], episodes)
        self.position = goals.new_zeros(*self.shape, 2)

    def reset(self) -> Tensor:
        self.position = self.goals.new_zeros(*self.shape, 2)
        return self.position.clone()

    def step(self, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        bound = self.task.action_bound
        # rllab's normalize: lb + (a + 1) / 2 (ub - lb) = bound * a for a symmetric box, clipped.
        move = (bound * actions).clamp(-bound, bound)
        self.position = self.position + move
        offset = self.position - self.goals
        reward = -offset.norm(dim=-1)
        done = (offset.abs() < self.task.goal_radius).all(dim=-1)
        return self.position.clone(), reward, done
