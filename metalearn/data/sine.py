"""MAML's sine-wave regression tasks (Finn et al., 2017, Sec. 5.1).

Each task is ``y = A sin(x - phi)`` with amplitude ``A ~ U[0.1, 5]``, phase
``phi ~ U[0, pi]`` and inputs ``x ~ U[-5, 5]``; support and query sets hold ``K`` points each
(MAML's data generator draws ``2K`` points and splits them). This is the sign convention of
MAML's code (``amp * np.sin(x - phase)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from metalearn.data.sampler import check_generator
from metalearn.task import Task

__all__ = ["SineTasks", "sine"]


def sine(x: Tensor, amplitude: float | Tensor, phase: float | Tensor) -> Tensor:
    """The task function ``amplitude * sin(x - phase)``, elementwise."""
    return amplitude * torch.sin(x - phase)


def _uniform(
    bounds: tuple[float, float], shape: tuple[int, ...], generator: torch.Generator
) -> Tensor:
    # Drawn in float64 whatever the task dtype, so float32 and float64 tasks agree.
    low, high = bounds
    return torch.rand(shape, generator=generator, dtype=torch.float64) * (high - low) + low


@dataclass(frozen=True)
class SineTasks:
    """A distribution over sine regression tasks.

    Attributes:
        shots: support points per task ``K``.
        queries: query points per task (None: ``shots``, as in MAML).
        amplitude: ``(low, high)`` of the uniform amplitude.
        phase: ``(low, high)`` of the uniform phase.
        inputs: ``(low, high)`` of the uniform inputs.
        dtype: dtype of the task tensors.
    """

    shots: int = 10
    queries: int | None = None
    amplitude: tuple[float, float] = (0.1, 5.0)
    phase: tuple[float, float] = (0.0, math.pi)
    inputs: tuple[float, float] = (-5.0, 5.0)
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.shots < 1 or (self.queries is not None and self.queries < 1):
            raise ValueError(f"shots and queries must be >= 1, got {self.shots}, {self.queries}")
        for name in ("amplitude", "phase", "inputs"):
            low, high = getattr(self, name)
            if not low <= high:
                raise ValueError(
                    f"{name}=({low}, {high}): the low end must not exceed the high end"
                )

    def sample_function(self, generator: torch.Generator) -> tuple[float, float]:
        """Draw ``(amplitude, phase)`` of one task."""
        check_generator(generator)
        amplitude = _uniform(self.amplitude, (), generator).item()
        return amplitude, _uniform(self.phase, (), generator).item()

    def task(self, amplitude: float, phase: float, generator: torch.Generator) -> Task:
        """A task of the given function: support ``x, y [K, 1]``, query ``[Q, 1]``."""
        check_generator(generator)
        queries = self.shots if self.queries is None else self.queries
        x = _uniform(self.inputs, (self.shots + queries, 1), generator)
        y = sine(x, amplitude, phase)
        x, y = x.to(self.dtype), y.to(self.dtype)
        k = self.shots
        return Task(support=(x[:k], y[:k]), query=(x[k:], y[k:]))

    def sample(self, generator: torch.Generator) -> Task:
        """One task with a freshly drawn amplitude and phase."""
        return self.task(*self.sample_function(generator), generator)

    def batch(self, tasks: int, generator: torch.Generator) -> list[Task]:
        """``tasks`` tasks, the same as that many `sample` calls with this generator."""
        if tasks < 1:
            raise ValueError(f"tasks must be >= 1, got {tasks}")
        return [self.sample(generator) for _ in range(tasks)]
