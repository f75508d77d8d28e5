"""MAML's meta-objective on policies: adapt on sampled episodes, then a surrogate of the
adapted policy's return, differentiated exactly through the inner steps.

The objective (the post-adaptation expected return with the inner step's own samples)::

    F(theta) = E_{tau_0 ~ pi_theta} E_{tau_1 ~ pi_phi1} ... E_{tau ~ pi_phiK} [R(tau)],
    phi_{k+1} = phi_k + alpha g_hat(phi_k, tau_k),  phi_0 = theta,

``g_hat`` the policy-gradient estimate of `metalearn.rl.adaptation`. Its gradient has two
parts (the likelihood-ratio form keeping the inner step's dependence on the policy: the
"formulation I" of Rothfuss et al., 2019, the E-MAML gradient of Stadie et al., 2018)::

    grad F = E[ d/dtheta J(phi_K(theta, tau_0..K-1)) ]                 (through the steps)
           + E[ J(phi_K) sum_k grad_theta log p_{phi_k}(tau_k) ]          (the inner samples)

The first is the outer policy gradient of the adapted policy backpropagated through the
inner steps (MAML's own term, exact for the inner likelihood-ratio surrogate: autograd
differentiates through ``g_hat``); the second, which the MAML paper's estimator drops, is the
score of the inner episodes times the adapted policy's return. `MetaObjective.task` returns
a scalar whose gradient at the sampling parameters estimates them:

* ``inner_score=False`` (the default, the paper's and maml_rl's estimator): the outer
  likelihood-ratio surrogate (importance ratio to the sampling policy, as TRPO's) through
  the inner steps: the first term only, so biased for ``grad F``;
* ``inner_score=True``: plus ``(S(theta) - S_0) (R_out - c)``, S the inner episodes'
  log-likelihood, S_0 its value at the sampling parameters and R_out the outer episodes'
  mean return: 0 at the sampling parameters, its gradient there the score times the return
  (the first-order part of DiCE's magic term, Foerster et al., 2018, kept with a value so
  that a line search sees the change it models). The sum is unbiased for ``grad F``. c is
  a constant independent of the task's inner episodes (0, or `leave_one_out` of the other
  tasks' returns), so it changes the variance only.

``tests/rl/test_rl_exact.py`` checks both against ``grad F`` computed exactly by enumerating a
small MDP's trajectories: ``inner_score=True`` within 5 standard errors at N and 16 N tasks,
``False`` many standard errors away. The score term's variance grows with the number of
inner steps it sums over (B x T log-probabilities): in a single-seed check on 2D navigation
at maml_rl's batch sizes it dominated the meta-gradient, and TRPO on it lowered the
post-adaptation return where the paper's estimator raised it; hence the default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from metalearn.functional import tree_map
from metalearn.optim import Hyperparameter as LearningRate
from metalearn.rl.adaptation import Average, _normalizer, adapt_policy
from metalearn.rl.episodes import PolicyBatch
from metalearn.rl.policy import Stats

__all__ = ["MetaObjective", "MetaTask", "leave_one_out"]


class MetaTask(NamedTuple):
    """One task's samples for the meta-objective (a pytree; stacked ``[K, ...]`` for a batch)."""

    inner: tuple[PolicyBatch, ...]
    """One batch per inner step; batch k was sampled with phi_k."""
    outer: PolicyBatch
    """Sampled with the adapted policy phi_K."""
    old_stats: Stats
    """The sampling (adapted) policy's statistics on ``outer.obs``: the ratio's denominator
    and the KL's first argument."""
    inner_log_likelihood: Tensor
    """``[]``: S_0, the inner episodes' log-likelihood at the sampling parameters."""
    score_baseline: Tensor
    """``[]``: the c subtracted from the outer return in the score term."""


def leave_one_out(outer_returns: Tensor) -> Tensor:
    """``[K]`` mean outer returns -> for each task the mean of the other tasks' (a score
    baseline independent of the task's own samples)."""
    k = outer_returns.shape[0]
    if k < 2:
        return torch.zeros_like(outer_returns)
    return (outer_returns.sum() - outer_returns) / (k - 1)


