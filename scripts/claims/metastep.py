"""Claims 5 and 6: a MAML meta-step compiled, checkpointed, and both, over inner steps.

Workload: MAML's Omniglot Conv4 (stride 2, `MetaBatchNorm`, 112k parameters), 16 random
Omniglot-shaped tasks, 5-way 1-shot, 5 query per class (the default Omniglot run's meta-
batch), second order, inner lr 0.4, ``k`` inner steps. A meta-step is the meta-gradient
plus an Adam update. Methods, all from the same weights on the same tasks:

* ``loop``: `metalearn.algorithms.MAML(vectorize="loop")`, the eager per-task loop;
* ``loop+ckpt``: the same with ``checkpoint=True`` (each inner step recomputed in the
  backward pass; checkpointing needs the loop: ``torch.func.grad`` refuses its hooks);
* ``vmap``: ``MAML(vectorize="vmap")`` (what ``auto`` picks for this meta-batch);
* ``compiled vmap``: the same vmapped `task_loss` under ``torch.compile`` (inductor), as
  ``scripts/bench_maml.py``'s ``compile`` method, one graph for the whole meta-loss;
* ``compiled loop+ckpt``: claim 6's combination, the per-task `task_loss` with
  ``checkpoint=True`` under ``torch.compile``, called in a Python loop over the tasks.

Inputs are contiguous throughout (the sampler's are; claim 1 measures transposed ones).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from bench_maml import (
    INNER_LR,
    OUTER_LR,
    MetaStep,
    Setting,
    compiled_meta_gradient,
    make_model,
    make_tasks,
    max_relative_difference,
)
from torch import Tensor, nn

from metalearn.algorithms import MAML
from metalearn.outer import InnerLoop, Task, task_loss

__all__ = [
    "EAGER",
    "COMPILED",
    "Workload",
    "make_gradient",
    "make_step",
    "max_relative_difference",
    "meta_gradient",
]

EAGER = ("loop", "loop+ckpt", "vmap")
COMPILED = ("compiled vmap", "compiled loop+ckpt")
MetaGradient = Callable[[Sequence[Task]], None]
"""Fills ``.grad`` of the model's parameters with the meta-gradient of the tasks."""


@dataclass(frozen=True)
class Workload:
    """The meta-batch: tasks, query examples per class, inner steps."""

    steps: int
    tasks: int = 16
    query: int = 5
    hidden: int = 64

    def make_tasks(self, dtype: torch.dtype = torch.float32) -> list[Task]:
        """Random tasks; the same values in every dtype (drawn in float32, then cast)."""
        tasks = make_tasks(Setting(self.query, False), self.tasks, torch.float32, seed=0)
        return [
            Task((t.support[0].to(dtype), t.support[1]), (t.query[0].to(dtype), t.query[1]))
            for t in tasks
        ]

    def make_model(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        if self.hidden == 64:
            return make_model(dtype, seed=0)
        from metalearn.models import Conv4  # tiny nets for the smoke test

        torch.manual_seed(0)
        return Conv4(in_channels=1, ways=5, hidden=self.hidden).to(dtype)


def compiled_vmap(model: nn.Module, inner: InnerLoop) -> MetaGradient:
    """The vmapped meta-loss under ``torch.compile``: one graph, inner gradients included."""
    return compiled_meta_gradient(model, inner)


def compiled_loop(model: nn.Module, inner: InnerLoop) -> MetaGradient:
    """One task's `task_loss` under ``torch.compile``, looped over the tasks, one backward."""

    def one(params: dict[str, Tensor], xs: Tensor, ys: Tensor, xq: Tensor, yq: Tensor) -> Tensor:
        return task_loss(model, params, (xs, ys), (xq, yq), inner).loss

    compiled = torch.compile(one)

    def run(tasks: Sequence[Task]) -> None:
        params = dict(model.named_parameters())
        torch.stack([compiled(params, *t.support, *t.query) for t in tasks]).mean().backward()

    return run


def make_gradient(method: str, model: nn.Module, steps: int) -> MetaGradient:
    if method in EAGER:
        vectorize = "vmap" if method == "vmap" else "loop"
        learner = MAML(
            model, inner_lr=INNER_LR, inner_steps=steps, vectorize=vectorize,
            checkpoint=method.endswith("ckpt"),
        )  # fmt: skip
        return lambda tasks: learner.backward(tasks)
    if method == "compiled vmap":
        return compiled_vmap(model, InnerLoop(steps=steps, lr=INNER_LR))
    if method == "compiled loop+ckpt":
        return compiled_loop(model, InnerLoop(steps=steps, lr=INNER_LR, checkpoint=True))
    raise ValueError(f"unknown method {method!r}; choose from {EAGER + COMPILED}")


def make_step(method: str, work: Workload, dtype: torch.dtype = torch.float32) -> MetaStep:
    """A meta-step (meta-gradient, then Adam) on a fresh copy of the network."""
    model = work.make_model(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=OUTER_LR)
    return MetaStep(model, make_gradient(method, model, work.steps), opt)


def meta_gradient(step: MetaStep, tasks: Sequence[Task]) -> dict[str, Tensor]:
    """The meta-gradient the step's method computes at its current weights (no update)."""
    step.opt.zero_grad(set_to_none=True)
    step.gradient(tasks)
    return {n: p.grad.detach().clone() for n, p in step.model.named_parameters()}
