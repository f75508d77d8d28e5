"""MetaOptNet (Lee, Maji, Ravichandran & Soatto, 2019, "Meta-Learning with Differentiable
Convex Optimization"): a Crammer-Singer multi-class SVM head solved per task.

The paper's head (MetaOptNet's final one, its code's ``MetaOptNetHead_SVM_CS``) is the dual
of Crammer & Singer's multi-class SVM on the support features ``X [S, D]`` with one-hot
labels ``Y [S, C]``, over ``alpha [S, C]`` (``S C`` variables)::

    min_alpha  1/2 sum_m ||X^T alpha_m||^2 + (ridge / 2) ||alpha||^2 - <Y, alpha>
    s.t.       alpha <= c_reg Y              (alpha_i^m <= C if m = y_i, else <= 0)
               alpha 1_C = 0                 (sum_m alpha_i^m = 0 for every i)

``ridge`` is the reference's ``1.0 * I`` added to the dual's matrix ``K (x) I_C``
(``K = X X^T``): the problem is ``ridge``-strongly convex, so its solution is unique. The
head is ``W = alpha^T X [C, D]`` (``w_m = sum_i alpha_i^m x_i``) and the query logits are
``scale * X_q W^T``, ``scale`` meta-learned (the reference's ``ClassificationHead``, 1 at
the start).

Solver (`solve_dual`): a primal-dual interior-point method (Mehrotra's predictor-corrector)
on the dual, at most ``ipm_steps`` iterations (the reference's ``maxIter`` 15). Its Newton
systems separate by class: with the inequality multipliers' barrier diagonal ``d``, class
``m``'s block is ``K + diag(ridge + d_m)`` (``S x S``), coupled only through the ``S``
equality constraints, which a Schur complement of size ``S`` solves. Each
iterate's partition (slack below multiplier: at the bound) names the active constraints, and
the QP on that face, an equality-constrained one, is solved exactly (`_solve_face`); the
first face whose solution is feasible with non-negative active multipliers (the KKT
conditions) is the answer; none within ``ipm_steps`` is a ValueError naming the violation.
The QP and its implicit gradient run in float64 whatever the features' dtype (the
reference's ``qpth`` runs in float32 by default).

Meta-gradient: the implicit function theorem on the KKT conditions with the active set held
(the face's stationarity ``P (G alpha + e) = 0``, ``P`` the orthogonal projection onto the
face's directions: the active constraints' multipliers eliminated), by
`metalearn.implicit.argmin` on `face_objective`, whose Hessian ``P G P + (I - P)`` is
positive definite: CG on its Hessian-vector products. Under strict complementarity the
active set is constant near the solution, so this is the derivative of ``alpha*(X)``.

Tasks run in the Python loop: the face is data-dependent, which vmap cannot express.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metalearn.algorithms.heads import HeadLearner, LinearHead, class_targets, head_task_loss
from metalearn.engine import Task, TaskCall, TaskFn, TaskResult
from metalearn.implicit import argmin

__all__ = [
    "DualSolution",
    "MetaOptNet",
    "dual_objective",
    "face_objective",
    "smoothed_cross_entropy",
    "solve_dual",
    "svm_classifier",
]


class DualSolution(NamedTuple):
    """The Crammer-Singer dual's solution and the face it lies on."""

    alpha: Tensor
    """``[S, C]`` float64."""
    free: Tensor
    """``[S, C]`` bool: the variables strictly below their bound ``c_reg Y``."""
    iterations: int
    """Interior-point iterations taken."""


def dual_objective(alpha: Tensor, support: Tensor, onehot: Tensor, ridge: float) -> Tensor:
    """``1/2 ||alpha^T X||^2 + (ridge/2) ||alpha||^2 - <Y, alpha>``, ``Tensor[]``.

    Args:
        alpha: ``[S, C]``.
        support: ``X [S, D]``.
        onehot: ``Y [S, C]``.
        ridge: the reference's ``1.0 * I`` on the dual's matrix.
    """
    weight = alpha.T @ support  # W [C, D]: sum_m ||w_m||^2 = alpha^T (K (x) I) alpha
    return 0.5 * (weight**2).sum() + 0.5 * ridge * (alpha**2).sum() - (onehot * alpha).sum()


