"""R2D2 (Bertinetto, Henriques, Torr & Vedaldi, 2019, "Meta-learning with differentiable
closed-form solvers"): a ridge-regression head solved in closed form per task.

The support features ``X [S, D]`` are regressed onto one-hot targets ``Y [S, C]`` with ridge
penalty ``lam``. The primal solution ``(X^T X + lam I)^{-1} X^T Y`` needs a ``D x D`` system;
the Woodbury identity gives the same matrix from an ``S x S`` one (the paper's Eq. 3)::

    W = X^T (X X^T + lam I)^{-1} Y                       [D, C]

cheap because a task has few support examples (``S << D``). The query scores are
``scale * X_q W + bias`` with ``lam``, ``scale`` and ``bias`` meta-learned scalars (the
paper's base-learner adjustment; ``lam`` and ``scale`` log-parameterised, so positive).
Under the softmax cross-entropy a scalar ``bias`` shifts every logit alike and gets a zero
meta-gradient; it is kept for other losses and the paper's form. Everything is
differentiated exactly through the solve.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from metalearn.algorithms.heads import HeadLearner, LinearHead, class_targets

__all__ = ["R2D2", "ridge_classifier"]


def ridge_classifier(
    support: Tensor,
    labels: Tensor,
    columns: int,
    *,
    lam: Tensor,
    scale: Tensor,
    bias: Tensor,
) -> LinearHead:
    """The ridge-regression head of the support features, by the Woodbury identity.

    Args:
        support: features ``X [S, D]``.
        labels: classes ``[S]`` in ``0..columns-1``.
        columns: the head's rows ``C``.
        lam: the ridge penalty, ``Tensor[]`` > 0.
        scale, bias: the output adjustment, ``Tensor[]`` each.

    Returns:
        ``weight = scale * W^T [C, D]`` with ``W = X^T (X X^T + lam I)^{-1} Y``, and ``bias``
        on every row.
    """
    onehot, present = class_targets(labels, columns, support.dtype)
    eye = torch.eye(support.shape[0], dtype=support.dtype, device=support.device)
    dual = torch.linalg.solve(support @ support.T + lam * eye, onehot)  # [S, C]
    weight = scale * (dual.T @ support)  # (X^T dual)^T
    return LinearHead(weight, bias * torch.ones_like(weight[:, 0]), present)


class R2D2(HeadLearner):
    """Ridge regression to differentiable discriminator: a closed-form ridge head per task.

    Args:
        model: the network (its linear ``head`` is replaced per task).
        lam: the ridge penalty's initial value (meta-learned, as ``log_lam``).
        scale: the output scale's initial value (meta-learned, as ``log_scale``); one-hot
            regression outputs lie near [0, 1], so the logits need a scale to be confident.
        bias: the output bias's initial value (meta-learned).
        head: the classifier's name.
        **kwargs: as for `metalearn.algorithms.heads.HeadLearner`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lam: float = 1.0,
        scale: float = 10.0,
        bias: float = 0.0,
        head: str = "head",
        **kwargs: Any,
    ) -> None:
        if not (lam > 0 and scale > 0 and math.isfinite(lam * scale * bias)):
            raise ValueError(f"lam and scale must be > 0 and bias finite, got {lam}, {scale}, "
                             f"{bias}")  # fmt: skip
        super().__init__(model, head=head, **kwargs)
        weight = self.model.get_parameter(f"{head}.weight")
        like = dict(dtype=weight.dtype, device=weight.device)
        self.log_lam = nn.Parameter(torch.tensor(math.log(lam), **like))
        self.log_scale = nn.Parameter(torch.tensor(math.log(scale), **like))
        self.bias = nn.Parameter(torch.tensor(float(bias), **like))

    def solve(self, support: Tensor, labels: Tensor, columns: int) -> LinearHead:
        """`ridge_classifier` with the learner's ``lam``, ``scale`` and ``bias``."""
        return ridge_classifier(support, labels, columns, lam=self.log_lam.exp(),
                                scale=self.log_scale.exp(), bias=self.bias)  # fmt: skip
