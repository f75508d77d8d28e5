"""Adapt a trained learner to a support set: its own inner loop, inputs checked first."""

from __future__ import annotations

import torch
from torch import Tensor

from metalearn.algorithms import MetaLearner
from metalearn.debug import check_consistent
from metalearn.engine import Task
from metalearn.models import evaluation_mode

__all__ = ["adapt_to_support"]


def adapt_to_support(
    learner: MetaLearner, x: Tensor, y: Tensor, steps: int | None = None
) -> dict[str, Tensor]:
    """The learner's fast weights for the support set ``(x, y)`` (its own inner loop).

    This is ``learner.adapt`` (MAML++ and Meta-SGD use their learned rates; MAML++ its
    last step's batch-norm weights), detached, after checking the inputs, in evaluation
    mode as the run's test (no dropout).

    Args:
        learner: a trained learner (e.g. from `load_learner`).
        x: support images ``[N, C, H, W]`` on the learner's device and dtype.
        y: class indices ``[N]`` (int64), each in ``[0, ways)``.
        steps: inner steps (None: ``learner.inner_steps``, the training value; the
            experiment evaluates with its ``eval_inner_steps``).

    Returns:
        Parameter name -> adapted tensor, every parameter of ``learner.model``.

    Raises:
        ValueError: shapes, label range or device disagree (named), or ``steps < 0``.
        TypeError: ``y`` is not an integer tensor or ``x``'s dtype is not the model's.
    """
    if x.dim() != 4 or y.dim() != 1 or len(x) != len(y):
        raise ValueError(
            f"support images must be [N, C, H, W] and labels [N], got {tuple(x.shape)} and "
            f"{tuple(y.shape)}; load them with load_support_folder"
        )
    if y.is_floating_point() or y.dtype == torch.bool:
        raise TypeError(f"labels must be class indices (int64), got {y.dtype}; use y.long()")
    check_consistent(learner=learner, support=(x, y))
    with torch.no_grad(), evaluation_mode(learner):
        ways = learner.model(x[:2]).shape[-1]
    if y.min() < 0 or y.max() >= ways:
        raise ValueError(
            f"labels span {int(y.min())}..{int(y.max())} but the model predicts {ways} classes "
            f"(0..{ways - 1}); relabel the support set or use a model with more ways"
        )
    if steps is not None and steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    empty = (x[:0], y[:0])  # adapt reads only the support set
    with evaluation_mode(learner):  # as the run's test: no dropout
        return learner.adapt(Task(support=(x, y), query=empty), steps=steps)
