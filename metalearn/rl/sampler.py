"""Rollouts: a policy run in a batch of environments, every episode from its own seed.

An episode's randomness is drawn before it starts (`episode_noise`: the policy's noise for
every step, from the episode's seed), so it is the same whatever else is in the batch.
The rollout itself has no randomness: the env is deterministic given the actions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from metalearn.rl.episodes import Episodes, VectorEnv
from metalearn.rl.seeds import generator

__all__ = ["episode_noise", "rollout"]


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