@dataclass(frozen=True)
class MetaObjective:
    """The meta-surrogate's settings.

    Attributes:
        lr: the inner policy-gradient step's rate (alpha).
        first_order: FOMAML: no gradient through the inner steps' gradients.
        average: the surrogates' normaliser (`metalearn.rl.adaptation`): by default each
            task's valid steps, as maml_rl's inner and outer surrogates
            (``tf.reduce_mean`` over a task's steps, ``maml_npo.py``).
        inner_score: add the score of the inner episodes, unbiased for the post-adaptation
            return's gradient and of high variance (module docstring); False: the MAML
            paper's estimator, which omits it.
        clip: PPO's clipped ratio (Schulman et al., 2017, Eq. 7) for the outer surrogate;
            None: the plain ratio (TRPO's).
    """

    lr: LearningRate = 0.1
    first_order: bool = False
    average: Average = "steps"
    inner_score: bool = False
    clip: float | None = None

    def adapt(
        self, policy: nn.Module, params: Mapping[str, Tensor], inner: tuple[PolicyBatch, ...]
    ) -> tuple[dict[str, Tensor], Tensor]:
        """phi_K and ``S = sum_k log p_{phi_k}(tau_k)`` (the inner episodes' log-likelihood)."""
        phi = dict(params)
        terms = []
        for batch in inner:
            stats = functional_call(policy, phi, (batch.obs,))
            terms.append((policy.log_prob(stats, batch.actions) * batch.mask).sum())
            phi = adapt_policy(
                policy, phi, batch, lr=self.lr, first_order=self.first_order, average=self.average
            )
        if not terms:  # no inner step: the policy's own surrogate (the pretrained baseline)
            return phi, next(iter(params.values())).new_zeros(())
        return phi, torch.stack(terms).sum()

    @torch.no_grad()
    def adapt_tasks(
        self,
        policy: nn.Module,
        params: Mapping[str, Tensor],
        batch: PolicyBatch,
        *,
        per_task: bool = False,
    ) -> dict[str, Tensor]:
        """One inner step for each of ``[K]`` tasks (no graph kept): the parameters to sample
        the next episodes with (`metalearn.rl.sampler.rollout` with ``per_task=True``).

        Args:
            policy: the policy module.
            params: theta (shared), or with ``per_task`` each task's own, leaves ``[K, ...]``
                (a further adaptation step, as evaluation's 2nd and 3rd).
            batch: the tasks' episodes, leaves ``[K, B, T, ...]``.
            per_task: whether ``params`` are stacked over tasks.

        Returns:
            name -> ``[K, *shape]``.
        """

        def one(p: Mapping[str, Tensor], b: PolicyBatch) -> dict[str, Tensor]:
            return adapt_policy(
                policy, p, b, lr=self.lr, first_order=self.first_order, average=self.average
            )

        return vmap(one, in_dims=(0 if per_task else None, 0))(dict(params), batch)

    def task(
        self, policy: nn.Module, params: Mapping[str, Tensor], task: MetaTask
    ) -> tuple[Tensor, Tensor]:
        """One task's ``(surrogate, mean KL(old || adapted) over its outer steps)``, both ``[]``."""
        phi, log_likelihood = self.adapt(policy, params, task.inner)
        outer = task.outer
        stats = functional_call(policy, phi, (outer.obs,))
        log_ratio = policy.log_prob(stats, outer.actions) - policy.log_prob(
            task.old_stats, outer.actions
        )
        ratio = torch.exp(log_ratio)
        gain = ratio * outer.advantages
        if self.clip is not None:
            clipped = ratio.clamp(1 - self.clip, 1 + self.clip) * outer.advantages
            gain = torch.minimum(gain, clipped)
        norm = _normalizer(outer.mask, self.average)
        surrogate = (gain * outer.mask).sum() / norm
        if self.inner_score:
            episodes = outer.mask[..., 0].sum()  # the valid ones (a step budget pads)
            weight = (outer.returns.sum() - episodes * task.score_baseline) / norm
            surrogate = surrogate + (log_likelihood - task.inner_log_likelihood) * weight.detach()
        kl = (policy.kl(task.old_stats, stats) * outer.mask).sum() / outer.mask.sum()
        return surrogate, kl

    @torch.no_grad()
    def prepare(
        self,
        policy: nn.Module,
        params: Mapping[str, Tensor],
        inner: tuple[PolicyBatch, ...],
        outer: PolicyBatch,
        score_baseline: Tensor | None = None,
    ) -> MetaTask:
        """The `MetaTask` batch of ``[K]`` tasks sampled at ``params``: the sampling (adapted)
        policy's statistics on the outer observations and S_0, recomputed here.

        Args:
            policy: the policy module.
            params: theta, the parameters the inner episodes were sampled with.
            inner: one `PolicyBatch` per inner step, leaves ``[K, B, T, ...]``.
            outer: the adapted policies' episodes, ``[K, B, T, ...]``.
            score_baseline: ``[K]`` (default `leave_one_out` of the mean outer returns).
        """

        def one(task_inner: tuple[PolicyBatch, ...], obs: Tensor) -> tuple[Stats, Tensor]:
            phi, log_likelihood = self.adapt(policy, params, task_inner)
            return functional_call(policy, phi, (obs,)), log_likelihood

        stats, log_likelihood = vmap(one)(inner, outer.obs)
        if score_baseline is None:
            score_baseline = leave_one_out(outer.returns.mean(-1))
        return MetaTask(inner, outer, stats, log_likelihood, score_baseline)

    def __call__(
        self,
        policy: nn.Module,
        params: Mapping[str, Tensor],
        tasks: MetaTask,
        *,
        vectorize: bool = True,
    ) -> tuple[Tensor, Tensor]:
        """A meta-batch of tasks' (leaves stacked ``[K, ...]``) ``(surrogate, KL)``: the mean
        over tasks of `task`'s surrogate, and the KL averaged over all the tasks' outer steps
        at once (each task's mean weighted by its valid steps), as maml_rl's constraint,
        ``tf.reduce_mean(tf.concat(kls, 0))`` of the per-step KLs (``maml_npo.py``). Under
        `torch.func.vmap` over tasks, or a loop (the reference)."""
        if vectorize:
            surrogates, kls = vmap(lambda task: self.task(policy, params, task))(tasks)
        else:
            count = tasks.score_baseline.shape[0]
            results = [
                self.task(policy, params, tree_map(lambda x, k=k: x[k], tasks))
                for k in range(count)
            ]
            surrogates = torch.stack([r[0] for r in results])
            kls = torch.stack([r[1] for r in results])
        steps = tasks.outer.mask.flatten(1).sum(1)  # [K]
        return surrogates.mean(), (kls * steps).sum() / steps.sum()
