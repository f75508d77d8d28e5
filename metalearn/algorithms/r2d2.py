"""R2D2 (Bertinetto, Henriques, Torr & Vedaldi, 2019, "Meta-learning with differentiable
closed-form solvers"): a ridge-regression head solved in closed form per task.

The support features ``X [S, D]`` are regressed onto one-hot targets ``Y [S, C]`` with ridge
penalty ``lam``. The primal solution ``(X^T X + lam I)^{-1} X^T Y`` needs a ``D x D`` system;
the Woodbury identity gives the same matrix from an ``S x S`` one (the paper's Eq. 3)::

    W = X^T (X X^T + lam I)^{-1} Y

cheap because a task has few support examples (``S << D``). Two forms (``ridge_form``):

* ``"rrnet"`` (the default), as the reference's ``RRNet`` (``bertinetto/r2d2``,
  ``fewshots/models/r2d2.py``): a column of ones is appended to ``X`` (its row of ``W`` is a
  per-class bias, penalised by ``lam`` like the weights), ``X`` and ``Y`` are divided by
  ``sqrt(S)`` (so the penalty acts as ``S * lam`` on the unscaled system), ``lam`` is fixed
  (``learn_lambda=False``, the reference's config), and the query scores are
  ``scale * (X_q W + b) + bias`` with ``scale`` and ``bias`` learned as they are (not
  log-parameterised; the query features are not divided by ``sqrt(S)``).
* ``"plain"``: ``W`` of the unscaled features without the ones column (the ridge formula of
  MetaOptNet's ``R2D2Head``), scores ``scale * X_q W + bias`` with ``lam`` and ``scale``
  log-parameterised (positive). What ``r2d2`` was before ``ridge_form`` existed (``lam`` learned
  from 1): records without ``ridge_form`` read so.

Under the softmax cross-entropy a scalar ``bias`` shifts every logit alike and gets a zero
meta-gradient (the reference learns it all the same). Everything is differentiated exactly
through the solve.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor, nn

from metalearn.algorithms.heads import HeadLearner, LinearHead, class_targets

__all__ = ["R2D2", "ridge_classifier", "rrnet_classifier"]

RIDGE_FORMS = ("rrnet", "plain")
"""R2D2's head forms (``ridge_form``)."""


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


def rrnet_classifier(
    support: Tensor,
    labels: Tensor,
    columns: int,
    *,
    lam: Tensor,
    scale: Tensor,
    bias: Tensor,
) -> LinearHead:
    """The reference's ridge head (``RRNet.loss`` with ``rr_woodbury``): a ones column, and
    ``X``, ``Y`` divided by ``sqrt(S)``.

    Args:
        support: features ``Z [S, D]``.
        labels: classes ``[S]`` in ``0..columns-1``.
        columns: the head's rows ``C``.
        lam: the ridge penalty, ``Tensor[]`` > 0.
        scale, bias: the output adjustment ``scale * out + bias``, ``Tensor[]`` each.

    Returns:
        With ``X = [Z, 1] / sqrt(S)``, ``Y = onehot / sqrt(S)`` and
        ``[W; b] = X^T (X X^T + lam I)^{-1} Y [D + 1, C]``: ``weight = scale * W^T [C, D]``
        and ``bias = scale * b + bias [C]``, so the logits of query features ``Z_q`` are
        ``scale * (Z_q W + b) + bias``.
    """
    onehot, present = class_targets(labels, columns, support.dtype)
    root = math.sqrt(support.shape[0])  # sqrt(n_way * n_shot): the support size
    ones = torch.ones_like(support[:, :1])
    x = torch.cat([support, ones], 1) / root  # [S, D + 1]
    eye = torch.eye(support.shape[0], dtype=support.dtype, device=support.device)
    dual = torch.linalg.solve(x @ x.T + lam * eye, onehot / root)  # [S, C]
    wb = x.T @ dual  # [D + 1, C]
    return LinearHead(scale * wb[:-1].T, scale * wb[-1] + bias, present)


class R2D2(HeadLearner):
    """Ridge regression to differentiable discriminator: a closed-form ridge head per task.

    Args:
        model: the network (its linear ``head`` is replaced per task).
        ridge_form: ``"rrnet"`` (the reference's head) or ``"plain"`` (see the module docstring).
        lam: the ridge penalty (its initial value when learned). The reference's 50
            (``base_learner.init_lambda``, ``scripts/train/conf/fewshots.yaml``).
        learn_lambda: meta-learn ``lam`` (``"rrnet"``: as it is; ``"plain"``: as ``log_lam``).
            The reference's config does not (``base_learner.learn_lambda: False``).
        scale: the output scale's initial value (meta-learned; ``"plain"``: as
            ``log_scale``). The reference's Omniglot and CIFAR-FS scripts start it at 10
            (``--base_learner.init_adj_scale 10``), its mini-ImageNet ones at 1e-4.
        bias: the output bias's initial value (meta-learned).
        head: the classifier's name.
        **kwargs: as for `metalearn.algorithms.heads.HeadLearner`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        ridge_form: Literal["rrnet", "plain"] = "rrnet",
        lam: float = 50.0,
        learn_lambda: bool = False,
        scale: float = 10.0,
        bias: float = 0.0,
        head: str = "head",
        **kwargs: Any,
    ) -> None:
        if ridge_form not in RIDGE_FORMS:
            raise ValueError(f"ridge_form {ridge_form!r}; choose one of {', '.join(RIDGE_FORMS)}")
        if not (lam > 0 and scale > 0 and math.isfinite(lam * scale * bias)):
            raise ValueError(f"lam and scale must be > 0 and bias finite, got {lam}, {scale}, "
                             f"{bias}")  # fmt: skip
        super().__init__(model, head=head, **kwargs)
        self.ridge_form = ridge_form
        self.learn_lambda = learn_lambda
        weight = self.model.get_parameter(f"{head}.weight")
        like = dict(dtype=weight.dtype, device=weight.device)
        # "plain" keeps its lambda and scale in log space (MetaOptNet's R2D2Head form).
        lam_name, scale_name = (
            ("lam", "scale") if ridge_form == "rrnet" else ("log_lam", "log_scale")
        )
        to = (lambda v: float(v)) if ridge_form == "rrnet" else math.log
        lam_value = torch.tensor(to(lam), **like)
        if learn_lambda:
            self.register_parameter(lam_name, nn.Parameter(lam_value))
        else:
            self.register_buffer(lam_name, lam_value)
        self.register_parameter(scale_name, nn.Parameter(torch.tensor(to(scale), **like)))
        self.bias = nn.Parameter(torch.tensor(float(bias), **like))

    def solve(self, support: Tensor, labels: Tensor, columns: int) -> LinearHead:
        """`rrnet_classifier` or `ridge_classifier` with the learner's ``lam``, ``scale`` and
        ``bias``."""
        if self.ridge_form == "rrnet":
            return rrnet_classifier(support, labels, columns, lam=self.lam, scale=self.scale,
                                    bias=self.bias)  # fmt: skip
        return ridge_classifier(support, labels, columns, lam=self.log_lam.exp(),
                                scale=self.log_scale.exp(), bias=self.bias)  # fmt: skip
