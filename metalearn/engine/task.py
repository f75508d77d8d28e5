"""What flows through the engine: a task, one task's result, a meta-batch's result, and the
errors a non-finite loss raises.

`Task` itself lives in `metalearn.task`, below the engine, so that the data sets build
tasks without importing the engine; it is re-exported here. This module is the engine's
bottom step: every engine module (`inner`, `outer`, `plan`, `accumulate`) speaks its types.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from metalearn.task import StopRule, Task

__all__ = [
    "AllTasksSkippedError",
    "MetaBatch",
    "NonFiniteLossError",
    "StopRule",
    "Task",
    "TaskResult",
    "accuracy",
]


class TaskResult(NamedTuple):
    """What one task contributes to a meta-batch."""

    loss: Tensor
    """Query loss of the adapted weights, ``Tensor[]`` (differentiable w.r.t. theta)."""
    accuracy: Tensor
    """Query accuracy (argmax of outputs == targets), ``Tensor[]``; NaN for regression."""
    support_losses: Tensor
    """Support loss before each inner step taken, ``Tensor[steps_taken]``."""


class MetaBatch(NamedTuple):
    """A meta-batch's results; ``loss`` is what the outer optimiser differentiates."""

    loss: Tensor
    """Mean query loss over the kept tasks, ``Tensor[]``."""
    accuracy: Tensor
    """Mean query accuracy over the kept tasks, ``Tensor[]``."""
    task_losses: Tensor
    """Per-task query losses, ``Tensor[T]`` in task order (NaN for skipped tasks)."""
    task_accuracies: Tensor
    """Per-task query accuracies, ``Tensor[T]`` (NaN for skipped tasks and regression)."""
    skipped: list[int]
    """Positions, in this result's ``T`` tasks, of tasks dropped for a non-finite loss."""
    vectorized: int
    """How many tasks ran under vmap (the rest ran in the loop)."""


def accuracy(out: Tensor, y: Tensor) -> Tensor:
    """Fraction of rows whose argmax is the target, ``Tensor[]``; NaN for regression targets.

    Args:
        out: outputs ``[N, K]`` (logits) or ``[N, ...]`` for regression.
        y: targets ``[N]`` (class indices) or regression targets.
    """
    if out.dim() == y.dim() + 1 and not y.is_floating_point():
        return (out.argmax(-1) == y).float().mean()
    return torch.full((), float("nan"), device=out.device)


class NonFiniteLossError(FloatingPointError):
    """A support or query loss became NaN or infinite; names the task and inner step.

    ``task_index`` is the task's position in the whole meta-batch the caller passed, whatever
    chunk or vmap bucket it ran in.
    """

    def __init__(self, kind: str, task_index: int | None, step: int | None, value: float):
        self.kind, self.task_index, self.step, self.value = kind, task_index, step, value
        where = f"task {task_index}" if task_index is not None else "the task"
        at = f" at inner step {step}" if step is not None else ""
        super().__init__(
            f"non-finite {kind} loss ({value}) in {where}{at}; lower the inner learning rate, "
            "check the data for NaNs, or pass on_nonfinite='skip' to drop such tasks"
        )


class AllTasksSkippedError(FloatingPointError):
    """Every task of a meta-batch had a non-finite loss (``on_nonfinite="skip"``)."""

    def __init__(self, n_tasks: int) -> None:
        self.n_tasks = n_tasks
        super().__init__(
            f"all {n_tasks} tasks of the meta-batch had non-finite losses; lower the inner "
            "learning rate or check the data for NaNs"
        )
