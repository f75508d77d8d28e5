"""Episodes to a `PolicyBatch`: returns, the baseline, advantages (all constants of the
surrogates: functions of the samples only)."""

from __future__ import annotations

import torch

from metalearn.rl.advantage import discounted_returns, gae, normalize_advantages
from metalearn.rl.baseline import fit_linear_baseline, linear_baseline_values
from metalearn.rl.episodes import Episodes, PolicyBatch

__all__ = ["policy_batch"]


@torch.no_grad()
def policy_batch(
    episodes: Episodes,
    *,
    discount: float = 0.99,
    gae_lambda: float = 1.0,
    baseline: bool = True,
    normalize: bool = False,
) -> PolicyBatch:
    """Advantages of ``episodes`` (leading dims ``[..., B, T]``, fitted per leading index).

    Args:
        episodes: the rollouts.
        discount: gamma (maml_rl's 0.99).
        gae_lambda: GAE's lambda (maml_rl's 1: reward-to-go minus the baseline).
        baseline: subtract the linear feature baseline fitted on these episodes (else the
            advantage is the reward-to-go, the plain likelihood-ratio estimator).
        normalize: centre and scale the advantages per task (rllab's ``center_adv``); the
            returns are divided by the same scale, so the meta-surrogate's score term
            (`metalearn.rl.meta_objective`) keeps its proportion to the policy-gradient term.

    Returns:
        The `PolicyBatch`; ``returns`` is each episode's discounted return (scaled with the
        advantages when ``normalize``).
    """
    returns_to_go = discounted_returns(episodes.rewards, episodes.mask, discount)
    values = torch.zeros_like(returns_to_go)
    if baseline:
        coeffs = fit_linear_baseline(episodes.obs, returns_to_go, episodes.mask)
        values = linear_baseline_values(coeffs, episodes.obs, episodes.mask)
    advantages = gae(episodes.rewards, values, episodes.mask, discount, gae_lambda)
    returns = returns_to_go[..., 0]
    if normalize:
        advantages, scale = normalize_advantages(advantages, episodes.mask)
        returns = returns / scale[..., 0]
    return PolicyBatch(episodes.obs, episodes.actions, advantages, episodes.mask, returns)
