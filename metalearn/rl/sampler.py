"""Rollouts: a policy run in a batch of environments, every episode from its own seed.

An episode's randomness is drawn before it starts (`episode_noise`: the policy's noise for
every step, from the episode's seed), so it is the same whatever else is in the batch.
The rollout itself has no randomness: the env is deterministic given the actions.
`TaskSampler` draws a meta-batch's goals and episodes this way from a task distribution,
each from its seed path under a run's seed (`metalearn.rl.seeds`): a number of episodes a
task, or a number of steps (`TaskSampler.budget`, maml_rl's, `metalearn.rl.budget`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from metalearn.rl.budget import budget_cut, keep_episodes
from metalearn.rl.episodes import Episodes, VectorEnv
from metalearn.rl.navigation import Navigation2D
from metalearn.rl.seeds import derive_seeds, generator

__all__ = ["TaskSampler", "episode_noise", "rollout"]


def episode_noise(
    policy: nn.Module, seeds: Sequence[Sequence[int]], horizon: int, dtype: torch.dtype
) -> Tensor:
    """The noise of ``[K, B]`` episodes, episode (k, b) drawn from ``seeds[k][b]``.

    Returns:
        ``[K, B, horizon, *noise_shape]``.
    """
    return torch.stack(
        [torch.stack([policy.noise(generator(s), horizon, dtype) for s in row]) for row in seeds]
    )


@torch.no_grad()
def rollout(
    env: VectorEnv,
    policy: nn.Module,
    params: Mapping[str, Tensor],
    noise: Tensor,
    *,
    per_task: bool = False,
) -> Episodes:
    """Run ``policy`` with ``params`` in ``env`` for ``env.horizon`` steps.

    Args:
        env: ``[K, B]`` environments.
        policy: the policy module (see `metalearn.rl.policy`), called through
            ``functional_call`` with ``params``.
        params: name -> tensor; with ``per_task`` each has a leading ``[K]`` dim (task k's
            adapted parameters), else the same parameters act in every task.
        noise: ``[K, B, horizon, *noise_shape]`` (`episode_noise`).
        per_task: whether ``params`` are stacked over tasks.

    Returns:
        `Episodes` with leading dims ``[K, B]``.
    """
    if noise.shape[2] < env.horizon:
        raise ValueError(f"noise covers {noise.shape[2]} steps, the horizon is {env.horizon}")

    def act(p: Mapping[str, Tensor], obs: Tensor, eps: Tensor) -> Tensor:
        return policy.sample(functional_call(policy, dict(p), (obs,)), eps)

    act_all = vmap(act) if per_task else act
    obs = env.reset()
    alive = torch.ones(obs.shape[:2], dtype=torch.bool, device=obs.device)
    record: dict[str, list[Tensor]] = {"obs": [], "actions": [], "rewards": [], "mask": []}
    for t in range(env.horizon):
        actions = act_all(params, obs, noise[:, :, t])
        next_obs, reward, done = env.step(actions)
        mask = alive.to(reward.dtype)
        for key, value in zip(record, (obs, actions, reward * mask, mask)):
            record[key].append(value)
        alive = alive & ~done
        obs = next_obs
    return Episodes(*(torch.stack(record[key], dim=2) for key in record))


class _OnDevice:
    """A `VectorEnv` whose observations, rewards and done flags move to ``device``."""

    def __init__(self, env: VectorEnv, device: torch.device | str):
        self.env, self.device, self.horizon = env, device, env.horizon

    def reset(self) -> Tensor:
        return self.env.reset().to(self.device)

    def step(self, actions: Tensor) -> tuple[Tensor, ...]:
        return tuple(x.to(self.device) for x in self.env.step(actions))


class TaskSampler:
    """A task distribution's goals and episodes, each from its seed path under ``seed``.

    Task k of ``(stream, iteration)`` (a stream: training or held-out tasks) has its goal
    from the seed path ``(stream, iteration, k)`` and its episode b of a phase (0 with
    theta, p after p inner steps) from ``(stream, iteration, k, phase, b)``: the same path
    gives the same goal and episode whatever the batch sizes, so a resumed run samples what
    an uninterrupted one does.

    Attributes:
        dist: `Navigation2D` (stepped in torch on ``device``) or
            `metalearn.rl.mujoco.MujocoTasks` (stepped on the CPU, moved to ``device``).
        policy: the policy module the episodes are run with.
        steps: the valid env steps sampled so far; ``seconds``: the time they took.
    """

    def __init__(self, dist: Any, policy: nn.Module, seed: int, device: torch.device | str):
        self.dist, self.policy, self.seed, self.device = dist, policy, seed, device
        self.env: Any = None  # MuJoCo: kept for reuse (building costs 0.1 s an env)
        self.steps, self.seconds = 0, 0.0

    def goals(self, stream: int, iteration: int, count: int) -> Tensor:
        """The goals of tasks ``0..count-1`` of ``(stream, iteration)``: ``[count, ...]``."""
        return self.dist.sample_goals(derive_seeds(self.seed, stream, iteration, count=count))

    def __call__(
        self,
        params: Mapping[str, Tensor],
        goals: Tensor,
        path: tuple[int, int, int],
        episodes: int,
        per_task: bool,
        first: int = 0,
    ) -> Episodes:
        """``episodes`` episodes per goal with ``params`` (stacked ``[K]`` if ``per_task``,
        see `rollout`); ``path`` is ``(stream, iteration, phase)``.

        Returns:
            `Episodes` ``[K, episodes, horizon]``, task k's episode b from the seed path
            ``(stream, iteration, k, phase, first + b)``.
        """
        start = time.perf_counter()
        stream, iteration, phase = path
        seeds = [
            derive_seeds(self.seed, stream, iteration, k, phase, count=first + episodes)[first:]
            for k in range(goals.shape[0])
        ]
        noise = episode_noise(self.policy, seeds, self.dist.horizon, torch.float32)
        if isinstance(self.dist, Navigation2D):
            env: VectorEnv = self.dist.make_env(goals.float().to(self.device), episodes)
        else:
            self.env = self.dist.make_env(goals, seeds, reuse=self.env)
            env = _OnDevice(self.env, self.device)
        sampled = rollout(env, self.policy, params, noise.to(self.device), per_task=per_task)
        self.steps += int(sampled.mask.sum())
        self.seconds += time.perf_counter() - start
        return sampled

    def budget(
        self,
        params: Mapping[str, Tensor],
        goals: Tensor,
        path: tuple[int, int, int],
        steps: int,
        per_task: bool,
        streams: int = 1,
    ) -> Episodes:
        """The episodes maml_rl's vectorized sampler runs for ``steps`` steps a task with
        ``streams`` environments a task (`metalearn.rl.budget`): full-length episodes enough
        for the budget first, then as many again until the budget's stop is reached.

        Returns:
            `Episodes` ``[K, n, horizon]``, n the most episodes a task kept (a task with
            fewer padded by empty ones); task k's episode b from the seed path
            ``(stream, iteration, k, phase, b)``, b as `metalearn.rl.budget.budget_cut` orders.
        """
        horizon = self.dist.horizon
        count = streams * -(-steps // (streams * horizon))  # full-length episodes' need
        parts = [self(params, goals, path, count, per_task)]
        while True:
            episodes = Episodes(*(torch.cat(x, dim=1) for x in zip(*parts)))
            kept = budget_cut(episodes.mask.sum(-1), streams, steps)
            if kept is not None:
                return keep_episodes(episodes, kept)
            have = episodes.mask.shape[1]  # episodes ended early: sample as many again
            parts.append(self(params, goals, path, have, per_task, first=have))
