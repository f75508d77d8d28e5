"""The inner loop of MAML on a policy: one policy-gradient step through `metalearn.engine`.

The inner loss is the likelihood-ratio (REINFORCE) surrogate with the advantages held
constant (Williams, 1992; Finn et al., 2017, Eq. 4 with the baseline of Sec. 5.3)::

    L_in(phi) = - (1/N) sum_{b, t} mask_bt log pi_phi(a_bt | s_bt) A_bt

whose gradient is the policy-gradient estimate ``-g_hat``; the step is
``phi' = phi - alpha grad L_in(phi) = phi + alpha g_hat`` (Eq. 1), run by
`metalearn.engine.run_inner_loop`, so it is the engine's functional inner update, second
order unless ``first_order`` (then g_hat is a constant of the outer loss, FOMAML).

``N`` is the number of episodes (``average="episodes"``: ``g_hat`` is then the unbiased
estimate of the gradient of the expected return) or of valid steps (``"steps"``: the mean
over steps of maml_rl's surrogate, whose inner rate equals ``T`` times this one's
``"episodes"`` rate on full-length episodes).
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


def _normalizer(mask: Tensor, average: Average) -> Tensor | float:
    return float(mask.shape[-2]) if average == "episodes" else mask.sum()


def policy_gradient_loss(policy: nn.Module, average: Average = "episodes"):
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
    average: Average = "episodes",
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
