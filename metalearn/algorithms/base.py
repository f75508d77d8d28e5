"""`MetaLearner`: the model (theta), any learnable inner-loop state, and the meta-gradient.

Every algorithm is a small subclass. The training loop is the same for all of them::

    learner = MAML(model, inner_lr=0.4, inner_steps=1)
    opt = torch.optim.Adam(learner.parameters(), lr=1e-3)
    for tasks in sampler:
        opt.zero_grad()
        metrics = learner.backward(tasks)   # fills .grad of learner.parameters()
        opt.step()

``backward`` is the only method an algorithm must get right; MAML-style algorithms get it
from autograd through `meta_loss`, Reptile and iMAML compute it their own way.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metalearn.chunking import ChunkSize, meta_backward, plan_chunks
from metalearn.functional import accumulate_grad
from metalearn.inner import LearningRate, LossFn, adapt
from metalearn.outer import InnerLoop, MetaBatch, Task, Vectorize, meta_batch

__all__ = ["MetaLearner", "StepMetrics", "accumulate_grad", "check_loop_only"]


@dataclass
class StepMetrics:
    """What one meta-step reports (plain floats, ready for logging)."""

    loss: float
    """Mean query loss over the meta-batch (after adaptation)."""
    accuracy: float
    """Mean query accuracy (NaN for regression)."""
    skipped: int = 0
    """Tasks dropped for a non-finite loss."""
    vectorized: int = 0
    """Tasks that ran under vmap."""


class MetaLearner(nn.Module):
    """MAML (Finn et al., 2017): the base every algorithm in this package specialises.

    Args:
        model: the network; its parameters are theta. Called through ``functional_call``.
        inner_lr: inner-loop learning rate alpha (a float: fixed, not learned).
        inner_steps: inner gradient steps during meta-training.
        first_order: drop second-order terms (FOMAML).
        adapt_keys: names of the parameters adapted in the inner loop (None: all). ANIL
            passes the head's.
        loss_fn: ``loss_fn(outputs, targets) -> Tensor[]``.
        vectorize: ``"vmap"``, ``"loop"`` or ``"auto"``: how a meta-batch runs.
        checkpoint: recompute inner steps in the backward pass: memory grows by one copy
            of the fast weights per inner step instead of each step's activations (0.48x
            the plain loop's peak at 20 steps, for about 2x the time; docs/claims.md).
        on_nonfinite: ``"raise"`` or ``"skip"`` tasks whose loss is not finite.
        chunk_size: tasks per chunk of the meta-batch: each chunk's graph is built,
            differentiated and freed in turn (same meta-gradient, less memory; on a CPU
            also faster, see `metalearn.chunking`). ``"auto"`` (default) picks by workload,
            None runs the whole meta-batch as one graph.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        inner_lr: float = 0.4,
        inner_steps: int = 1,
        first_order: bool = False,
        adapt_keys: Collection[str] | None = None,
        loss_fn: LossFn = F.cross_entropy,
        vectorize: Vectorize = "auto",
        checkpoint: bool = False,
        on_nonfinite: Literal["raise", "skip"] = "raise",
        chunk_size: ChunkSize = "auto",
    ) -> None:
        super().__init__()
        if inner_steps < 0:
            raise ValueError(f"inner_steps must be >= 0, got {inner_steps}")
        self.model = model
        self.inner_lr = inner_lr
        self.inner_steps = inner_steps
        self.first_order = first_order
        self.adapt_keys = None if adapt_keys is None else list(adapt_keys)
        if self.adapt_keys is not None:
            names = dict(model.named_parameters())
            if missing := [k for k in self.adapt_keys if k not in names]:
                raise ValueError(
                    f"adapt_keys names parameters the model lacks: {missing}; "
                    f"the model has {list(names)[:8]}..."
                )
        self.loss_fn = loss_fn
        self.vectorize = vectorize
        self.checkpoint = checkpoint
        self.on_nonfinite = on_nonfinite
        self.chunk_size = chunk_size

    # ------------------------------------------------------------------ pieces to override

    def theta(self) -> dict[str, Tensor]:
        """The model's parameters as a dict (the tensors themselves: gradients reach them)."""
        return dict(self.model.named_parameters())

    def learning_rate(self) -> LearningRate:
        """The inner learning rate(s) in `metalearn.inner.LearningRate` form."""
        return self.inner_lr

    def inner_loop(self, steps: int | None = None, first_order: bool | None = None) -> InnerLoop:
        """The inner-loop settings for the current state (learnable rates included)."""
        return InnerLoop(
            steps=self.inner_steps if steps is None else steps,
            lr=self.learning_rate(),
            first_order=self.first_order if first_order is None else first_order,
            adapt_keys=self.adapt_keys,
            loss_fn=self.loss_fn,
            checkpoint=self.checkpoint,
        )

    def meta_loss(self, tasks: Sequence[Task]) -> MetaBatch:
        """Mean query loss after adaptation; differentiable w.r.t. ``self.parameters()``."""
        return meta_batch(
            self.model, self.theta(), tasks, self.inner_loop(),
            buffers=dict(self.model.named_buffers()), vectorize=self.vectorize,
            on_nonfinite=self.on_nonfinite,
        )  # fmt: skip

    def backward(self, tasks: Sequence[Task]) -> StepMetrics:
        """Accumulate the meta-gradient of a meta-batch into ``.grad`` (like loss.backward)."""
        chunks = self.chunks(tasks, self.inner_loop())
        if len(chunks) == 1:
            result = self.meta_loss(tasks)
            result.loss.backward()
        else:
            result = meta_backward(self.meta_loss, dict(self.named_parameters()), tasks, chunks)
        return _metrics(result)

    def chunks(self, tasks: Sequence[Task], inner: InnerLoop) -> list[range]:
        """How `backward` and `evaluate` split ``tasks`` (see `metalearn.chunking`)."""
        return plan_chunks(self.model, tasks, inner, self.vectorize, self.chunk_size)

    # ------------------------------------------------------------------ using a learner

    def adapt(self, task: Task, steps: int | None = None) -> dict[str, Tensor]:
        """Fast weights for one task, detached (for evaluation and deployment)."""
        inner = self.inner_loop(steps, first_order=True)
        with torch.no_grad():  # torch.func.grad inside adapt still differentiates
            return adapt(
                self.model, _detached(self.theta()), task.support, steps=inner.steps,
                lr=_detached(inner.lr), loss_fn=inner.loss_fn, first_order=True,
                adapt_keys=inner.adapt_keys, buffers=dict(self.model.named_buffers()),
                model_kwargs=task.model_kwargs,
            )  # fmt: skip

    def evaluate(self, tasks: Sequence[Task], steps: int | None = None) -> tuple[Tensor, Tensor]:
        """Query loss and accuracy per task after ``steps`` inner steps: ``([T], [T])``.

        No outer graph is built (evaluation never needs the meta-gradient), so this is the
        first-order inner loop, which gives the same adapted weights. Runs through
        `meta_batch`, so evaluation is vmapped exactly when training would be.
        """
        inner = self.inner_loop(steps, first_order=True)
        inner.lr = _detached(inner.lr)
        losses, accuracies = [], []
        with torch.no_grad():
            for chunk in self.chunks(tasks, inner):
                result = meta_batch(
                    self.model, _detached(self.theta()), [tasks[i] for i in chunk], inner,
                    buffers=dict(self.model.named_buffers()), vectorize=self.vectorize,
                )  # fmt: skip
                losses.append(result.task_losses)
                accuracies.append(result.task_accuracies)
        return torch.cat(losses), torch.cat(accuracies)


def _metrics(result: MetaBatch) -> StepMetrics:
    return StepMetrics(
        float(result.loss.detach()), float(result.accuracy), len(result.skipped), result.vectorized
    )


def _detached(tree: Mapping | Sequence | Tensor | float) -> Mapping | Sequence | Tensor | float:
    """Detach every tensor of a dict / list / tensor, keeping its structure."""
    if isinstance(tree, Tensor):
        return tree.detach()
    if isinstance(tree, Mapping):
        return {k: _detached(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_detached(v) for v in tree)
    return tree


def check_loop_only(learner: MetaLearner, name: str) -> None:
    """Raise if a learner that runs its tasks in a loop was asked for ``vectorize="vmap"``."""
    if learner.vectorize not in ("auto", "loop"):
        raise ValueError(
            f"{name} runs its tasks in a Python loop; vectorize={learner.vectorize!r} is not "
            "supported, pass vectorize='loop' or 'auto'"
        )
    if learner.checkpoint:
        raise ValueError(
            f"{name} keeps no graph through the inner loop, so checkpoint=True does nothing; "
            "drop it"
        )