def _project(v: Tensor, free: Tensor) -> Tensor:
    """The orthogonal projection onto the face's directions ``{v: v = 0 where not free,
    sum_m v_i^m = 0}``: each row's free entries less their mean, the others 0."""
    count = free.sum(1, keepdim=True).clamp(min=1)
    kept = torch.where(free, v, torch.zeros_like(v))
    return torch.where(free, kept - kept.sum(1, keepdim=True) / count, torch.zeros_like(v))


def face_objective(
    alpha: Tensor,
    support: Tensor,
    *,
    onehot: Tensor,
    ridge: float,
    free: Tensor,
    anchor: Tensor,
) -> Tensor:
    """The dual restricted to the face through ``anchor``, with the normal directions pinned.

    ``f(a) = q(P a + (I - P) anchor) + 1/2 ||(I - P)(a - anchor)||^2`` (``q`` the
    `dual_objective`, ``P`` the projection onto the face's directions): its gradient is
    ``P grad q`` on the face, zero exactly at the face's KKT point, and its Hessian
    ``P G P + (I - P)`` is positive definite, as `metalearn.implicit.argmin` needs.

    Args:
        alpha: ``[S, C]``.
        support: ``X [S, D]`` (the argument differentiated through).
        onehot, ridge: as for `dual_objective`.
        free: ``[S, C]`` bool, the face's free variables.
        anchor: ``[S, C]``, a point of the face (the solution, a constant).
    """
    normal = alpha - _project(alpha, free)
    fixed = anchor - _project(anchor, free)
    on_face = alpha - normal + fixed
    return dual_objective(on_face, support, onehot, ridge) + 0.5 * ((normal - fixed) ** 2).sum()


def _newton_solver(
    gram: Tensor, ridge: float, barrier: Tensor
) -> Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """Factor ``K (x) I + diag(ridge + barrier)`` with the equality constraints ``A``; the
    returned ``(rhs, rhs_eq) -> (da, dnu)`` solves ``(K (x) I + diag(ridge + barrier)) da +
    A^T dnu = rhs``, ``A da = rhs_eq``.

    Per class ``m``: ``(K + diag(ridge + barrier_m)) da_m + dnu = rhs_m``; the equality
    ``sum_m da_m = rhs_eq`` gives ``(sum_m M_m^-1) dnu = sum_m M_m^-1 rhs_m - rhs_eq``.

    Args:
        gram: ``K [S, S]``; barrier: ``[S, C]`` (rhs likewise, rhs_eq ``[S]``).
    """
    blocks = gram + torch.diag_embed((ridge + barrier).T)  # [C, S, S]
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    # cholesky_solve against I: batched cholesky_inverse is ~200x slower on the CPU (torch 2.13).
    inverse = torch.cholesky_solve(eye.expand_as(blocks), torch.linalg.cholesky(blocks))
    schur = torch.linalg.cholesky(inverse.sum(0))

    def solve(rhs: Tensor, rhs_eq: Tensor) -> tuple[Tensor, Tensor]:
        m_rhs = (inverse @ rhs.T[:, :, None])[..., 0]  # [C, S]
        dnu = torch.cholesky_solve((m_rhs.sum(0) - rhs_eq)[:, None], schur)[:, 0]
        return (m_rhs - inverse @ dnu).T, dnu

    return solve


def _step_length(value: Tensor, change: Tensor) -> float:
    """The largest ``t <= 1`` with ``value + t change >= 0`` (value > 0)."""
    ratios = torch.where(change < 0, -value / change, torch.full_like(value, math.inf))
    return min(1.0, float(ratios.min()))


