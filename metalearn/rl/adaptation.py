"""The inner loop of MAML on a policy: one policy-gradient step through `metalearn.engine`.

The inner loss is the likelihood-ratio (REINFORCE) surrogate with the advantages held
constant (Williams, 1992; Finn et al., 2017, Eq. 4 with the baseline of Sec. 5.3)::

    L_in(phi) = - (1/N) sum_{b, t} mask_bt log pi_phi(a_bt | s_bt) A_bt

whose gradient is the policy-gradient estimate ``-g_hat``; the step is
``phi' = phi - alpha grad L_in(phi) = phi + alpha g_hat`` (Eq. 1), run by
`metalearn.engine.run_inner_loop`, so it is the engine's functional inner update, second
order unless ``first_order`` (then g_hat is a constant of the outer loss, FOMAML).

``N`` is the number of valid steps (``average="steps"``, the default: maml_rl's inner
surrogate, ``- tf.reduce_mean(logli * adv)`` over a task's concatenated steps in
``sandbox/rocky/tf/algos/maml_npo.py``, so its ``fast_lr`` is this rate) or of episodes
(``"episodes"``: ``g_hat`` is then the unbiased estimate of the gradient of the expected
return, and the same step takes about ``1/T`` of the ``"steps"`` rate on full-length
episodes). An episode counts when its first step is valid (a batch sampled to a step
budget pads the tasks that completed fewer episodes with empty ones,
`metalearn.rl.sampler.TaskSampler`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from torch import Tensor, nn

from metalearn.engine import InnerLoop, run_inner_loop
from metalearn.optim import Hyperparameter as LearningRate
from metalearn.rl.episodes import PolicyBatch

__all__ = ["Average", "adapt_policy", "policy_gradient_loss"]

Average = Literal["episodes", "steps"]


def _normalizer(mask: Tensor, average: Average) -> Tensor:
    """``[B, T]`` mask -> the valid episodes' count (``"episodes"``) or the valid steps'."""
    return mask[..., 0].sum() if average == "episodes" else mask.sum()


def policy_gradient_loss(policy: nn.Module, average: Average = "steps"):
    """``loss_fn(stats, (actions, advantages, mask)) -> L_in``, the engine's `LossFn` form.

    Args:
        policy: supplies ``log_prob(stats, actions)``.
        average: what the sum is divided by (module docstring).
    """
    if average not in ("episodes", "steps"):  # refused here, not at the first inner step
        raise ValueError(f"unknown average {average!r}; choose 'episodes' or 'steps'")

    def loss_fn(stats: tuple[Tensor, ...], targets: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        actions, advantages, mask = targets
        log_prob = policy.log_prob(stats, actions)
        return -(log_prob * advantages * mask).sum() / _normalizer(mask, average)

    return loss_fn


def adapt_policy(
    policy: nn.Module,
    params: Mapping[str, Tensor],
    batch: PolicyBatch,
    *,
    lr: LearningRate,
    first_order: bool = False,
    average: Average = "steps",
) -> dict[str, Tensor]:
    """One inner policy-gradient step on one task's episodes: ``phi' = phi + lr g_hat``.

    Args:
        policy: the policy module.
        params: phi, name -> tensor.
        batch: one task's episodes with their advantages (leaves ``[B, T, ...]``).
        lr: the inner rate (a float, or per-parameter as `metalearn.optim.Hyperparameter`).
        first_order: treat g_hat as a constant (FOMAML).
        average: `policy_gradient_loss`'s normaliser.

    Returns:
        The adapted parameters, a new dict.
    """
    inner = InnerLoop(
        steps=1, lr=lr, first_order=first_order,
        loss_fn=policy_gradient_loss(policy, average),
    )  # fmt: skip
    support = (batch.obs, (batch.actions, batch.advantages, batch.mask))
    return run_inner_loop(policy, params, support, inner)[0]
