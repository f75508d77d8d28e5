"""The names of a run's logged metrics, and the curvature measurement the loop logs.

Every metric an experiment logs, W&B summarises or a tool reads back is named here once;
the experiments and `metalearn.runs` use these constants, never the string. ``train/``:
the meta-batch's query loss and accuracy, the outer step size and the learner's schedule;
``val/`` and ``test/``: accuracy on held-out tasks with its 95% interval; ``perf/``:
seconds and rates; ``curv/``: the curvature of the support and meta losses
(`measure_curvature`); ``train/cg_*``: how iMAML's conjugate gradient solved its tasks'
linear systems (`metalearn.runs.outer_loop.solver_metrics`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from metalearn import distributed
from metalearn.algorithms import MetaLearner
from metalearn.algorithms.curvature import PROBE_SEED, meta_curvature, support_curvature
from metalearn.algorithms.registry import algorithms_that, can
from metalearn.models import evaluation_mode
from metalearn.runs.lifecycle import require
from metalearn.runs.recipe import Recipe

__all__ = [
    "CURV_META_TOP_EIG",
    "CURV_META_TRACE",
    "CURV_META_TRACE_STD_ERROR",
    "CURV_SUPPORT_TOP_EIG",
    "CURV_SUPPORT_TOP_EIG_MAX",
    "CURV_TWO_OVER_INNER_LR",
    "PERF_CURVATURE_S",
    "PERF_STEP_S",
    "PERF_TASKS_PER_S",
    "PERF_TOTAL_MINUTES",
    "PERF_VECTORIZED_TASKS",
    "TEST_ACC",
    "TEST_ACC_CI95",
    "TEST_ACC_ONE_TO_ONE",
    "TEST_ACC_ONE_TO_ONE_CI95",
    "TEST_BEST_ITERATION",
    "TRAIN_ACC",
    "TRAIN_CG_CONVERGED",
    "TRAIN_CG_NEGATIVE_CURVATURE",
    "TRAIN_LOSS",
    "TRAIN_OUTER_LR",
    "TRAIN_SKIPPED",
    "VAL_ACC",
    "VAL_ACC_CI95",
    "VAL_BEST_ACC",
    "curvature_probe",
    "measure_curvature",
]

TRAIN_LOSS = "train/loss"
TRAIN_ACC = "train/acc"
TRAIN_OUTER_LR = "train/outer_lr"
TRAIN_SKIPPED = "train/skipped"
TRAIN_CG_CONVERGED = "train/cg_converged"
"""iMAML: the fraction of the meta-batch's tasks whose CG reached its tolerance."""
TRAIN_CG_NEGATIVE_CURVATURE = "train/cg_negative_curvature"
"""iMAML: the fraction of the meta-batch's tasks whose CG met non-positive curvature."""
VAL_ACC = "val/acc"
VAL_ACC_CI95 = "val/acc_ci95"
VAL_BEST_ACC = "val/best_acc"
"""The running best validation accuracy (its last value is the best: what sweeps optimise)."""
TEST_ACC = "test/acc"
TEST_ACC_CI95 = "test/acc_ci95"
TEST_ACC_ONE_TO_ONE = "test/acc_one_to_one"
"""The within-alphabet test's queries assigned to the classes one-to-one (transductive:
`metalearn.assignment`), on the same tasks and logits as ``test/acc``, beside it."""
TEST_ACC_ONE_TO_ONE_CI95 = "test/acc_one_to_one_ci95"
TEST_BEST_ITERATION = "test/best_iteration"
PERF_STEP_S = "perf/step_s"
PERF_TASKS_PER_S = "perf/tasks_per_s"
PERF_VECTORIZED_TASKS = "perf/vectorized_tasks"
PERF_TOTAL_MINUTES = "perf/total_minutes"
PERF_CURVATURE_S = "perf/curvature_s"
CURV_SUPPORT_TOP_EIG = "curv/support_top_eig"
CURV_SUPPORT_TOP_EIG_MAX = "curv/support_top_eig_max"
CURV_TWO_OVER_INNER_LR = "curv/two_over_inner_lr"
CURV_META_TOP_EIG = "curv/meta_top_eig"
CURV_META_TRACE = "curv/meta_trace"
CURV_META_TRACE_STD_ERROR = "curv/meta_trace_std_error"


def curvature_probe(recipe: Recipe, learner: MetaLearner, sampler) -> list | None:
    """The fixed probe tasks curvature is measured on (rank 0 only), or None when off.

    Drawn from the training split with their own generator (`PROBE_SEED`), so they are the
    same in every run and across a resume, and the training tasks are drawn as without them.

    Raises:
        UserError: ``curvature_every`` > 0 for a learner with no inner loop or no meta-loss.
    """
    t = recipe.training
    algorithm = recipe.learner.algorithm
    lacks = "no inner loop" if not can(algorithm, "inner_loop") else "no meta-loss"
    require(t.curvature_every == 0 or can(algorithm, "curvature"),
            f"--curvature-every {t.curvature_every} with --algorithm {algorithm}: "
            f"{type(learner).__name__} has {lacks} to measure; use "
            f"{', '.join(algorithms_that('curvature'))}, or drop --curvature-every")  # fmt: skip
    if t.curvature_every == 0 or not distributed.is_main():
        return None
    return sampler.batch(t.curvature_tasks, torch.Generator().manual_seed(PROBE_SEED))


def measure_curvature(learner: MetaLearner, probe: Sequence) -> dict[str, float]:
    """The ``curv/`` metrics of the learner's current theta on the probe tasks.

    ``curv/support_top_eig`` (mean over the probe tasks) and ``curv/support_top_eig_max``:
    the top eigenvalue of each task's support-loss Hessian where the inner loop starts, beside
    ``curv/two_over_inner_lr``, the eigenvalue above which the inner step of rate
    ``inner_lr`` (the configured one; learned rates differ) diverges on a quadratic
    (`metalearn.algorithms.curvature.support_curvature`). ``curv/meta_top_eig``,
    ``curv/meta_trace`` and its ``curv/meta_trace_std_error``: the second-order meta-loss
    Hessian w.r.t. theta (`metalearn.algorithms.curvature.meta_curvature`).
    ``perf/curvature_s``: the seconds it all took. Each measurement seeds its own generator
    from `PROBE_SEED` and runs in evaluation mode (no dropout), so it depends on theta alone.
    """
    start = time.perf_counter()
    with evaluation_mode(learner):
        gen = torch.Generator().manual_seed(PROBE_SEED)
        support = support_curvature(learner, probe, generator=gen)
        meta = meta_curvature(learner, probe, generator=gen.manual_seed(PROBE_SEED))
    return {
        CURV_SUPPORT_TOP_EIG: float(support.mean()),
        CURV_SUPPORT_TOP_EIG_MAX: float(support.max()),
        CURV_TWO_OVER_INNER_LR: 2 / float(learner.inner_lr),
        CURV_META_TOP_EIG: meta.top_eigenvalue, CURV_META_TRACE: meta.trace,
        CURV_META_TRACE_STD_ERROR: meta.trace_std_error,
        PERF_CURVATURE_S: time.perf_counter() - start,
    }  # fmt: skip
