"""`metalearn.rl`'s defaults take maml_rl's step: each formula written out here in plain
float64 torch from maml_rl's code (cbfinn/maml_rl at 9c8e2eb), on a task's valid steps
concatenated as its sampler concatenates paths, against the library called with no options.

- ``rllab/sampler/base.py`` ``process_samples``: returns, the linear feature baseline fitted
  on the task's paths, GAE, then ``center_advantages`` over the task's steps;
- ``sandbox/rocky/tf/algos/maml_npo.py``: the inner surrogate ``- reduce_mean(logli * adv)``,
  the step ``theta - fast_lr * grad``, the outer surrogate the mean over tasks of
  ``- reduce_mean(ratio * adv)``, the constraint ``reduce_mean(concat(kls))``.
"""

from __future__ import annotations

import math

import torch

from metalearn.rl import Episodes, GaussianMLPPolicy, MetaObjective, adapt_policy, policy_batch

K, B, T, OBS, ACT = 3, 4, 7, 2, 2
GAMMA, ALPHA = 0.99, 0.5


def episodes(seed: int) -> Episodes:
    """``[K, B, T]`` episodes of unequal lengths (some end before T, as at a goal)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (K, B), generator=g)
    mask = (torch.arange(T) < lengths[..., None]).double()
    obs = torch.randn(K, B, T, OBS, generator=g, dtype=torch.float64)
    actions = torch.randn(K, B, T, ACT, generator=g, dtype=torch.float64)
    rewards = torch.randn(K, B, T, generator=g, dtype=torch.float64) * mask
    return Episodes(obs * mask[..., None], actions * mask[..., None], rewards, mask)


def paths(ep: Episodes, k: int) -> list[dict]:
    """Task k's episodes as rllab's paths: only the steps taken."""
    out = []
    for b in range(B):
        n = int(ep.mask[k, b].sum())
        out.append(
            {"obs": ep.obs[k, b, :n], "act": ep.actions[k, b, :n], "r": ep.rewards[k, b, :n]}
        )
    return out


def discount_cumsum(x: torch.Tensor, discount: float) -> torch.Tensor:
    return torch.stack(
        [sum(discount**j * x[i + j] for j in range(len(x) - i)) for i in range(len(x))]
    )


def features(obs: torch.Tensor) -> torch.Tensor:
    """rllab's LinearFeatureBaseline._features."""
    o = obs.clamp(-10, 10)
    al = torch.arange(len(obs), dtype=obs.dtype)[:, None] / 100.0
    return torch.cat([o, o**2, al, al**2, al**3, torch.ones_like(al)], dim=1)


def process_samples(task_paths: list[dict]) -> dict:
    """rllab's process_samples with maml_rl's settings (discount 0.99, gae_lambda 1,
    center_adv): the baseline fitted first, then predicted, on the same paths."""
    returns = [discount_cumsum(p["r"], GAMMA) for p in task_paths]
    x = torch.cat([features(p["obs"]) for p in task_paths])
    y = torch.cat(returns)
    gram = x.T @ x + 1e-5 * torch.eye(x.shape[1], dtype=x.dtype)
    coeffs = torch.linalg.solve(gram, x.T @ y)  # lstsq of the regularised normal equations
    advantages = []
    for p in task_paths:
        values = torch.cat([features(p["obs"]) @ coeffs, torch.zeros(1, dtype=x.dtype)])
        deltas = p["r"] + GAMMA * values[1:] - values[:-1]
        advantages.append(discount_cumsum(deltas, GAMMA * 1.0))
    adv = torch.cat(advantages)
    adv = (adv - adv.mean()) / (adv.std(unbiased=False) + 1e-8)  # util.center_advantages
    obs = torch.cat([p["obs"] for p in task_paths])
    act = torch.cat([p["act"] for p in task_paths])
    return {"obs": obs, "act": act, "adv": adv}


