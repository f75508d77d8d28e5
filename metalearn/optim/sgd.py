"""Stochastic gradient descent, with momentum and Nesterov momentum, differentiable.

PyTorch's form (``torch.optim.SGD`` without dampening; Sutskever et al., 2013, Eq. 3-4,
rewritten on the gradient), for step ``t = 1, 2, ...`` from ``b_0 = 0``::

    b_t = mu * b_{t-1} + g_t                       (momentum buffer; b_1 = g_1)
    d_t = g_t + mu * b_t   (Nesterov)   or   b_t   (heavy ball)   or   g_t   (mu = 0)
    p_t = p_{t-1} - lr * d_t
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from metalearn.optim.base import Hyperparameter, InnerOptimizer

__all__ = ["SGD", "sgd_update"]


def sgd_update(
    p: Tensor,
    g: Tensor,
    buf: Tensor | None,
    *,
    lr: float | Tensor,
    momentum: float | Tensor = 0.0,
    nesterov: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """One SGD step on one tensor (the equations of the module docstring).

    Args:
        p: the parameter, any shape.
        g: its gradient, ``p``'s shape.
        buf: the momentum buffer ``b_{t-1}`` (``p``'s shape), None without momentum.
        lr, momentum: step size and momentum ``mu`` (floats or broadcastable tensors).
        nesterov: Nesterov's look-ahead form.

    Returns:
        ``(p_t, b_t)`` (``b_t`` None without momentum).
    """
    if buf is None:
        return p - lr * g, None  # plain SGD, MAML's Eq. 1
    buf = momentum * buf + g
    direction = g + momentum * buf if nesterov else buf
    return p - lr * direction, buf


@dataclass(frozen=True)
class SGD(InnerOptimizer):
    """SGD on a parameter dict, with optional (Nesterov) momentum; see `sgd_update`.

    ``SGD()`` is MAML's inner update ``p - lr * g`` and carries no state.

    Attributes:
        momentum: ``mu`` (a `metalearn.optim.Hyperparameter`); the float 0 means no
            momentum buffer at all.
        nesterov: Nesterov momentum.
    """

    momentum: Hyperparameter = 0.0
    nesterov: bool = False

    hyperparameters = ("momentum",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.nesterov and self._plain():
            raise ValueError("Nesterov momentum needs a momentum; pass momentum > 0")

    def _plain(self) -> bool:
        return isinstance(self.momentum, (int, float)) and self.momentum == 0

    def slots(self) -> int:
        return 0 if self._plain() else 1

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
        if self._plain():
            return sgd_update(p, g, None, lr=lr)[0], ()
        mu = self.hyper("momentum", name, step)
        new, buf = sgd_update(p, g, slots[0], lr=lr, momentum=mu, nesterov=self.nesterov)
        return new, (buf,)
