"""Reptile (Nichol, Achiam & Schulman, 2018, "On First-Order Meta-Learning Algorithms").

Per task, train a copy of theta with k steps of gradient descent on the task's training
data, giving phi_i; then move theta toward the adapted weights. The batched update of the
paper's Algorithm 2 is::

    theta <- theta + epsilon * mean_i (phi_i - theta)

`Reptile.backward` writes ``mean_i (theta - phi_i)`` into ``.grad``, so that
``torch.optim.SGD(lr=epsilon).step()`` is exactly that update (`Reptile.outer_optimizer`);
any other optimiser (the paper mentions Adam) takes the Reptile direction as its gradient.
The paper's Omniglot and Mini-ImageNet runs (Sec. 6 and Appendix A) start at epsilon = 1.0
and anneal it linearly to 0 over training (`Reptile.outer_lr_factor`).
No graph to theta is built: the inner loop is first order by construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

from metalearn.algorithms.base import (
    InnerStart,
    MetaLearner,
    StepMetrics,
    accumulate_grad,
    check_loop_only,
    support_start,
)
from metalearn.engine import AllTasksSkippedError, NonFiniteLossError, Task, accuracy, adapt
from metalearn.functional import detached

__all__ = ["Reptile"]


class Reptile(MetaLearner):
    """Reptile: theta moves toward each task's SGD-adapted weights.

    The inner loop trains on the task's *training* data, as in the paper (Alg. 1-2): the
    support set by default, so the reported query loss and accuracy are held-out numbers
    after adaptation (what Reptile is evaluated on). ``train_on_query=True`` trains on support
    and query together (more data per task); the reported query metrics are then training
    metrics.

    The inner loop is full-batch gradient descent with ``inner_lr`` for ``inner_steps`` steps
    (per-task ``Task.steps`` and ``Task.stop`` apply). Tasks run in a Python loop.

    Args:
        model: the network; its parameters are theta.
        inner_lr: inner learning rate alpha.
        inner_steps: k, the inner gradient steps per task. With k = 1 the Reptile direction
            is ``alpha * grad L_train(theta)``: SGD on the expected loss (joint training),
            as the paper notes; meta-learning needs k > 1.
        train_on_query: train the inner loop on support + query (concatenated along dim 0)
            instead of the support set only.
        anneal: anneal the outer step size linearly to 0 over training (the paper's runs);
            False keeps it constant.
        **kwargs: as for `MetaLearner` (``adapt_keys``, ``loss_fn``, ``on_nonfinite``).
            ``vectorize`` must be ``"auto"`` or ``"loop"``.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        inner_lr: float = 0.4,
        inner_steps: int = 5,
        train_on_query: bool = False,
        anneal: bool = True,
        **kwargs: Any,
    ) -> None:
        if kwargs.pop("first_order", True) is not True:
            raise ValueError(
                "Reptile is first order by definition (no graph through the inner loop); "
                "drop first_order=False, or use MAML for second-order meta-gradients"
            )
        super().__init__(
            model, inner_lr=inner_lr, inner_steps=inner_steps, first_order=True, **kwargs
        )
        check_loop_only(self, "Reptile")
        self.train_on_query = train_on_query
        self.anneal = anneal

    fixed_arguments = ("first_order",)
    default_outer_lr = 1.0  # the paper's initial outer step size epsilon (Appendix A)
    default_outer_optimizer = "sgd"  # plain SGD: exactly Alg. 2's update

    def outer_optimizer(self, lr: float | None = None) -> torch.optim.Optimizer:
        """Plain SGD with step epsilon (None: 1.0): exactly Alg. 2's update on `backward`'s
        ``.grad``."""
        return torch.optim.SGD(self.parameters(), lr=self.default_outer_lr if lr is None else lr)

    def outer_lr_factor(self, step: int, total: int) -> float:
        """``1 - step / total`` (epsilon annealed linearly to 0, as in the paper's runs), or
        1.0 without ``anneal``."""
        return 1.0 - step / total if self.anneal else 1.0

    def backward(self, tasks: Sequence[Task]) -> StepMetrics:
        """Accumulate ``mean_i (theta - phi_i)`` into ``.grad`` of theta.

        Args:
            tasks: the meta-batch (T tasks).

        Returns:
            `StepMetrics` with the mean query loss and accuracy of the adapted weights.
        """
        if not tasks:
            raise ValueError("the meta-batch is empty; pass at least one Task")
        theta = self.theta()
        start = detached(theta)
        directions, losses, accs, skipped = [], [], [], 0
        for i, task in enumerate(tasks):
            try:
                fast, loss, acc = self._adapt_task(start, task, i)
            except NonFiniteLossError:
                if self.on_nonfinite == "raise":
                    raise
                skipped += 1
                continue
            # Alg. 2: the direction is theta - phi_i, so a descent step moves toward phi_i.
            directions.append({k: start[k] - fast[k] for k in start})
            losses.append(loss)
            accs.append(acc)
        if not directions:
            raise AllTasksSkippedError(len(tasks))
        mean = {k: torch.stack([d[k] for d in directions]).mean(0) for k in start}
        accumulate_grad(theta, mean)
        return StepMetrics(
            float(torch.stack(losses).mean()), float(torch.stack(accs).mean()), skipped, 0
        )

    def inner_start(self, task: Task) -> InnerStart:
        """The loss at theta on the data the inner loop trains on (support, plus the query
        with ``train_on_query``)."""
        return support_start(self, self.start_of(task), self._train_data(task), task)

    def _train_data(self, task: Task) -> tuple[Tensor, Tensor]:
        """The task's training data: the support set, or support + query (dim 0)."""
        if not self.train_on_query:
            return task.support
        return (torch.cat([task.support[0], task.query[0]]),
                torch.cat([task.support[1], task.query[1]]))  # fmt: skip

    def _adapt_task(
        self, theta: dict[str, Tensor], task: Task, index: int
    ) -> tuple[dict[str, Tensor], Tensor, Tensor]:
        """phi_i, and the query loss and accuracy at phi_i (all without a graph)."""
        data = self._train_data(task)
        buffers = dict(self.model.named_buffers())
        with torch.no_grad():  # torch.func.grad inside adapt still differentiates
            fast = adapt(
                self.model, theta, data,
                steps=self.inner_steps if task.steps is None else task.steps,
                lr=detached(self.learning_rate()), loss_fn=self.loss_fn, first_order=True,
                adapt_keys=self.adapt_keys, buffers=buffers, model_kwargs=task.model_kwargs,
                stop=task.stop, check_finite=True, task_index=index,
            )  # fmt: skip
            out = functional_call(self.model, {**buffers, **fast}, (task.query[0],),
                                  dict(task.model_kwargs))  # fmt: skip
            loss = self.loss_fn(out, task.query[1])
        if not torch.isfinite(loss):
            raise NonFiniteLossError("query", index, None, float(loss))
        return fast, loss, accuracy(out, task.query[1])
