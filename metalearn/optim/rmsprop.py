"""RMSprop (Tieleman & Hinton, 2012, Lecture 6.5), differentiable, as ``torch.optim.RMSprop``
computes it (not centred, no momentum).

For step ``t = 1, 2, ...`` from ``v_0 = 0``::

    v_t = alpha * v_{t-1} + (1 - alpha) * g_t^2
    p_t = p_{t-1} - lr * g_t / (sqrt(v_t) + eps)
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from metalearn.optim.base import Hyperparameter, InnerOptimizer, safe_sqrt

__all__ = ["RMSprop", "rmsprop_update"]


def rmsprop_update(
    p: Tensor,
    g: Tensor,
    v: Tensor,
    *,
    lr: float | Tensor,
    alpha: float | Tensor = 0.99,
    eps: float | Tensor = 1e-8,
) -> tuple[Tensor, Tensor]:
    """One RMSprop step on one tensor (the equations of the module docstring).

    Args:
        p: the parameter, any shape.
        g: its gradient, ``p``'s shape.
        v: the mean square ``v_{t-1}``, ``p``'s shape.
        lr, alpha, eps: floats or broadcastable tensors (learnable ones included).

    Returns:
        ``(p_t, v_t)``.
    """
    v = alpha * v + (1 - alpha) * (g * g)
    return p - lr * (g / (safe_sqrt(v) + eps)), v


@dataclass(frozen=True)
class RMSprop(InnerOptimizer):
    """RMSprop on a parameter dict; see `rmsprop_update`. Each hyperparameter is a
    `metalearn.optim.Hyperparameter`.

    Attributes:
        alpha: the mean square's decay rate.
        eps: added to ``sqrt(v)``.
    """

    alpha: Hyperparameter = 0.99
    eps: Hyperparameter = 1e-8

    hyperparameters = ("alpha",)

    def slots(self) -> int:
        return 1

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
        alpha, eps = self.hyper("alpha", name, step), self.hyper("eps", name, step)
        new, v = rmsprop_update(p, g, slots[0], lr=lr, alpha=alpha, eps=eps)
        return new, (v,)
