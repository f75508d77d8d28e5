"""Adam (Kingma & Ba, 2015, Algorithm 1), differentiable, as ``torch.optim.Adam`` computes it.

For step ``t = 1, 2, ...`` from ``m_0 = v_0 = 0``::

    m_t = beta1 * m_{t-1} + (1 - beta1) * g_t
    v_t = beta2 * v_{t-1} + (1 - beta2) * g_t^2
    p_t = p_{t-1} - lr / (1 - beta1^t) * m_t / (sqrt(v_t) / sqrt(1 - beta2^t) + eps)

``eps`` is added after the bias-corrected square root (Algorithm 1's
``m_hat / (sqrt(v_hat) + eps)``, torch.optim.Adam's form). higher's DifferentiableAdam
uses the paper's "efficient" form (end of Sec. 2), ``eps`` added before the bias
correction; the two are the same update at ``eps = 0``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from metalearn.optim.base import Hyperparameter, InnerOptimizer, safe_sqrt

__all__ = ["Adam", "adam_update"]


def adam_update(
    p: Tensor,
    g: Tensor,
    m: Tensor,
    v: Tensor,
    *,
    t: int,
    lr: float | Tensor,
    beta1: float | Tensor = 0.9,
    beta2: float | Tensor = 0.999,
    eps: float | Tensor = 1e-8,
) -> tuple[Tensor, Tensor, Tensor]:
    """One Adam step on one tensor (the equations of the module docstring).

    Args:
        p: the parameter, any shape.
        g: its gradient, ``p``'s shape.
        m, v: the first and second moments ``m_{t-1}, v_{t-1}``, ``p``'s shape.
        t: the step number, from 1.
        lr, beta1, beta2, eps: floats or broadcastable tensors (learnable ones included).

    Returns:
        ``(p_t, m_t, v_t)``.
    """
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * (g * g)
    correction1 = 1 - beta1**t
    correction2 = 1 - beta2**t
    denom = safe_sqrt(v) / correction2**0.5 + eps
    return p - (lr / correction1) * (m / denom), m, v


@dataclass(frozen=True)
class Adam(InnerOptimizer):
    """Adam on a parameter dict; see `adam_update`. Each hyperparameter is a
    `metalearn.optim.Hyperparameter` (fixed, per tensor, per step, learnable).

    Attributes:
        beta1, beta2: the moments' decay rates.
        eps: added to the bias-corrected ``sqrt(v)``.
    """

    beta1: Hyperparameter = 0.9
    beta2: Hyperparameter = 0.999
    eps: Hyperparameter = 1e-8

    hyperparameters = ("beta1", "beta2")

    def slots(self) -> int:
        return 2

    def update_tensor(
        self,
        p: Tensor,
        g: Tensor,
        slots: tuple[Tensor, ...],
        lr: float | Tensor,
        *,
        name: str,
        step: int,
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        new, m, v = adam_update(
            p, g, *slots, t=step + 1, lr=lr, beta1=self.hyper("beta1", name, step),
            beta2=self.hyper("beta2", name, step), eps=self.hyper("eps", name, step),
        )  # fmt: skip
        return new, (m, v)