def solve_dual(
    support: Tensor,
    labels: Tensor,
    columns: int,
    *,
    c_reg: float,
    ridge: float,
    ipm_steps: int = 15,
) -> DualSolution:
    """The Crammer-Singer dual by Mehrotra's predictor-corrector and an exact face solve.

    The interior point keeps ``alpha``, slacks ``s = c_reg Y - alpha > 0``, multipliers
    ``lam > 0`` of ``alpha <= c_reg Y`` and ``nu`` of ``alpha 1 = 0``; each iteration solves
    two Newton systems with one factorisation (`_newton_solver`). Each iterate's partition
    (``s > lam``: free) names a face, and the QP on it is solved exactly (`_solve_face`)
    whenever the partition differs from the last one tried; the first face whose solution
    satisfies the whole problem's KKT conditions (feasible, active multipliers >= 0) is the
    answer, so a task stops as soon as its active set is identified.

    The conditions hold to ``max(1e-9, eps)`` relative, ``eps`` the machine epsilon of
    ``support``'s dtype: a variable at its bound with a multiplier of about 0 (degenerate)
    leaves the interior point's partition undecided for many iterations, and a violation
    below the rounding of float32 features is not one the features can tell apart (a
    5-way 1-shot Omniglot task's ``-2.7e-7`` on ``1 + max K_ii = 123``, 17 iterations to
    decide at 1e-9, accepted at step 15 here; tests/algorithms/test_svm_head.py).

    Args:
        support: ``X [S, D]`` (a constant: no graph is built).
        labels: classes ``[S]`` in ``0..columns-1``.
        columns: ``C``.
        c_reg: the SVM's cost ``C`` (> 0).
        ridge: added to the dual matrix's diagonal (> 0).
        ipm_steps: the most interior-point iterations.

    Returns:
        A `DualSolution` (float64).

    Raises:
        ValueError: no optimal face within ``ipm_steps`` iterations, named with the last
            face's KKT violation.
    """
    tol = max(1e-9, torch.finfo(support.dtype).eps)
    x = support.detach().to(torch.float64)
    onehot, _ = class_targets(labels, columns, x.dtype)
    problem = _Dual(x @ x.T, onehot, c_reg * onehot, ridge)
    # Start (Nocedal & Wright, 2006, Ch. 16's heuristic): the minimiser under the equalities alone
    # with unit slacks and multipliers, then the slacks and multipliers of one affine-scaling
    # step from there, in absolute value, floored at c_reg.
    start = _newton_solver(problem.gram, ridge, torch.zeros_like(onehot))
    alpha, nu = start(onehot, onehot.new_zeros(len(x)))
    ones = torch.ones_like(onehot)
    _, _, ds, dlam = _directions(problem, alpha, nu, ones, ones)(torch.zeros_like(ones))
    slack, lam = (1 + ds).abs().clamp(min=c_reg), (1 + dlam).abs().clamp(min=c_reg)
    tried, violation = None, "no face was tried"
    for step in range(1, ipm_steps + 1):
        alpha, nu, slack, lam = _mehrotra_step(problem, alpha, nu, slack, lam)
        free = slack > lam
        if tried is not None and torch.equal(free, tried):
            continue
        face, violation = _solve_face(problem, free, tol)
        if face is not None:
            return DualSolution(face, free, step)
        tried = free
    raise ValueError(
        f"the SVM dual's interior point found no optimal face in {ipm_steps} iterations "
        f"({violation}); raise ipm_steps"
    )


class _Dual(NamedTuple):
    """The dual's data: ``K [S, S]``, ``Y [S, C]``, the bound ``c_reg Y`` and ``ridge``."""

    gram: Tensor
    onehot: Tensor
    bound: Tensor
    ridge: float


