"""The meta-RL estimators against exact answers on a tiny MDP (tests/rl/rl_mdp.py).

The expected return and the post-adaptation expected return are computed by enumerating
every trajectory in float64 and differentiated by autograd; the estimators' means over many
seeded tasks must lie within 5 standard errors (their own sample standard error) of those
exact gradients, at N and at 16 N tasks, the error shrinking as 1/sqrt(N).
"""

from __future__ import annotations

import torch
from torch.func import functional_call, grad, vmap

from metalearn.rl import (
    MetaObjective,
    episode_noise,
    policy_batch,
    policy_gradient_loss,
    rollout,
)
from metalearn.rl.seeds import derive_seeds
from tests.rl.rl_mdp import (
    HORIZON,
    TabularSoftmax,
    TinyEnv,
    expected_return,
    post_adaptation_return,
)

LOGITS = torch.tensor([[0.3, -0.2], [-0.4, 0.1]], dtype=torch.float64)
LR = 0.3
N = 500


def sample(policy, params, tasks: int, episodes: int, phase: int, seed: int, per_task=False):
    seeds = [derive_seeds(seed, k, phase, count=episodes) for k in range(tasks)]
    noise = episode_noise(policy, seeds, HORIZON, torch.float64)
    episodes_ = rollout(TinyEnv(tasks, episodes), policy, params, noise, per_task=per_task)
    return policy_batch(episodes_, discount=1.0, gae_lambda=1.0, baseline=False, normalize=False)


def flat(grads: dict) -> torch.Tensor:
    return grads["logits"].reshape(grads["logits"].shape[0], -1)


def check_unbiased(estimates: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|mean - exact| < 5 standard errors in every coordinate; returns that bound."""
    mean = estimates.mean(0)
    se = estimates.std(0) / estimates.shape[0] ** 0.5
    assert ((mean - exact).abs() < 5 * se).all(), (mean, exact, se)
    return 5 * se


def check_shrinks(estimates_n, estimates_16n, exact):
    """Unbiased at N and at 16 N, the error bound at 16 N a quarter of N's (1/sqrt(N)), so
    the error at 16 N is below what N allows: ``|mean_16N - exact| < 5 SE_16N ~ 1.25 SE_N``."""
    bound_n = check_unbiased(estimates_n, exact)
    bound_16n = check_unbiased(estimates_16n, exact)
    ratio = bound_n / bound_16n
    assert ((ratio > 3.5) & (ratio < 4.5)).all(), ratio


def policy_gradient_estimates(tasks: int, seed: int) -> torch.Tensor:
    policy = TabularSoftmax(LOGITS)
    params = {"logits": LOGITS}
    batch = sample(policy, params, tasks, 2, 0, seed)
    loss = policy_gradient_loss(policy, "episodes")

    def estimate(b):
        def f(p):
            stats = functional_call(policy, p, (b.obs,))
            return -loss(stats, (b.actions, b.advantages, b.mask))

        return grad(f)(params)

    return flat(vmap(estimate)(batch))


def meta_gradient_estimates(tasks: int, seed: int, inner_score: bool) -> torch.Tensor:
    policy = TabularSoftmax(LOGITS)
    params = {"logits": LOGITS}
    objective = MetaObjective(lr=LR, average="episodes", inner_score=inner_score)
    inner = sample(policy, params, tasks, 2, 0, seed)
    phis = vmap(lambda b: objective.adapt(policy, params, (b,))[0])(inner)
    outer = sample(policy, phis, tasks, 2, 1, seed, per_task=True)
    # c: any constant independent of the inner episodes
    meta = objective.prepare(policy, params, (inner,), outer, torch.full((tasks,), 1.5))
    one = grad(lambda p, task: objective.task(policy, p, task)[0])
    return flat(vmap(one, in_dims=(None, 0))(params, meta))


def test_policy_gradient_estimator_is_unbiased():
    theta = LOGITS.clone().requires_grad_(True)
    (exact,) = torch.autograd.grad(expected_return(theta), theta)
    exact = exact.reshape(-1)
    check_shrinks(policy_gradient_estimates(N, 1), policy_gradient_estimates(16 * N, 2), exact)


def test_meta_gradient_is_unbiased_for_the_post_adaptation_return():
    theta = LOGITS.clone().requires_grad_(True)
    (exact,) = torch.autograd.grad(post_adaptation_return(theta, 2, LR), theta)
    exact = exact.reshape(-1)
    check_shrinks(
        meta_gradient_estimates(N, 3, inner_score=True),
        meta_gradient_estimates(16 * N, 4, inner_score=True),
        exact,
    )


def test_dropping_the_inner_score_is_biased():
    """The MAML paper's estimator (no score term for the inner episodes) misses a term of
    grad F: at 16 N tasks its mean lies many standard errors away from the exact value."""
    theta = LOGITS.clone().requires_grad_(True)
    (exact,) = torch.autograd.grad(post_adaptation_return(theta, 2, LR), theta)
    estimates = meta_gradient_estimates(16 * N, seed=5, inner_score=False)
    se = estimates.std(0) / estimates.shape[0] ** 0.5
    z = ((estimates.mean(0) - exact.reshape(-1)).abs() / se).max().item()
    assert z > 10, z
