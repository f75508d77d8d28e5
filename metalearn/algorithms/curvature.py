"""The curvature of meta-learning: of each task's support loss and of the meta-objective.

Two Hessians matter while a MAML-family learner meta-trains:

* the Hessian of a task's support loss with respect to the adapted parameters, where the
  learner's inner loop starts (`MetaLearner.inner_start`: theta for MAML, theta with the
  prototype head for Proto-MAML, ...), whose top eigenvalue says whether the inner step is
  stable (`support_curvature`);
* the Hessian of the meta-loss (the mean query loss after the inner loop, differentiated
  through it) with respect to theta, whose top eigenvalue and trace describe the sharpness
  of the landscape the outer optimiser walks (`meta_curvature`).

Neither is ever formed: both come from Hessian-vector products (`metalearn.second_order`),
Lanczos for the top eigenvalue and Hutchinson for the trace. Every random draw comes from
the ``torch.Generator`` passed in, so a measurement is a function of theta and the seed.
The experiments draw their probe tasks once, from `PROBE_SEED`, and measure on the same
tasks every time, so the logged values form one comparable series over a run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from metalearn.algorithms import MetaLearner, MetaLossLearner
from metalearn.engine import Task, meta_batch
from metalearn.second_order import (
    DEFAULT_HVP_METHOD,
    HVPMethod,
    hessian_trace,
    top_eigenvalues,
)

__all__ = ["PROBE_SEED", "MetaCurvature", "meta_curvature", "support_curvature"]

PROBE_SEED = 3
"""Seed of the fixed probe tasks the experiments measure curvature on (validation uses 1,
test 2): every run of a grid measures on the same tasks."""


class MetaCurvature(NamedTuple):
    """Curvature of the meta-loss with respect to theta."""

    top_eigenvalue: float
    """Largest algebraic eigenvalue of the meta-loss Hessian (Lanczos)."""
    trace: float
    """Hutchinson's estimate of the Hessian's trace."""
    trace_std_error: float
    """Standard error of ``trace`` over its probes."""


def support_curvature(
    learner: MetaLearner,
    tasks: Sequence[Task],
    *,
    iterations: int = 20,
    tol: float = 1e-3,
    generator: torch.Generator | None = None,
    hvp_method: HVPMethod = DEFAULT_HVP_METHOD,
) -> Tensor:
    """Top eigenvalue of each task's support-loss Hessian where the inner loop starts, w.r.t.
    the adapted weights.

    The inner loop is gradient descent on the support loss L_s from phi_0 = theta. Near a
    minimum L_s is a quadratic, L_s(phi) ~ 1/2 (phi - phi*)' H (phi - phi*), and one step
    of rate alpha maps the error to ``phi_1 - phi* = (I - alpha H)(phi_0 - phi*)``: along
    the eigenvector of eigenvalue lambda the error is multiplied by ``1 - alpha lambda``,
    which grows in magnitude when ``lambda > 2 / alpha``. So ``lambda_max`` against
    ``2 / inner_lr`` (the experiments log both) says whether the first inner step, at
    theta, is in the regime where plain gradient descent diverges.

    The learner says where its inner loop starts (`MetaLearner.inner_start`): the support
    loss as a function of the parameters the first inner step adapts (``adapt_keys`` with
    a learning rate at step 0), the others held where the loop starts them: theta for MAML,
    theta with the prototype head for Proto-MAML (theta's own head is never used), step 0's
    batch-norm copies for MAML++, the adapters and head for LoRA. It holds no regulariser
    (iMAML's proximal term would add its lambda to every eigenvalue). Learned rates
    (Meta-SGD, MAML++) do not move the start, so the Hessian is the loss's own.

    Args:
        learner: a `MetaLearner` with an inner loop; its theta is read, not changed.
        tasks: T tasks (support ``(x [N_s, ...], y [N_s])``).
        iterations: Lanczos' HVP budget per task (its Krylov dimension).
        tol: Lanczos' relative tolerance on the eigenvalue.
        generator: seeds each task's Lanczos start vector (drawn in task order).
        hvp_method: how each Hessian-vector product is computed.

    Returns:
        ``Tensor[T]`` (float64, CPU): the top eigenvalue of each task's support loss.

    Raises:
        ValueError: no tasks, or a learner with no inner loop (ProtoNet, R2D2, MetaOptNet).
    """
    if not tasks:
        raise ValueError("tasks is empty; pass at least one Task to measure the support loss on")
    values = []
    for task in tasks:
        start = learner.inner_start(task)
        result = top_eigenvalues(
            start.loss, start.adapted, max_iter=iterations, tol=tol, generator=generator,
            hvp_method=hvp_method,
        )  # fmt: skip
        values.append(float(result.eigenvalues[0]))
    return torch.tensor(values, dtype=torch.float64)


def meta_curvature(
    learner: MetaLearner,
    probe_tasks: Sequence[Task],
    *,
    iterations: int = 20,
    samples: int = 10,
    tol: float = 1e-3,
    generator: torch.Generator | None = None,
    hvp_method: HVPMethod = DEFAULT_HVP_METHOD,
) -> MetaCurvature:
    """Top eigenvalue and trace of the meta-loss Hessian with respect to theta.

    The meta-loss is MAML's outer objective (Finn et al., 2017, Eq. 2) on the probe tasks,
    ``F(theta) = 1/T sum_t L_q,t(phi_t(theta))`` with ``phi_t`` the inner loop's result,
    always differentiated through the inner loop (second order, even for a first-order
    learner, whose meta-gradient only approximates grad F). It runs as the learner's own
    meta-loss does (its inner loop, rates, per-task loss and vectorisation); learnable
    inner rates and MAML++'s batch-norm copies are held fixed, theta alone varies.

    Each Hessian-vector product differentiates F twice, through the inner loop's
    ``torch.func`` gradient: double backward (the default) works on autograd's graph of
    that gradient, and tests/algorithms/test_curvature.py checks it, in loop and vmap mode,
    against the dense Hessian of a hand-written one-step MAML meta-loss. An HVP costs about
    two meta-gradients of the probe batch: ``iterations + samples`` of them in all.

    Args:
        learner: a `MetaLossLearner` (MAML, FOMAML, ANIL, Meta-SGD, MAML++).
        probe_tasks: the T tasks of the meta-loss (keep them fixed across a run).
        iterations: Lanczos' HVP budget for the top eigenvalue.
        samples: Hutchinson's Rademacher probes for the trace (>= 2).
        tol: Lanczos' relative tolerance on the eigenvalue.
        generator: seeds Hutchinson's probes (drawn first) and then Lanczos' start vector.
        hvp_method: how each Hessian-vector product is computed.

    Returns:
        A `MetaCurvature` (top eigenvalue, trace and the trace's standard error).
    """
    if not isinstance(learner, MetaLossLearner):
        raise TypeError(
            f"{type(learner).__name__} has no meta-loss to differentiate (its meta-gradient "
            "is computed another way); meta_curvature needs MAML, FOMAML, ANIL, Meta-SGD or "
            "MAML++, and support_curvature works for every learner"
        )
    if not probe_tasks:
        raise ValueError("probe_tasks is empty; pass at least one Task for the meta-loss")
    theta = {k: v.detach() for k, v in learner.theta().items()}
    inner = learner.inner_loop(first_order=False, tasks=probe_tasks)
    buffers, task_fn = learner.buffers_dict(), learner.task_fn()
    norm = learner.normalisation(probe_tasks[0])  # read once, not at every product

    def loss(params: dict[str, Tensor]) -> Tensor:
        return meta_batch(
            learner.model, params, probe_tasks, inner, buffers=buffers,
            vectorize=learner.vectorize, task_fn=task_fn, normalisation=norm,
        ).loss  # fmt: skip

    trace = hessian_trace(loss, theta, samples, generator=generator, hvp_method=hvp_method)
    top = top_eigenvalues(
        loss, theta, max_iter=iterations, tol=tol, generator=generator, hvp_method=hvp_method
    )
    return MetaCurvature(float(top.eigenvalues[0]), trace.estimate, trace.std_error)
