"""metalearn.rl against independent references: the 2D navigation env against a per-agent
loop of the paper's environment, returns/GAE/the baseline against loops and a dense least
squares, the meta-objective under vmap against the loop over tasks, TRPO's direction against
a dense solve with the dense KL Hessian (all float64)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.func import functional_call, vmap

from metalearn.functional import flatten_tree, tree_map
from metalearn.rl import (
    TRPO,
    GaussianMLPPolicy,
    MetaObjective,
    Navigation2D,
    NonFiniteEpisodesError,
    check_finite,
    clipped_outer_step,
    discounted_returns,
    episode_noise,
    fit_linear_baseline,
    gae,
    linear_baseline_values,
    policy_batch,
    rollout,
)
from metalearn.rl.baseline import baseline_features
from metalearn.rl.seeds import derive_seeds
from metalearn.second_order import hessian, hvp
from tests.conftest import ROOT

DT = torch.float64


def nav_rollout(task, policy, params, tasks, episodes, phase, per_task=False, goals=None):
    goals = task.sample_goals(derive_seeds(7, 0, count=tasks), DT) if goals is None else goals
    seeds = [derive_seeds(7, k, phase, count=episodes) for k in range(tasks)]
    noise = episode_noise(policy, seeds, task.horizon, DT)
    return goals, rollout(task.make_env(goals, episodes), policy, params, noise, per_task=per_task)


def small_policy(seed=0):
    torch.manual_seed(seed)
    policy = GaussianMLPPolicy(2, 2, hidden=(5,), init_std=0.5).double()
    return policy, {k: v.detach() for k, v in policy.named_parameters()}


def test_navigation_matches_a_loop_of_the_papers_environment():
    task = Navigation2D(horizon=30)
    policy, params = small_policy()
    # a large step mean so some agents reach their goal and stop early
    params["mean.2.bias"] = torch.tensor([3.0, -3.0], dtype=DT)
    goals, ep = nav_rollout(task, policy, params, 3, 4, 0)
    goals[0] = torch.tensor([0.1, -0.1], dtype=DT)
    _, ep = nav_rollout(task, policy, params, 3, 4, 0, goals=goals)
    assert (ep.mask.sum(-1) < 30).any()  # the early end is exercised
    for k in range(3):
        for b in range(4):
            state, alive = np.zeros(2), True
            for t in range(30):
                assert ep.mask[k, b, t].item() == float(alive)
                if not alive:
                    assert ep.rewards[k, b, t].item() == 0.0
                    continue
                np.testing.assert_allclose(ep.obs[k, b, t].numpy(), state, atol=1e-12)
                # rllab's normalize: lb + (a + 1) / 2 (ub - lb), clipped to [lb, ub]
                move = np.clip(-0.1 + (ep.actions[k, b, t].numpy() + 1) * 0.1, -0.1, 0.1)
                state = state + move
                x, y = state - goals[k].numpy()
                assert math.isclose(ep.rewards[k, b, t].item(), -((x**2 + y**2) ** 0.5))
                alive = not (abs(x) < 0.01 and abs(y) < 0.01)


def test_an_episode_is_its_seeds_whatever_the_batch():
    task = Navigation2D(horizon=10)
    policy, params = small_policy()
    _, small = nav_rollout(task, policy, params, 2, 3, 0)
    _, large = nav_rollout(task, policy, params, 4, 8, 0)
    torch.testing.assert_close(small.actions, large.actions[:2, :3], rtol=0, atol=0)
    goals = task.sample_goals(derive_seeds(7, 0, count=4), DT)
    assert ((goals.abs() <= 0.5).all()) and goals.shape == (4, 2)


def test_returns_gae_and_baseline_against_loops():
    torch.manual_seed(1)
    rewards = torch.randn(2, 3, 6, dtype=DT)
    mask = torch.ones_like(rewards)
    mask[0, 1, 4:] = 0
    rewards = rewards * mask
    values = torch.randn_like(rewards)
    gamma, lam = 0.9, 0.8
    returns = discounted_returns(rewards, mask, gamma)
    adv = gae(rewards, values, mask, gamma, lam)
    for k in range(2):
        for b in range(3):
            n = int(mask[k, b].sum())
            r, v = rewards[k, b, :n].tolist(), values[k, b, :n].tolist() + [0.0]
            for t in range(n):
                expect = sum(gamma**i * r[t + i] for i in range(n - t))
                assert math.isclose(returns[k, b, t].item(), expect, abs_tol=1e-12)
                deltas = [r[i] + gamma * v[i + 1] - v[i] for i in range(n)]
                expect = sum((gamma * lam) ** i * deltas[t + i] for i in range(n - t))
                assert math.isclose(adv[k, b, t].item(), expect, abs_tol=1e-12)
            assert (adv[k, b, n:] == 0).all()
    obs = torch.randn(2, 3, 6, 2, dtype=DT)
    coeffs = fit_linear_baseline(obs, returns, mask, reg_coeff=1e-5)
    for k in range(2):
        valid = mask[k].bool()
        x = baseline_features(obs[k])[valid].numpy()
        y = returns[k][valid].numpy()
        expect = np.linalg.solve(x.T @ x + 1e-5 * np.eye(x.shape[1]), x.T @ y)
        np.testing.assert_allclose(coeffs[k].numpy(), expect, rtol=1e-8, atol=1e-10)
    values = linear_baseline_values(coeffs, obs, mask)
    assert values[0, 1, 4:].abs().max() == 0


def meta_batch(objective, steps=1, tasks=3, episodes=4, horizon=6):
    """Tasks sampled as a run samples them: inner episodes with theta (then with each
    adapted phi for more steps), outer episodes with the adapted policy."""
    task = Navigation2D(horizon=horizon)
    policy, params = small_policy()
    goals, ep = nav_rollout(task, policy, params, tasks, episodes, 0)
    inner = [policy_batch(ep, discount=0.99)]
    for step in range(1, steps + 1):
        phis = vmap(lambda *b: objective.adapt(policy, params, b)[0])(*inner)
        # the sampling path: one step per call, from theta then from each task's phi
        steps_taken = objective.adapt_tasks(policy, params, inner[0])
        for later in inner[1:]:
            steps_taken = objective.adapt_tasks(policy, steps_taken, later, per_task=True)
        for name in phis:
            torch.testing.assert_close(steps_taken[name], phis[name], rtol=1e-12, atol=1e-12)
        _, ep = nav_rollout(task, policy, phis, tasks, episodes, step, True, goals)
        inner.append(policy_batch(ep, discount=0.99))
    return policy, params, objective.prepare(policy, params, tuple(inner[:-1]), inner[-1])


@pytest.mark.parametrize("steps, inner_score", [(1, False), (1, True), (2, True)])
def test_the_vmapped_task_batch_equals_the_loop(steps, inner_score):
    objective = MetaObjective(lr=0.05, inner_score=inner_score)
    policy, params, tasks = meta_batch(objective, steps)
    theta = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    results = []
    for vectorize in (True, False):
        surrogate, kl = objective(policy, theta, tasks, vectorize=vectorize)
        g = torch.autograd.grad(surrogate, list(theta.values()))
        v = {k: torch.ones_like(p) for k, p in theta.items()}
        fv = hvp(lambda p, vec=vectorize: objective(policy, p, tasks, vectorize=vec)[1], theta, v)
        results.append((surrogate, kl, torch.cat([x.reshape(-1) for x in g]), flatten_tree(fv)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert results[0][1].abs() < 1e-12  # KL 0 at the sampling parameters
    assert results[0][3].abs().max() > 1e-3  # a Fisher product that is not trivially 0


def test_trpo_direction_equals_the_dense_solve():
    objective = MetaObjective(lr=0.05, inner_score=True)
    policy, params, tasks = meta_batch(objective)
    trpo = TRPO(damping=1e-3, cg_iters=500, cg_tol=1e-13)
    _, g, x, _ = trpo.direction(lambda p: objective(policy, p, tasks), params)
    fisher = hessian(lambda p: objective(policy, p, tasks, vectorize=False)[1], params)
    dense = torch.linalg.solve(
        fisher + 1e-3 * torch.eye(fisher.shape[0], dtype=DT), flatten_tree(g)
    )
    torch.testing.assert_close(flatten_tree(x), dense, rtol=1e-7, atol=1e-9)
    eigenvalues = torch.linalg.eigvalsh(fisher)
    assert eigenvalues.min() > -1e-10 and eigenvalues.max() > 1e-3  # a PSD, nonzero Fisher


def test_trpo_step_improves_within_the_trust_region():
    objective = MetaObjective(lr=0.05)
    policy, params, tasks = meta_batch(objective, episodes=8)
    result = TRPO(max_kl=0.01).step(lambda p: objective(policy, p, tasks), params)
    assert result.accepted and result.surrogate_after > result.surrogate_before
    assert 0 < result.kl <= 0.01
    with torch.no_grad():
        value, kl = objective(policy, result.params, tasks)
    assert math.isclose(value.item(), result.surrogate_after) and math.isclose(kl.item(), result.kl)


def test_clipped_outer_step_raises_the_clipped_surrogate():
    objective = MetaObjective(lr=0.05, clip=0.2)
    policy, params, tasks = meta_batch(objective, episodes=8)
    theta = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    optimizer = torch.optim.Adam(theta.values(), lr=1e-2)
    history = clipped_outer_step(lambda p: objective(policy, p, tasks), theta, optimizer, 5)
    assert history[-1][0] > history[0][0] and history[0][1] == 0.0


def test_first_order_meta_gradient_is_the_outer_gradient_at_the_adapted_parameters():
    """FOMAML: d phi / d theta = I, so the meta-gradient is the outer surrogate's gradient
    taken at phi, written out here with phi as the leaf."""
    objective = MetaObjective(lr=0.05, first_order=True)
    policy, params, tasks = meta_batch(objective)
    theta = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    meta = torch.autograd.grad(objective(policy, theta, tasks)[0], list(theta.values()))
    expect = [torch.zeros_like(g) for g in meta]
    for k in range(3):
        inner, outer, old = tree_map(
            lambda x, k=k: x[k], (tasks.inner, tasks.outer, tasks.old_stats)
        )
        adapted = objective.adapt(policy, params, inner)[0]
        phi = {n: v.detach().requires_grad_(True) for n, v in adapted.items()}
        stats = functional_call(policy, phi, (outer.obs,))
        log_ratio = policy.log_prob(stats, outer.actions) - policy.log_prob(old, outer.actions)
        surrogate = (log_ratio.exp() * outer.advantages * outer.mask).sum() / outer.mask.sum()
        for i, g in enumerate(torch.autograd.grad(surrogate, list(phi.values()))):
            expect[i] += g / 3
    for g, e in zip(meta, expect):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


def test_gaussian_policy_log_prob_and_kl_match_torch_distributions():
    policy, params = small_policy()
    obs = torch.randn(4, 2, dtype=DT)
    stats = functional_call(policy, params, (obs,))
    other = (stats[0] + 0.3, stats[1] - 0.2)
    actions = torch.randn(4, 2, dtype=DT)
    normal = torch.distributions.Normal(stats[0], stats[1].exp())
    torch.testing.assert_close(policy.log_prob(stats, actions), normal.log_prob(actions).sum(-1))
    other_normal = torch.distributions.Normal(other[0], other[1].exp())
    expect = torch.distributions.kl_divergence(normal, other_normal).sum(-1)
    torch.testing.assert_close(policy.kl(stats, other), expect)


@pytest.mark.slow
def test_bench_rl_prints_a_row_per_shape_and_refuses_a_bad_shape():
    import subprocess
    import sys

    script = ROOT / "scripts" / "bench_rl.py"
    run = [sys.executable, str(script), "--repeats", "1", "--horizon", "3", "--shapes"]
    out = subprocess.run([*run, "2x2", "3x1"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith(("| 2x2", "| 3x1"))]
    assert len(rows) == 2
    bad = subprocess.run([*run, "2by2"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "TASKSxEPISODES" in bad.stderr


def test_a_non_finite_advantage_names_its_task_and_iteration():
    objective = MetaObjective(lr=0.05)
    _, _, tasks = meta_batch(objective)
    check_finite(tasks.outer, 4, "outer")  # finite: nothing raised
    advantages = tasks.outer.advantages.clone()
    advantages[2, 1, 3] = float("nan")
    with pytest.raises(NonFiniteEpisodesError) as error:
        check_finite(tasks.outer._replace(advantages=advantages), 4, "outer")
    assert str(error.value).startswith(
        "non-finite advantages in task 2 of iteration 4 (outer episodes);"
    )
