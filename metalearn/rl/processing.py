"""Episodes to a `PolicyBatch`: returns, the baseline, advantages (all constants of the
surrogates: functions of the samples only)."""

from __future__ import annotations

import torch

from metalearn.rl.advantage import discounted_returns, gae, normalize_advantages
from metalearn.rl.baseline import fit_linear_baseline, linear_baseline_values
from metalearn.rl.episodes import Episodes, PolicyBatch

__all__ = ["NonFiniteEpisodesError", "check_finite", "checked_policy_batch", "policy_batch"]


class NonFiniteEpisodesError(FloatingPointError):
    """A task's returns or advantages are NaN or infinite; names the task and iteration."""

    def __init__(self, what: str, task: int, iteration: int, phase: str):
        self.what, self.task, self.iteration, self.phase = what, task, iteration, phase
        super().__init__(
            f"non-finite {what} in task {task} of iteration {iteration} ({phase} episodes); "
            "lower the inner learning rate or the outer step (max KL), or check the environment"
        )


def check_finite(batch: PolicyBatch, iteration: int, phase: str) -> None:
    """Raise `NonFiniteEpisodesError` for the first task (leading dim of ``batch``, ``[K, B,
    T]``) whose returns or advantages are not finite; ``phase`` names the episodes (e.g.
    ``"inner step 0"``, ``"outer"``)."""
    for what, values in (("returns", batch.returns), ("advantages", batch.advantages)):
        bad = ~torch.isfinite(values.flatten(1)).all(dim=1)
        if bad.any():
            raise NonFiniteEpisodesError(what, int(bad.nonzero()[0, 0]), iteration, phase)


@torch.no_grad()
def policy_batch(
    episodes: Episodes,
    *,
    discount: float = 0.99,
    gae_lambda: float = 1.0,
    baseline: bool = True,
    normalize: bool = True,
) -> PolicyBatch:
    """Advantages of ``episodes`` (leading dims ``[..., B, T]``, fitted per leading index).

    Args:
        episodes: the rollouts.
        discount: gamma (maml_rl's 0.99).
        gae_lambda: GAE's lambda (maml_rl's 1: reward-to-go minus the baseline).
        baseline: subtract the linear feature baseline fitted on these episodes (else the
            advantage is the reward-to-go, the plain likelihood-ratio estimator).
        normalize: centre and scale the advantages per task (rllab's ``center_adv``, True
            in maml_rl's ``batch_maml_polopt.py``, hence the default); the returns are
            divided by the same scale, so the meta-surrogate's score term
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


def checked_policy_batch(
    episodes: Episodes,
    iteration: int,
    phase: str,
    *,
    discount: float = 0.99,
    gae_lambda: float = 1.0,
    normalize: bool = True,
) -> PolicyBatch:
    """`policy_batch` of a meta-batch's ``episodes`` (``[K, B, T]``), refused for the first
    task whose rewards, returns or advantages are not finite.

    Args:
        episodes: the rollouts, one leading index per task.
        iteration: the iteration named in the error (as the user counts it, from 1).
        phase: the episodes named in the error (e.g. ``"inner step 0"``, ``"outer"``).
        discount, gae_lambda, normalize: as `policy_batch`.

    Raises:
        NonFiniteEpisodesError: naming the task, the iteration and the phase.
    """
    bad = ~torch.isfinite(episodes.rewards.flatten(1)).all(dim=1)
    if bad.any():  # before the baseline's least squares, which fails on NaN
        raise NonFiniteEpisodesError("rewards", int(bad.nonzero()[0, 0]), iteration, phase)
    batch = policy_batch(episodes, discount=discount, gae_lambda=gae_lambda, normalize=normalize)
    check_finite(batch, iteration, phase)
    return batch
