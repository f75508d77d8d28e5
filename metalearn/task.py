"""A few-shot task: support and query sets and the control flow of its inner loop.

`Task` sits on the lowest floor, with the foundations: the data sets (`metalearn.data`)
build tasks and the engine (`metalearn.engine`) runs them, and neither imports the other.
`metalearn.engine` re-exports it (``from metalearn.engine import Task``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

__all__ = ["StopRule", "Task"]

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
