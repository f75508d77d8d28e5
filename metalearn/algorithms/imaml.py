"""iMAML (Rajeswaran, Finn, Kakade & Levine, 2019, "Meta-Learning with Implicit Gradients").

The inner problem is proximal (Eq. 3-4)::

    phi_i = argmin_phi  L_support(phi) + lam/2 ||phi - theta||^2

solved approximately by gradient descent from ``phi_0 = theta`` with no graph to theta, so
memory does not grow with the number of inner steps. At the optimum, the implicit function
theorem gives ``d phi_i / d theta = (I + H_i / lam)^{-1}`` with ``H_i`` the Hessian of
L_support at phi_i (Lemma 1, Eq. 6), so the task's meta-gradient (Eq. 5) is::

    g_i = (I + H_i / lam)^{-1} grad_phi L_query(phi_i)

found by conjugate gradient from Hessian-vector products only (Eq. 7), through
`metalearn.implicit` (the implicit function theorem on the condition ``grad_phi [L_support +
lam/2 ||phi - theta||^2] = 0``). `IMAML.backward`
writes ``mean_i g_i`` into ``.grad``. The result is exact when the inner loop reaches the
optimum and CG converges; the paper runs few of both (16 GD steps, 5 CG steps on Omniglot).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value

from metalearn.algorithms.base import (
    MetaLearner,
    StepMetrics,
    accumulate_grad,
    check_loop_only,
)
from metalearn.attention import attention_kernel
from metalearn.engine import (
    AllTasksSkippedError,
    LossFn,
    NonFiniteLossError,
    StopRule,
    Task,
    accuracy,
    adapt,
)
from metalearn.functional import detached, tree_dot
from metalearn.implicit import LinearSolve, NotPositiveDefiniteError, Optimality, implicit_vjp
from metalearn.optim import Hyperparameter
from metalearn.second_order import (
    DEFAULT_HVP_METHOD,
    HVPMethod,
    NegativeCurvature,
    check_negative_curvature,
)

__all__ = [
    "IMAML",
    "IMAMLMetrics",
    "ImplicitResult",
    "implicit_meta_gradient",
    "proximal_adapt",
]


def proximal_adapt(
    model: nn.Module,
    theta: Mapping[str, Tensor],
    support: tuple[Tensor, Tensor],
    *,
    lam: float,
    steps: int,
    lr: Hyperparameter,
    loss_fn: LossFn = F.cross_entropy,
    buffers: Mapping[str, Tensor] | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    stop: StopRule | None = None,
    task_index: int | None = None,
) -> dict[str, Tensor]:
    """Approximately solve iMAML's inner problem (Eq. 4) by gradient descent, with no graph.

    Args:
        model: the network (``functional_call``).
        theta: the meta-parameters, name -> tensor (used as constants: detached here).
        support: ``(x [N_s, ...], y [N_s])``.
        lam: the proximal strength lambda >= 0 (0: gradient descent on the support loss
            alone, iMAML's meta-test adaptation by default).
        steps: gradient steps from ``phi_0 = theta``.
        lr: inner learning rate (see `metalearn.optim.Hyperparameter`).
        loss_fn: ``loss_fn(outputs, y) -> Tensor[]``.
        buffers: non-adapted tensors for ``functional_call``.
        model_kwargs: forward keyword arguments.
        stop: early-stopping rule on the regularised support loss.
        task_index: for error messages.

    Returns:
        phi, a dict with every key of ``theta``, detached.
    """
    anchor = detached(theta)

    def proximal(fast: Mapping[str, Tensor]) -> Tensor:
        # Eq. 4's regulariser, around a constant theta: no path from phi back to theta.
        return 0.5 * lam * sum(((fast[k] - anchor[k]) ** 2).sum() for k in anchor)

    with torch.no_grad():  # torch.func.grad inside adapt still differentiates
        fast = adapt(
            model, anchor, support, steps=steps, lr=detached(lr), loss_fn=loss_fn,
            first_order=True, buffers=buffers, model_kwargs=model_kwargs,
            regularizer=proximal if lam else None, stop=stop, check_finite=True,
            task_index=task_index,
        )  # fmt: skip
    return fast


class ImplicitResult(NamedTuple):
    """One task's contribution to iMAML's meta-gradient."""

    grad: dict[str, Tensor]
    """g_i, shaped like theta (Eq. 7's solution; ``grad L_query(phi_i)`` if first order)."""
    loss: Tensor
    """Query loss at phi_i, ``Tensor[]``."""
    accuracy: Tensor
    """Query accuracy at phi_i, ``Tensor[]`` (NaN for regression)."""
    fast: dict[str, Tensor]
    """phi_i, the adapted weights."""
    query_grad: dict[str, Tensor]
    """grad_phi L_query(phi_i), the right-hand side of Eq. 7 (FOMAML's direction)."""
    cg: LinearSolve | None
    """The CG solve of Eq. 7 (iterations, residual, converged); None when first order."""


def implicit_meta_gradient(
    model: nn.Module,
    theta: Mapping[str, Tensor],
    support: tuple[Tensor, Tensor],
    query: tuple[Tensor, Tensor],
    *,
    lam: float = 2.0,
    inner_steps: int = 16,
    inner_lr: Hyperparameter = 0.02,
    loss_fn: LossFn = F.cross_entropy,
    cg_steps: int = 5,
    cg_tol: float = 1e-10,
    cg_damping: float = 0.0,
    cg_negative_curvature: NegativeCurvature = "raise",
    first_order: bool = False,
    hvp_method: HVPMethod = DEFAULT_HVP_METHOD,
    buffers: Mapping[str, Tensor] | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    stop: StopRule | None = None,
    task_index: int | None = None,
) -> ImplicitResult:
    """iMAML's meta-gradient for one task (Rajeswaran et al., 2019, Alg. 2 lines 4-6).

    Args:
        model: the network.
        theta: meta-parameters, name -> tensor (not modified; no graph is built to them).
        support: ``(x [N_s, ...], y [N_s])``, the inner problem's data.
        query: ``(x [N_q, ...], y [N_q])``, the outer loss's data.
        lam: proximal strength lambda > 0 (Eq. 4).
        inner_steps: gradient steps on the proximal inner problem.
        inner_lr: their learning rate (needs ``inner_lr * lam < 2`` to converge).
        loss_fn: ``loss_fn(outputs, y) -> Tensor[]``.
        cg_steps: most CG iterations (Hessian-vector products).
        cg_tol: CG stops early at relative residual ``||r|| / ||b|| <= cg_tol``.
        cg_damping: extra ``cg_damping * I`` added to ``I + H/lam`` (0: exact). Positive
            values keep CG well defined when H has eigenvalues below ``-lam``, at the cost
            of a biased meta-gradient. Such eigenvalues are common in practice: measured on
            Conv4, 12 Omniglot 5-way 1-shot tasks at initialisation, lam = 2, 16 inner steps,
            H's lowest eigenvalue after adaptation was -4 to -13, and CG met negative
            curvature in 5 to 10 of the 12 tasks with cg_damping = 0, 2 with 3, none with 10.
        cg_negative_curvature: what CG does where ``p'(I + H/lam + cg_damping I)p <= 0``:
            ``"raise"`` a ValueError naming the task, ``"continue"`` the plain recurrence
            (the reference's CG), ``"stop"`` truncated CG
            (`metalearn.second_order.conjugate_gradient`); recorded in ``cg``.
        first_order: skip CG and return ``grad L_query(phi_i)`` (the ``lam -> inf`` limit of
            Eq. 6, where ``d phi / d theta -> I``).
        hvp_method: how `metalearn.second_order.hvp` computes ``H u``; by default
            `metalearn.second_order.DEFAULT_HVP_METHOD` (double backward, the fastest exact
            method on Conv4 and the MLP in ``scripts/bench_hvp.py``).
        buffers: non-adapted tensors for ``functional_call``.
        model_kwargs: forward keyword arguments.
        stop: early-stopping rule for the inner loop.
        task_index: for error messages.

    Returns:
        An `ImplicitResult`.
    """
    buffers, kwargs = dict(buffers or {}), dict(model_kwargs or {})
    phi = proximal_adapt(
        model, theta, support, lam=lam, steps=inner_steps, lr=inner_lr, loss_fn=loss_fn,
        buffers=buffers, model_kwargs=kwargs, stop=stop, task_index=task_index,
    )  # fmt: skip

    def query_loss(p: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        out = functional_call(model, {**buffers, **p}, (query[0],), kwargs)
        return loss_fn(out, query[1]), out

    with torch.no_grad():
        g_query, (loss, out) = grad_and_value(query_loss, has_aux=True)(phi)
    if not torch.isfinite(loss):
        raise NonFiniteLossError("query", task_index, None, float(loss))
    if first_order:
        return ImplicitResult(g_query, loss, accuracy(out, query[1]), phi, g_query, None)

    anchor = detached(theta)

    def inner_objective(p: dict[str, Tensor], th: dict[str, Tensor]) -> Tensor:
        # Eq. 4's objective over lam (the same minimiser): its gradient in phi is the
        # optimality condition F(phi, theta) = 0, whose Jacobians are dF/dphi = I + H/lam
        # and dF/dtheta = -I, so the IFT's -(dF/dtheta)^T (dF/dphi)^{-1} g is Eq. 7's
        # (I + H/lam)^{-1} g, and CG runs on Eq. 7's own system: its curvatures p'Ap, and
        # truncated CG's first-iteration answer g, are on the paper's scale.
        with attention_kernel(twice_differentiated=True):  # CG's HVPs differentiate its gradient
            out = functional_call(model, {**buffers, **p}, (support[0],), kwargs)
        proximal = 0.5 * sum(((p[k] - th[k]) ** 2).sum() for k in th)
        return loss_fn(out, support[1]) / lam + proximal

    condition = Optimality(objective=inner_objective, hvp_method=hvp_method)
    try:
        # cg_damping is added to I + H/lam, the system CG solves
        (grad,), cg = implicit_vjp(
            condition, phi, [anchor], g_query, solve="cg", damping=cg_damping,
            max_iter=cg_steps, tol=cg_tol, on_negative_curvature=cg_negative_curvature,
        )  # fmt: skip
    except NotPositiveDefiniteError as error:  # I + H/lam is indefinite
        where = f"task {task_index}" if task_index is not None else "the task"
        raise ValueError(
            f"iMAML's CG failed in {where}: {error.reason}. I + H/lam is indefinite: H has "
            f"eigenvalues below -lam = {-lam:g}, so phi is not a minimum of the proximal inner "
            "problem (Eq. 4). Pass cg_damping > 0 (a biased but defined meta-gradient), or "
            "run the inner loop closer to convergence (smaller inner_lr, more inner_steps)"
        ) from error
    return ImplicitResult(grad, loss, accuracy(out, query[1]), phi, g_query, cg)


@dataclass
class IMAMLMetrics(StepMetrics):
    """`StepMetrics` plus how well CG solved Eq. 7 (means over the kept tasks)."""

    cg_iterations: float = 0.0
    """Mean CG iterations (Hessian-vector products) per task."""
    cg_residual: float = math.nan
    """Largest relative residual ``||r|| / ||b||`` over the tasks (NaN when first order)."""
    cg_converged: float = math.nan
    """Fraction of tasks whose CG reached ``cg_tol`` (NaN when first order)."""
    cg_negative_curvature: float = math.nan
    """Fraction of tasks whose CG met non-positive curvature (NaN when first order)."""


class IMAML(MetaLearner):
    """Implicit MAML: a proximal inner loop and an implicit meta-gradient by CG.

    Tasks run in a Python loop; each costs ``inner_steps`` gradient evaluations plus
    ``cg_steps`` Hessian-vector products, with memory independent of ``inner_steps``.
    Meta-test adaptation (`adapt`, `evaluate`) descends the proximal objective at
    ``eval_lam``: by default 0, plain gradient descent on the support loss, as the
    reference tests.

    Args:
        model: the network; its parameters are theta (all of them are adapted).
        lam: proximal strength lambda (default 2.0: the paper's Omniglot setting, Table 2).
            Larger keeps phi near theta (and H/lam small, so CG converges fast).
        inner_lr: inner learning rate; needs ``inner_lr * lam < 2``. The default 0.1 is
            the paper's Omniglot setting (docs/algorithms.md).
        inner_steps: inner GD steps (default 16: the reference's Omniglot command,
            ``--n_steps 16``; the ``imaml-cpu`` preset runs 5).
        cg_steps: CG iterations per task (default 5, as in the paper).
        cg_tol: relative residual at which CG stops early.
        cg_damping: extra damping added to ``I + H/lam`` (0: exact). The default 11 is the
            reference's system: its ``matrix_evaluator`` solves ``(1 + regu_coef) v +
            H v / (lam + lam_damping)`` with ``regu_coef = --cg_damping 1.0`` and
            ``lam_damping = 10``, i.e. ``(lam + 10) / lam`` times ``(1 + d) I + H / lam``
            with ``d = 2 (lam + 10) / lam - 1 = 11`` at lam = 2 (its solution is 6 times
            this one's). Conv4 on Omniglot needs about 10 at lam = 2 for CG to see no
            negative curvature (measured; see `implicit_meta_gradient`).
        cg_negative_curvature: what CG does at non-positive curvature ``p'Ap <= 0``: the
            default ``"continue"`` runs the plain recurrence through it (alpha negative), as
            the reference's ``cg_solve`` does (aravindr93/imaml_dev, implicit_maml/utils.py
            lines 79-83: ``alpha = rdotr/(p.dot(Ap))``, no check); ``"stop"`` truncates CG
            there (Nocedal & Wright, Alg. 7.1); ``"raise"`` stops the run with a ValueError
            (the behaviour before this argument). `IMAMLMetrics.cg_negative_curvature` is
            the fraction of tasks where it happened.
        first_order: use ``grad L_query(phi_i)`` as g_i (no CG).
        hvp_method: how ``H u`` is computed (see `implicit_meta_gradient`).
        eval_lam: the proximal strength of meta-test adaptation (`adapt`, `evaluate`, and
            so validation, test and deployment), >= 0; None: ``lam``, the training problem.
            The default 0.0 is the reference's test: ``examples/measure_accuracy.py`` runs
            ``learn_task(..., add_regularization=False)`` (line 75, gradient descent on the
            support loss), then one step on ``regularization_loss(meta_params, args.lam)``
            (lines 76-79), a zero gradient at the command's ``--lam 0.0``
            (``examples/README.md`` line 17; ``--lam`` defaults to 0.0, line 40).
        **kwargs: as for `MetaLearner` (``loss_fn``, ``on_nonfinite``). ``adapt_keys`` is
            not supported; ``vectorize`` must be ``"auto"`` or ``"loop"``.
    """

    fixed_arguments = ("adapt_keys",)

    def __init__(
        self,
        model: nn.Module,
        *,
        lam: float = 2.0,
        inner_lr: float = 0.1,
        inner_steps: int = 16,
        cg_steps: int = 5,
        cg_tol: float = 1e-10,
        cg_damping: float = 11.0,
        cg_negative_curvature: NegativeCurvature = "continue",
        first_order: bool = False,
        hvp_method: HVPMethod = DEFAULT_HVP_METHOD,
        eval_lam: float | None = 0.0,
        **kwargs: Any,
    ) -> None:
        if kwargs.get("adapt_keys") is not None:
            raise ValueError(
                "IMAML adapts every parameter: with some held fixed, their meta-gradient "
                "needs mixed second derivatives this implementation does not compute; "
                "drop adapt_keys"
            )
        _check_settings(lam, inner_lr, cg_steps, cg_damping, cg_negative_curvature)
        _check_eval_lam(eval_lam, inner_lr)
        super().__init__(
            model, inner_lr=inner_lr, inner_steps=inner_steps, first_order=first_order, **kwargs
        )
        check_loop_only(self, "IMAML")
        self.lam, self.cg_steps, self.cg_tol = lam, cg_steps, cg_tol
        self.cg_damping, self.hvp_method = cg_damping, hvp_method
        self.cg_negative_curvature = cg_negative_curvature
        self.eval_lam = eval_lam

    def backward(self, tasks: Sequence[Task]) -> IMAMLMetrics:
        """Accumulate ``mean_i g_i`` (Eq. 5-7) into ``.grad`` of theta.

        Args:
            tasks: the meta-batch (T tasks).

        Returns:
            `IMAMLMetrics`: query loss and accuracy at phi_i, and CG diagnostics.
        """
        if not tasks:
            raise ValueError("the meta-batch is empty; pass at least one Task")
        theta = self.theta()
        results, skipped = [], 0
        for i, task in enumerate(tasks):
            try:
                results.append(self._task(theta, task, i))
            except NonFiniteLossError:
                if self.on_nonfinite == "raise":
                    raise
                skipped += 1
        if not results:
            raise AllTasksSkippedError(len(tasks))
        accumulate_grad(theta, {k: torch.stack([r.grad[k] for r in results]).mean(0)
                                for k in theta})  # fmt: skip
        return _metrics(results, skipped)

    def _task(self, theta: Mapping[str, Tensor], task: Task, index: int) -> ImplicitResult:
        return implicit_meta_gradient(
            self.model, theta, task.support, task.query, lam=self.lam,
            inner_steps=self.inner_steps if task.steps is None else task.steps,
            inner_lr=self.learning_rate(), loss_fn=self.loss_fn, cg_steps=self.cg_steps,
            cg_tol=self.cg_tol, cg_damping=self.cg_damping,
            cg_negative_curvature=self.cg_negative_curvature, first_order=self.first_order,
            hvp_method=self.hvp_method, buffers=dict(self.model.named_buffers()),
            model_kwargs=task.model_kwargs, stop=task.stop, task_index=index,
        )  # fmt: skip

    def adapt(self, task: Task, steps: int | None = None) -> dict[str, Tensor]:
        """Fast weights for one task: gradient descent on the support loss plus the proximal
        term at ``eval_lam`` (Eq. 4; 0: the support loss alone), detached."""
        return self._adapt(task, steps, None)

    def _adapt(self, task: Task, steps: int | None, index: int | None) -> dict[str, Tensor]:
        lam = self.lam if self.eval_lam is None else self.eval_lam
        return proximal_adapt(
            self.model, self.theta(), task.support, lam=lam,
            steps=self.inner_steps if steps is None else steps, lr=self.learning_rate(),
            loss_fn=self.loss_fn, buffers=self.buffers_dict(),
            model_kwargs=task.model_kwargs, task_index=index,
        )  # fmt: skip

    def evaluate(self, tasks: Sequence[Task], steps: int | None = None) -> tuple[Tensor, Tensor]:
        """Query loss and accuracy per task after `adapt`'s inner loop: ``([T], [T])``.

        Under ``on_nonfinite="skip"`` a task whose loss is not finite gets NaN for both.
        """
        buffers = self.buffers_dict()
        losses, accs = [], []
        for i, task in enumerate(tasks):
            try:
                fast = self._adapt(task, steps, i)
                with torch.no_grad():
                    out = functional_call(self.model, {**buffers, **fast}, (task.query[0],),
                                          dict(task.model_kwargs))  # fmt: skip
                loss = self.loss_fn(out, task.query[1])
                if not torch.isfinite(loss):
                    raise NonFiniteLossError("query", i, None, float(loss))
            except NonFiniteLossError:
                if self.on_nonfinite == "raise":
                    raise
                losses.append(task.query[0].new_full((), float("nan")))
                accs.append(torch.full((), float("nan"), device=task.query[0].device))
                continue
            losses.append(loss)
            accs.append(accuracy(out, task.query[1]))
        return torch.stack(losses), torch.stack(accs)


def _check_settings(lam: float, inner_lr: float, cg_steps: int, cg_damping: float,
                    cg_negative_curvature: str) -> None:  # fmt: skip
    if not lam > 0:
        raise ValueError(f"lam must be > 0 (the proximal strength of Eq. 4), got {lam}")
    if isinstance(inner_lr, (int, float)) and inner_lr * lam >= 2:
        raise ValueError(
            f"inner_lr * lam = {inner_lr * lam:g} >= 2: gradient descent on the proximal term "
            "alone (curvature lam) diverges; lower inner_lr below 2 / lam"
        )
    if cg_steps < 1:
        raise ValueError(f"cg_steps must be >= 1, got {cg_steps}; use first_order=True for none")
    if cg_damping < 0:
        raise ValueError(f"cg_damping must be >= 0, got {cg_damping}")
    check_negative_curvature(cg_negative_curvature, "cg_negative_curvature")


def _check_eval_lam(eval_lam: float | None, inner_lr: float) -> None:
    if eval_lam is None:
        return
    if not eval_lam >= 0:
        raise ValueError(f"eval_lam must be >= 0 (0: plain gradient descent at evaluation, "
                         f"the reference's test) or None (lam), got {eval_lam}")  # fmt: skip
    if isinstance(inner_lr, (int, float)) and inner_lr * eval_lam >= 2:
        raise ValueError(f"inner_lr * eval_lam = {inner_lr * eval_lam:g} >= 2: evaluation's "
                         "gradient descent on the proximal term diverges; lower eval_lam below "
                         "2 / inner_lr")  # fmt: skip


def _metrics(results: Sequence[ImplicitResult], skipped: int) -> IMAMLMetrics:
    loss = float(torch.stack([r.loss for r in results]).mean())
    accuracy = float(torch.stack([r.accuracy for r in results]).mean())
    solves = [r for r in results if r.cg is not None]
    if not solves:
        return IMAMLMetrics(loss, accuracy, skipped, 0)
    # Relative to ||b|| = ||grad L_query(phi_i)||, the quantity CG's stopping rule uses.
    relative = [
        r.cg.residual_norm / max(math.sqrt(float(tree_dot(r.query_grad, r.query_grad))), 1e-300)
        for r in solves
    ]
    return IMAMLMetrics(
        loss, accuracy, skipped, 0,
        cg_iterations=sum(r.cg.iterations for r in solves) / len(solves),
        cg_residual=max(relative),
        cg_converged=sum(r.cg.converged for r in solves) / len(solves),
        cg_negative_curvature=sum(r.cg.negative_curvature is not None for r in solves)
        / len(solves),
    )  # fmt: skip
