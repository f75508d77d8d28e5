"""A few-shot task, what it yields, and the errors a non-finite loss raises.

`Task` (support and query sets and the control flow of its inner loop) and what the engine
returns for it (`TaskResult`; a meta-batch's `MetaBatch`) sit on the lowest floor, with the
foundations: the data sets (`metalearn.data`) build tasks and the engine (`metalearn.engine`)
runs them, and neither imports the other. `metalearn.engine` re-exports every name here
(``from metalearn.engine import Task``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "AllTasksSkippedError",
    "MetaBatch",
    "NonFiniteLossError",
    "StopRule",
    "Task",
    "TaskResult",
    "accuracy",
]

StopRule = Callable[[int, float], bool]
"""``stop(step, support_loss) -> bool``: stop before taking step ``step`` (0-based)."""


@dataclass
class Task:
    """One few-shot task: support and query sets and its own control flow.

    Attributes:
        support: ``(x [N_s, ...], y [N_s])``.
        query: ``(x [N_q, ...], y [N_q])``.
        steps: this task's number of inner steps (None: the meta-batch's default).
        model_kwargs: keyword arguments for the model's forward on this task (e.g.
            ``{"skip": True}`` for a `DynamicBlock` branch).
        stop: an early-stopping rule on this task's support loss (forces the loop path).
    """

    support: tuple[Tensor, Tensor]
    query: tuple[Tensor, Tensor]
    steps: int | None = None
    model_kwargs: Mapping[str, Any] = field(default_factory=dict)
    stop: StopRule | None = None

    def examples(self) -> int:
        """Support plus query examples: what a task adds to a vmapped chunk's tensors."""
        return self.support[0].shape[0] + self.query[0].shape[0]


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
