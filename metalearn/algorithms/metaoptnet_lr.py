"""MetaOptNet (Lee, Maji, Ravichandran & Soatto, 2019, "Meta-Learning with Differentiable
Convex Optimization") with a multinomial logistic-regression head (``metaoptnet-lr``; the
paper's own SVM head is `metalearn.algorithms.metaoptnet`).

Each task's head is the minimiser of a strictly convex problem on the support features
``X [S, D]`` with classes ``y``::

    W* = argmin_W  (1/S) sum_i CE(W x_i, y_i) + (weight_decay / 2) ||W||^2      [C, D]

solved to convergence (`newton_logistic`), and the query scores are ``scale * X_q W*^T``
with a meta-learned ``scale`` (the paper's Sec. 3.3 "learnable scale"). The meta-gradient
through ``W*`` is the implicit function theorem on ``grad_W f(W*, X) = 0`` (the paper's
Sec. 3.2), from `metalearn.implicit.argmin`: CG on Hessian-vector products of ``f``, never a
Hessian; the solver's own steps are not differentiated.

The solver works in the paper's dual-sized space: at the optimum ``W* = A^T X`` with
``A = (Y - P) / (S weight_decay)`` (``P`` the softmax of the support logits), so Newton's
method runs on ``A [S, C]`` (``S C`` unknowns, independent of the feature size ``D``), with a
backtracking line search on the primal objective.

Tasks run in the Python loop: the solver and the linear solve stop on data-dependent
residuals, which vmap cannot express.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metalearn.algorithms.heads import HeadLearner, LinearHead, class_targets
from metalearn.implicit import argmin

__all__ = ["MetaOptNetLR", "logistic_classifier", "logistic_objective", "newton_logistic"]


def logistic_objective(
    weight: Tensor, support: Tensor, labels: Tensor, present: Tensor, weight_decay: float
) -> Tensor:
    """The inner problem: mean cross-entropy of the support plus the L2 penalty, ``Tensor[]``.

    Args:
        weight: ``W [C, D]``.
        support: features ``X [S, D]``.
        labels: classes ``[S]``.
        present: ``[C]`` bool, the classes with an example (the others' logits are -inf).
        weight_decay: the L2 strength (> 0: the problem is strictly convex).
    """
    logits = support @ weight.T
    logits = torch.where(present, logits, torch.full_like(logits, float("-inf")))
    return F.cross_entropy(logits, labels) + 0.5 * weight_decay * (weight**2).sum()


def newton_logistic(
    support: Tensor,
    labels: Tensor,
    columns: int,
    *,
    weight_decay: float,
    steps: int = 30,
    tol: float = 1e-10,
) -> Tensor:
    """The minimiser of `logistic_objective` by Newton's method on the dual-sized ``A``.

    With ``K = X X^T`` the support logits are ``K A`` and the optimality condition is
    ``G(A) = S weight_decay A + softmax(K A) - Y = 0``; ``grad_W f = G^T X / S``. Each step
    solves ``J_G d = G`` (``J_G = S weight_decay I + blockdiag(softmax Jacobians) (K x I)``,
    ``S C x S C``), the primal Newton step restricted to the span of the support features,
    then halves the step until the primal objective decreases enough (Armijo, up to the
    objective's rounding).

    Args:
        support: features ``X [S, D]`` (a constant: no graph is built).
        labels: classes ``[S]`` in ``0..columns-1``.
        columns: the head's rows ``C``.
        weight_decay: the L2 strength.
        steps: the most Newton steps.
        tol: stop when ``||grad_W f|| <= tol``.

    Returns:
        ``W* = A^T X [C, D]``.
    """
    x = support.detach()
    onehot, present = class_targets(labels, columns, x.dtype)
    n, c = onehot.shape
    gram = x @ x.T
    absent = torch.full((c,), float("-inf"), dtype=x.dtype, device=x.device)

    def masked(z: Tensor) -> Tensor:
        return torch.where(present, z, absent)

    def objective(a: Tensor) -> Tensor:  # the primal objective at W = A^T X
        z = masked(gram @ a)
        return F.cross_entropy(z, labels) + 0.5 * weight_decay * (a * (gram @ a)).sum()

    a = torch.zeros_like(onehot)
    eye = torch.eye(n * c, dtype=x.dtype, device=x.device)
    for _ in range(steps):
        p = torch.softmax(masked(gram @ a), dim=1)
        g = n * weight_decay * a + p - onehot
        kg = gram @ g
        if math.sqrt(max(float((g * kg).sum()), 0.0)) / n <= tol:
            break
        blocks = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]  # [S, C, C]
        jacobian = torch.einsum("icd,ij->icjd", blocks, gram).reshape(n * c, n * c)
        step = torch.linalg.solve(jacobian + n * weight_decay * eye, g.reshape(-1)).reshape(n, c)
        slope, start, t = float((kg * step).sum()) / n, float(objective(a)), 1.0
        # Armijo, allowing the objective's rounding: near the minimum a full Newton step's
        # decrease is below it, and the step must still be taken.
        slack = 4 * torch.finfo(x.dtype).eps * abs(start)
        while float(objective(a - t * step)) > start - 1e-4 * t * slope + slack and t > 1e-10:
            t /= 2
        a = a - t * step
    return a.T @ x


def logistic_classifier(
    support: Tensor,
    labels: Tensor,
    columns: int,
    *,
    weight_decay: float,
    scale: Tensor,
    newton_steps: int = 30,
    tol: float = 1e-10,
    cg_steps: int = 200,
    cg_tol: float = 1e-10,
) -> LinearHead:
    """The solved logistic-regression head, differentiable w.r.t. ``support`` by the IFT.

    Args:
        support: features ``X [S, D]``.
        labels: classes ``[S]`` in ``0..columns-1``.
        columns: the head's rows ``C``.
        weight_decay: the L2 strength.
        scale: the logits' scale, ``Tensor[]``.
        newton_steps: the most Newton steps (`newton_logistic`).
        tol: the largest ``||grad_W f(W*)||`` accepted (beyond it: a ValueError naming it).
        cg_steps, cg_tol: the IFT's conjugate gradient (`metalearn.implicit.argmin`).

    Returns:
        ``weight = scale * W* [C, D]``, zero bias.
    """
    _, present = class_targets(labels, columns, support.dtype)
    objective = partial(logistic_objective, labels=labels, present=present,
                        weight_decay=weight_decay)  # fmt: skip
    solver = partial(newton_logistic, labels=labels, columns=columns, weight_decay=weight_decay,
                     steps=newton_steps, tol=tol / 10)  # fmt: skip
    weight = argmin(objective, solver, tol=tol, max_iter=cg_steps, solve_tol=cg_tol)(support)
    return LinearHead(scale * weight, support.new_zeros(columns), present)


# Tolerances by dtype: the solver's gradient norm and CG's relative residual reach these in
# float64 and float32 on Conv4 features (rounding floors about 1e-13 and 1e-6).
_TOLERANCES = {torch.float64: (1e-9, 1e-10), torch.float32: (1e-4, 1e-5)}


class MetaOptNetLR(HeadLearner):
    """MetaOptNet with a logistic-regression head solved per task, differentiated implicitly.

    Args:
        model: the network (its linear ``head`` is replaced per task).
        weight_decay: the inner problem's L2 strength (fixed).
        scale: the logits' scale's initial value (meta-learned, as ``log_scale``).
        newton_steps: the most Newton steps per task.
        cg_steps: the most CG iterations (Hessian-vector products) of the implicit gradient.
        tol: the largest inner gradient norm accepted as converged (None: 1e-9 in float64,
            1e-4 in float32); a task beyond it raises, naming the residual.
        cg_tol: CG's relative tolerance (None: 1e-10 in float64, 1e-5 in float32).
        head: the classifier's name.
        **kwargs: as for `metalearn.algorithms.heads.HeadLearner`; ``vectorize`` must be
            ``"auto"`` or ``"loop"``.
    """

    not_compiled = (
        "its Newton solver and the implicit gradient's CG stop on data-dependent residuals, "
        "which Dynamo cannot trace"
    )

    def __init__(
        self,
        model: nn.Module,
        *,
        weight_decay: float = 1.0,
        scale: float = 1.0,
        newton_steps: int = 30,
        cg_steps: int = 200,
        tol: float | None = None,
        cg_tol: float | None = None,
        head: str = "head",
        **kwargs: Any,
    ) -> None:
        if not (weight_decay > 0 and scale > 0 and newton_steps >= 1 and cg_steps >= 1):
            raise ValueError(
                f"weight_decay and scale must be > 0 and newton_steps, cg_steps >= 1, got "
                f"{weight_decay}, {scale}, {newton_steps}, {cg_steps}"
            )
        if kwargs.get("vectorize", "auto") not in ("auto", "loop"):
            raise ValueError(
                "MetaOptNetLR runs its tasks in a Python loop (its solver stops on data-dependent "
                f"residuals); vectorize={kwargs['vectorize']!r} is not supported, pass 'loop' or "
                "'auto'"
            )
        super().__init__(model, head=head, **kwargs)
        self.vectorize = "loop"
        self.weight_decay, self.newton_steps, self.cg_steps = weight_decay, newton_steps, cg_steps
        self.tol, self.cg_tol = tol, cg_tol
        weight = self.model.get_parameter(f"{head}.weight")
        self.log_scale = nn.Parameter(
            torch.tensor(math.log(scale), dtype=weight.dtype, device=weight.device)
        )

    def columns(self, labels: Tensor) -> int:
        """The task's classes, ``max(labels) + 1`` (tasks run in the loop, so a number)."""
        return int(labels.max()) + 1

    def solve(self, support: Tensor, labels: Tensor, columns: int) -> LinearHead:
        """`logistic_classifier` with the learner's settings and ``scale``."""
        tol, cg_tol = _TOLERANCES.get(support.dtype, _TOLERANCES[torch.float32])
        return logistic_classifier(
            support, labels, columns, weight_decay=self.weight_decay, scale=self.log_scale.exp(),
            newton_steps=self.newton_steps, tol=self.tol or tol, cg_steps=self.cg_steps,
            cg_tol=self.cg_tol or cg_tol,
        )  # fmt: skip