def mlp(params: dict, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2-layer ReLU Gaussian policy written out: (mean, log_std)."""
    h = torch.relu(obs @ params["mean.0.weight"].T + params["mean.0.bias"])
    mean = h @ params["mean.2.weight"].T + params["mean.2.bias"]
    return mean, params["log_std"].expand_as(mean)


def logli(stats, actions: torch.Tensor) -> torch.Tensor:
    """DiagonalGaussian.log_likelihood_sym."""
    mean, log_std = stats
    z = (actions - mean) / torch.exp(log_std)
    return -(log_std.sum(-1)) - 0.5 * (z**2).sum(-1) - 0.5 * ACT * math.log(2 * math.pi)


def kl(old, new) -> torch.Tensor:
    """DiagonalGaussian.kl_sym, without its 1e-8 in the denominator."""
    (m0, s0), (m1, s1) = old, new
    numerator = (m0 - m1) ** 2 + torch.exp(2 * s0) - torch.exp(2 * s1)
    return (numerator / (2 * torch.exp(2 * s1)) + s1 - s0).sum(-1)


def inner_step(params: dict, data: dict) -> dict:
    """policy.updated_dist_info_sym: theta - fast_lr * grad of - reduce_mean(logli * adv)."""
    surr = -(logli(mlp(params, data["obs"]), data["act"]) * data["adv"]).mean()
    grads = torch.autograd.grad(surr, list(params.values()), create_graph=True)
    return {k: v - ALPHA * g for (k, v), g in zip(params.items(), grads)}


def setup():
    torch.manual_seed(0)
    policy = GaussianMLPPolicy(OBS, ACT, hidden=(5,)).double()
    theta = {k: v.detach() for k, v in policy.named_parameters()}
    inner_ep, outer_ep = episodes(1), episodes(2)
    inner = [process_samples(paths(inner_ep, k)) for k in range(K)]
    outer = [process_samples(paths(outer_ep, k)) for k in range(K)]
    return policy, theta, inner_ep, outer_ep, inner, outer


def test_policy_batch_defaults_are_maml_rls_process_samples():
    _, _, inner_ep, _, inner, _ = setup()
    batch = policy_batch(inner_ep)
    for k in range(K):
        valid = batch.mask[k].bool()
        torch.testing.assert_close(
            batch.advantages[k][valid], inner[k]["adv"], rtol=1e-9, atol=1e-9
        )


def test_adapt_policy_default_is_maml_rls_inner_step():
    policy, theta, inner_ep, _, inner, _ = setup()
    batch = policy_batch(inner_ep)
    for k in range(K):
        one = type(batch)(*(x[k] for x in batch))
        ours = adapt_policy(policy, theta, one, lr=ALPHA)
        theirs = inner_step({n: v.clone().requires_grad_(True) for n, v in theta.items()}, inner[k])
        for name in theta:
            torch.testing.assert_close(ours[name], theirs[name].detach(), rtol=1e-10, atol=1e-12)


def test_meta_objective_defaults_are_maml_rls_surrogate_and_kl():
    """Value and gradient at a moved theta (so the ratio and the KL are not trivial)."""
    policy, theta, inner_ep, outer_ep, inner, outer = setup()
    objective = MetaObjective(lr=ALPHA)  # every other setting its default
    tasks = objective.prepare(policy, theta, (policy_batch(inner_ep),), policy_batch(outer_ep))
    g = torch.Generator().manual_seed(3)
    moved = {k: (v + 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype)).requires_grad_(True)
             for k, v in theta.items()}  # fmt: skip
    surrogate, mean_kl = objective(policy, moved, tasks)
    ours = torch.autograd.grad(surrogate, list(moved.values()), retain_graph=True)
    ours_kl = torch.autograd.grad(mean_kl, list(moved.values()))

    at = {k: v.detach().clone().requires_grad_(True) for k, v in moved.items()}
    surr_objs, kls = [], []
    for k in range(K):
        with torch.enable_grad():
            start = {n: v.clone().requires_grad_(True) for n, v in theta.items()}
            old = tuple(s.detach() for s in mlp(inner_step(start, inner[k]), outer[k]["obs"]))
        new = mlp(inner_step(at, inner[k]), outer[k]["obs"])
        ratio = torch.exp(logli(new, outer[k]["act"]) - logli(old, outer[k]["act"]))
        surr_objs.append(-(ratio * outer[k]["adv"]).mean())
        kls.append(kl(old, new))
    surr_obj = torch.stack(surr_objs).mean()  # minimised: the library maximises its negative
    theirs_kl_value = torch.cat(kls).mean()
    theirs = torch.autograd.grad(-surr_obj, list(at.values()), retain_graph=True)
    theirs_kl = torch.autograd.grad(theirs_kl_value, list(at.values()))
    torch.testing.assert_close(surrogate, -surr_obj.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(mean_kl, theirs_kl_value.detach(), rtol=1e-10, atol=1e-12)
    for a, b in zip(ours + ours_kl, theirs + theirs_kl):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10)
    # the tasks' lengths differ, so the KL over all steps is not the mean of the tasks' means
    per_task = torch.stack([x.mean() for x in kls]).mean()
    assert abs(float((per_task - theirs_kl_value).detach())) > 1e-6


def test_meta_objective_loop_and_vmap_agree_on_the_kl_over_all_steps():
    policy, theta, inner_ep, outer_ep, _, _ = setup()
    objective = MetaObjective(lr=ALPHA)
    tasks = objective.prepare(policy, theta, (policy_batch(inner_ep),), policy_batch(outer_ep))
    moved = {k: v + 0.05 for k, v in theta.items()}
    vmapped = objective(policy, moved, tasks)
    looped = objective(policy, moved, tasks, vectorize=False)
    for a, b in zip(vmapped, looped):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