def _directions(
    problem: _Dual, alpha: Tensor, nu: Tensor, slack: Tensor, lam: Tensor
) -> Callable[[Tensor], tuple[Tensor, Tensor, Tensor, Tensor]]:
    """``target -> (da, dnu, ds, dlam)``: the Newton step of the KKT conditions at the point
    with complementarity ``s lam`` driven to ``target`` (one factorisation for all targets)."""
    gram, onehot, bound, ridge = problem
    r_dual = gram @ alpha + ridge * alpha - onehot + lam + nu[:, None]
    r_eq, r_slack = alpha.sum(1), alpha + slack - bound
    newton = _newton_solver(gram, ridge, lam / slack)

    def direction(target: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        # lam ds + s dlam = target - s lam, with ds = -r_slack - da, eliminates ds and dlam.
        shift = (target - slack * lam + lam * r_slack) / slack
        da, dnu = newton(-r_dual - shift, -r_eq)
        ds = -r_slack - da
        return da, dnu, ds, (target - slack * lam - lam * ds) / slack

    return direction


def _mehrotra_step(
    problem: _Dual, alpha: Tensor, nu: Tensor, slack: Tensor, lam: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One predictor-corrector step (Mehrotra, 1992), 0.999 of the way to the boundary."""
    mu, direction = float((slack * lam).mean()), _directions(problem, alpha, nu, slack, lam)
    da, dnu, ds, dlam = direction(torch.zeros_like(lam))  # predictor (affine scaling)
    t = min(_step_length(slack, ds), _step_length(lam, dlam))
    sigma = (float(((slack + t * ds) * (lam + t * dlam)).mean()) / mu) ** 3
    da, dnu, ds, dlam = direction(sigma * mu - ds * dlam)  # centring and second order
    t = min(1.0, 0.999 * min(_step_length(slack, ds), _step_length(lam, dlam)))
    return alpha + t * da, nu + t * dnu, slack + t * ds, lam + t * dlam


def _solve_face(problem: _Dual, free: Tensor, tol: float) -> tuple[Tensor | None, str]:
    """The dual's minimiser on the face (``alpha = bound`` where not ``free``, rows summing to
    0) by one dense KKT solve, and None with the violation unless it satisfies the whole
    problem's KKT conditions to ``tol`` (relative to the bound and to ``1 + max K_ii``)."""
    gram, onehot, bound, ridge = problem
    n = len(onehot)
    if not bool(free.any(1).all()):
        return None, "every variable of a support example at its bound"
    rows, cols = free.nonzero(as_tuple=True)
    fixed = torch.where(free, torch.zeros_like(bound), bound)
    # Stationarity on the free variables, (G alpha)_(i,m) + nu_i = Y_i^m, and sum_m alpha_i^m = 0.
    eye = torch.eye(len(rows), dtype=gram.dtype, device=gram.device)
    block = gram[rows][:, rows] * (cols[:, None] == cols[None, :]) + ridge * eye
    coupling = F.one_hot(rows, n).to(gram.dtype)  # [free, S]
    system = torch.cat([torch.cat([block, coupling], 1),
                        torch.cat([coupling.T, coupling.new_zeros(n, n)], 1)])  # fmt: skip
    rhs = torch.cat([onehot[rows, cols] - (gram @ fixed)[rows, cols], -fixed.sum(1)])
    solution = torch.linalg.solve(system, rhs)
    alpha = fixed.index_put((rows, cols), solution[: len(rows)])
    multipliers = -(gram @ alpha + ridge * alpha - onehot + solution[len(rows) :, None])
    above = float(torch.where(free, alpha - bound, torch.zeros_like(alpha)).max())
    negative = float(torch.where(free, torch.zeros_like(alpha), -multipliers).max())
    scale = 1.0 + float(gram.diagonal().max())
    if above > tol * float(bound.max()) or negative > tol * scale:
        return None, f"a bound exceeded by {above:.2e}, a multiplier of {-negative:.2e}"
    return alpha, ""


def svm_classifier(
    support: Tensor,
    labels: Tensor,
    columns: int,
    *,
    c_reg: float,
    ridge: float,
    scale: Tensor,
    ipm_steps: int = 15,
    tol: float = 1e-9,
    cg_steps: int = 1000,
    cg_tol: float = 1e-10,
) -> LinearHead:
    """The solved SVM head, differentiable w.r.t. ``support`` by the IFT on the dual's KKT
    conditions (`face_objective` through `metalearn.implicit.argmin`).

    Args:
        support: features ``X [S, D]``.
        labels: classes ``[S]`` in ``0..columns-1``.
        columns: the head's rows ``C``.
        c_reg, ridge, ipm_steps: the dual and its solver (`solve_dual`).
        scale: the logits' scale, ``Tensor[]``.
        tol: the largest face-stationarity residual ``||P (G alpha + e)||`` accepted, relative
            to ``1 + max_i ||x_i||^2`` (beyond it: a ValueError naming it).
        cg_steps, cg_tol: the IFT's conjugate gradient.

    Returns:
        ``weight = scale * alpha*^T X [C, D]``, zero bias.
    """
    _, present = class_targets(labels, columns, support.dtype)
    with torch.no_grad():
        solved = solve_dual(support, labels, columns, c_reg=c_reg, ridge=ridge,
                            ipm_steps=ipm_steps)  # fmt: skip
    # The implicit gradient runs in float64 too (S C unknowns): float32's rounding of the
    # dual's gradient is above what CG must resolve.
    wide = support.to(torch.float64)
    onehot, _ = class_targets(labels, columns, wide.dtype)
    size = 1.0 + float((wide.detach() ** 2).sum(1).max())
    objective = partial(face_objective, onehot=onehot, ridge=ridge, free=solved.free,
                        anchor=solved.alpha)  # fmt: skip
    alpha = argmin(objective, lambda _: solved.alpha, tol=tol * size, max_iter=cg_steps,
                   solve_tol=cg_tol)(wide).to(support.dtype)  # fmt: skip
    return LinearHead(scale * (alpha.T @ support), support.new_zeros(columns), present)


def smoothed_cross_entropy(logits: Tensor, labels: Tensor, smoothing: float) -> Tensor:
    """Cross-entropy with MetaOptNet's label smoothing (its ``train.py``): the target is
    ``1 - smoothing`` on the label and ``smoothing / (C - 1)`` on each other class, ``C`` the
    classes with a finite logit (the task's own)."""
    present = torch.isfinite(logits)
    others = present.sum(1, keepdim=True) - 1
    onehot = F.one_hot(labels, logits.shape[1]).to(logits.dtype)
    target = onehot * (1 - smoothing) + (1 - onehot) * present * smoothing / others.clamp(min=1)
    log_p = torch.log_softmax(logits, 1)
    return -torch.where(present, target * log_p, torch.zeros_like(log_p)).sum(1).mean()


def _smoothed_task_loss(
    model: nn.Module, params: dict[str, Tensor], call: TaskCall, *, learner: MetaOptNet
) -> TaskResult:
    """`head_task_loss` with the query loss label-smoothed (MetaOptNet's training loss)."""
    loss_fn = partial(smoothed_cross_entropy, smoothing=learner.label_smoothing)
    call = replace(call, inner=replace(call.inner, loss_fn=loss_fn))
    return head_task_loss(model, params, call, learner=learner)


class MetaOptNet(HeadLearner):
    """MetaOptNet with the Crammer-Singer SVM head solved per task, differentiated implicitly.

    Defaults are MetaOptNet's (github.com/kjunelee/MetaOptNet): ``MetaOptNetHead_SVM_CS``
    (C_reg 0.1, maxIter 15, ``1.0 * I`` on the dual), ``ClassificationHead``'s scale (1.0)
    and the README's SVM training command's label smoothing (``--eps 0.1``).

    Args:
        model: the network (its linear ``head`` is replaced per task).
        c_reg: the SVM's cost ``C``.
        ridge: added to the dual matrix's diagonal.
        ipm_steps: the most interior-point iterations per task.
        scale: the logits' scale's initial value (meta-learned as ``scale``, as the
            reference's).
        label_smoothing: the training query loss's label smoothing (MetaOptNet's: the label
            gets ``1 - label_smoothing``, each other class ``label_smoothing / (C - 1)``);
            `evaluate` reports the plain cross-entropy. Needs ``loss_fn`` cross-entropy
            when > 0.
        cg_steps: the most CG iterations of the implicit gradient.
        tol: the largest face residual accepted, relative (`svm_classifier`).
        cg_tol: CG's relative tolerance.
        head: the classifier's name.
        **kwargs: as for `metalearn.algorithms.heads.HeadLearner`; ``vectorize`` must be
            ``"auto"`` or ``"loop"``.
    """

    not_compiled = (
        "its interior-point solver's face and the implicit gradient's CG are data-dependent, "
        "which Dynamo cannot trace"
    )

    def __init__(
        self,
        model: nn.Module,
        *,
        c_reg: float = 0.1,
        ridge: float = 1.0,
        ipm_steps: int = 15,
        scale: float = 1.0,
        label_smoothing: float = 0.1,
        cg_steps: int = 1000,
        tol: float = 1e-9,
        cg_tol: float = 1e-10,
        head: str = "head",
        **kwargs: Any,
    ) -> None:
        if not (c_reg > 0 and ridge > 0 and ipm_steps >= 1 and cg_steps >= 1):
            raise ValueError(f"c_reg and ridge must be > 0 and ipm_steps, cg_steps >= 1, got "
                             f"{c_reg}, {ridge}, {ipm_steps}, {cg_steps}")  # fmt: skip
        if not 0 <= label_smoothing < 1:
            raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
        if label_smoothing and kwargs.get("loss_fn", F.cross_entropy) is not F.cross_entropy:
            raise ValueError("label_smoothing smooths the cross-entropy; pass label_smoothing=0 "
                             "with another loss_fn")  # fmt: skip
        if kwargs.get("vectorize", "auto") not in ("auto", "loop"):
            raise ValueError(
                "MetaOptNet runs its tasks in a Python loop (its solver's face is "
                f"data-dependent); vectorize={kwargs['vectorize']!r} is not supported, pass "
                "'loop' or 'auto'"
            )
        super().__init__(model, head=head, **kwargs)
        self.vectorize = "loop"
        self.c_reg, self.ridge, self.ipm_steps, self.cg_steps = c_reg, ridge, ipm_steps, cg_steps
        self.label_smoothing, self.tol, self.cg_tol = label_smoothing, tol, cg_tol
        weight = self.model.get_parameter(f"{head}.weight")
        self.scale = nn.Parameter(torch.tensor(float(scale), dtype=weight.dtype,
                                               device=weight.device))  # fmt: skip

    def columns(self, labels: Tensor) -> int:
        """The task's classes, ``max(labels) + 1`` (tasks run in the loop, so a number)."""
        return int(labels.max()) + 1

    def solve(self, support: Tensor, labels: Tensor, columns: int) -> LinearHead:
        """`svm_classifier` with the learner's settings and ``scale``."""
        return svm_classifier(
            support, labels, columns, c_reg=self.c_reg, ridge=self.ridge, scale=self.scale,
            ipm_steps=self.ipm_steps, tol=self.tol, cg_steps=self.cg_steps, cg_tol=self.cg_tol,
        )  # fmt: skip

    def task_fn(self) -> TaskFn:
        """The training meta-loss: the query loss label-smoothed (`smoothed_cross_entropy`)."""
        if not self.label_smoothing:
            return super().task_fn()
        return partial(_smoothed_task_loss, learner=self)

    def evaluate(self, tasks: Sequence[Task], steps: int | None = None) -> tuple[Tensor, Tensor]:
        """Query loss (plain, not smoothed) and accuracy per task: ``([T], [T])``."""
        plain = partial(head_task_loss, learner=self)
        return self._evaluate(tasks, self.inner_loop(0, first_order=True), plain)
