"""The outer loop: one task's meta-loss, written once, run over a meta-batch.

`task_loss` adapts theta on a task's support set and returns the query loss of the adapted
weights (MAML's outer objective, Finn et al., 2017, Eq. 2, for one task). `meta_batch`
runs it over many tasks either

* under ``torch.func.vmap``, when the tasks' control flow does not depend on data and their
  shapes agree (tasks are bucketed by shape, each bucket one vmap call), or
* in a Python loop, which allows anything: per-task step counts, early stopping, per-task
  branches, checkpointing, and the finite-loss guard at every inner step.

Both paths call the same `task_loss`; ``tests/test_outer.py`` asserts they agree.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vmap

from metalearn.inner import (
    LearningRate,
    LossFn,
    NonFiniteLossError,
    Regularizer,
    StopRule,
    adapt_with_losses,
)
from metalearn.models import fused_norm

__all__ = [
    "InnerLoop",
    "MetaBatch",
    "Task",
    "TaskResult",
    "AllTasksSkippedError",
    "choose_vectorize",
    "meta_batch",
    "task_loss",
    "vmap_blockers",
]

Vectorize = Literal["vmap", "loop", "auto"]
TaskFn = Callable[..., "TaskResult"]
"""A per-task meta-loss with `task_loss`'s signature (MAML++'s multi-step loss is one)."""


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


@dataclass
class InnerLoop:
    """Inner-loop settings shared by the tasks of a meta-batch (see `metalearn.adapt`)."""

    steps: int = 1
    lr: LearningRate = 0.4
    first_order: bool = False
    adapt_keys: Collection[str] | None = None
    loss_fn: LossFn = F.cross_entropy
    checkpoint: bool = False


class TaskResult(NamedTuple):
    """What one task contributes to a meta-batch."""

    loss: Tensor
    """Query loss of the adapted weights, ``Tensor[]`` (differentiable w.r.t. theta)."""
    accuracy: Tensor
    """Query accuracy (argmax of outputs == targets), ``Tensor[]``; NaN for regression."""
    support_losses: Tensor
    """Support loss before each inner step taken, ``Tensor[steps_taken]``."""


def task_loss(
    model: nn.Module,
    params: Mapping[str, Tensor],
    support: tuple[Tensor, Tensor],
    query: tuple[Tensor, Tensor],
    inner: InnerLoop,
    *,
    buffers: Mapping[str, Tensor] | None = None,
    steps: int | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    stop: StopRule | None = None,
    regularizer: Regularizer | None = None,
    check_finite: bool = False,
    task_index: int | None = None,
) -> TaskResult:
    """The meta-loss of one task: adapt on ``support``, evaluate on ``query``.

    Args:
        model: the network (called through ``functional_call``).
        params: theta, name -> tensor.
        support: ``(x [N_s, ...], y [N_s])``.
        query: ``(x [N_q, ...], y [N_q])``.
        inner: the inner-loop settings.
        buffers: non-adapted tensors for ``functional_call``.
        steps: overrides ``inner.steps`` for this task.
        model_kwargs: forward keyword arguments for this task.
        stop: early-stopping rule (loop path only).
        regularizer: added to the support loss (iMAML's proximal term).
        check_finite: raise on a non-finite support or query loss (loop path only).
        task_index: for error messages.

    Returns:
        A `TaskResult` (query loss, query accuracy, support losses).
    """
    fast, support_losses = adapt_with_losses(
        model,
        params,
        support,
        steps=inner.steps if steps is None else steps,
        lr=inner.lr,
        loss_fn=inner.loss_fn,
        first_order=inner.first_order,
        adapt_keys=inner.adapt_keys,
        buffers=buffers,
        model_kwargs=model_kwargs,
        regularizer=regularizer,
        stop=stop,
        checkpoint=inner.checkpoint,
        check_finite=check_finite,
        task_index=task_index,
    )
    xq, yq = query
    out = functional_call(model, {**(buffers or {}), **fast}, (xq,), dict(model_kwargs or {}))
    loss = inner.loss_fn(out, yq)
    if check_finite and not torch.isfinite(loss):
        raise NonFiniteLossError("query", task_index, None, float(loss))
    return TaskResult(loss, _accuracy(out, yq), support_losses)


def _accuracy(out: Tensor, y: Tensor) -> Tensor:
    if out.dim() == y.dim() + 1 and not y.is_floating_point():
        return (out.argmax(-1) == y).float().mean()
    return torch.full((), float("nan"), device=out.device)


class MetaBatch(NamedTuple):
    """A meta-batch's results; ``loss`` is what the outer optimiser differentiates."""

    loss: Tensor
    """Mean query loss over the kept tasks, ``Tensor[]``."""
    accuracy: Tensor
    """Mean query accuracy over the kept tasks, ``Tensor[]``."""
    task_losses: Tensor
    """Per-task query losses, ``Tensor[T]`` in task order (skipped tasks included)."""
    task_accuracies: Tensor
    """Per-task query accuracies, ``Tensor[T]`` (NaN for skipped tasks and regression)."""
    skipped: list[int]
    """Indices of tasks dropped for a non-finite loss (``on_nonfinite="skip"``)."""
    vectorized: int
    """How many tasks ran under vmap (the rest ran in the loop)."""


# Measured on 2 CPU cores, conv4, 5-way 1-shot (scripts/bench_maml.py and the Omniglot run):
# what matters is the batched tensors' size, i.e. the meta-batch's examples in all. vmap beats
# the loop at 32 tasks x 10 examples (2.3-2.9x), 16 x 30 (1.35x) and 32 x 20 (1.2x), and
# loses at 32 x 30 (1.24x) and 32 x 80 (1.5-2x), where its [tasks, batch, 64, 14, 14]
# activations outgrow the cache. On a GPU the loop is launch-bound, so vmap should pay off
# much further; the CUDA limit is a guess until measured.
AUTO_VMAP_MAX_EXAMPLES = {"cpu": 800, "cuda": 65536}


def choose_vectorize(
    model: nn.Module, tasks: Sequence[Task], inner: InnerLoop, vectorize: Vectorize
) -> Literal["vmap", "loop"]:
    """Decide how to run a meta-batch; raise if ``"vmap"`` is asked for and cannot be right.

    The ``"auto"`` rule: the loop when any task needs data-dependent control flow (an early
    stop rule), when checkpointing is on, when the model holds a fused batch-norm or affine
    layer-norm module (its vmapped second derivative is wrong), or when the meta-batch holds
    more examples in all (support + query, summed over tasks) than `AUTO_VMAP_MAX_EXAMPLES`
    for the device; vmap otherwise. `MetaLearner` first splits a meta-batch into chunks
    (`metalearn.chunking.plan_chunks`), each well under that limit.
    """
    if vectorize not in ("vmap", "loop", "auto"):
        raise ValueError(f"vectorize must be 'vmap', 'loop' or 'auto', got {vectorize!r}")
    if vectorize == "loop":
        return "loop"
    blockers = vmap_blockers(model, tasks, inner)
    if vectorize == "vmap":
        if blockers:
            raise ValueError(f"vectorize='vmap' cannot run this meta-batch: {'; '.join(blockers)}")
        return "vmap"
    if blockers or len(tasks) < 2:
        return "loop"
    x = tasks[0].support[0]
    limit = AUTO_VMAP_MAX_EXAMPLES.get(x.device.type, AUTO_VMAP_MAX_EXAMPLES["cpu"])
    total = sum(t.support[0].shape[0] + t.query[0].shape[0] for t in tasks)
    return "vmap" if total <= limit else "loop"


def vmap_blockers(model: nn.Module, tasks: Sequence[Task], inner: InnerLoop) -> list[str]:
    """Why a meta-batch cannot run under vmap (empty when it can), one reason per entry."""
    blockers = []
    if any(t.stop is not None for t in tasks):
        blockers.append("a task has an early-stopping rule (data-dependent control flow)")
    if inner.checkpoint:
        blockers.append("checkpoint=True (torch.func.grad refuses checkpointing's hooks)")
    fused = [n for n, m in model.named_modules() if _fused_norm(m)]
    if fused and not inner.first_order:
        blockers.append(
            f"the model has fused batch/layer-norm modules {fused[:3]}, whose second "
            "derivative is wrong under vmap (torch 2.13); use metalearn.models.MetaBatchNorm, "
            "a layer norm written from mean/var, or vectorize='loop'"
        )
    return blockers


def _fused_norm(module: nn.Module) -> bool:
    # Measured (torch 2.13 CPU, float64): under vmap, the outer derivative through the inner
    # gradient of the norm's weight, w.r.t. a weight upstream of the norm, is wrong for
    # F.batch_norm and F.layer_norm (off by O(1)); F.group_norm and F.rms_norm agree.
    if isinstance(module, nn.modules.batchnorm._NormBase):
        return True
    return isinstance(module, nn.LayerNorm) and module.weight is not None


def meta_batch(
    model: nn.Module,
    params: Mapping[str, Tensor],
    tasks: Sequence[Task],
    inner: InnerLoop,
    *,
    buffers: Mapping[str, Tensor] | None = None,
    vectorize: Vectorize = "auto",
    on_nonfinite: Literal["raise", "skip"] = "raise",
    regularizer: Callable[[Mapping[str, Tensor]], Tensor] | None = None,
    task_fn: TaskFn = task_loss,
) -> MetaBatch:
    """Mean query loss of a meta-batch of tasks, each adapted from the same ``params``.

    Args:
        model: the network.
        params: theta, name -> tensor (differentiate ``result.loss`` with respect to them).
        tasks: the meta-batch (T tasks; shapes, steps and branches may differ).
        inner: inner-loop settings.
        buffers: non-adapted tensors for ``functional_call``.
        vectorize: ``"vmap"``, ``"loop"`` or ``"auto"`` (see `choose_vectorize`).
        on_nonfinite: ``"raise"`` a `NonFiniteLossError` naming the task and inner step, or
            ``"skip"`` such tasks (listed in ``result.skipped``).
        regularizer: added to every task's support loss.
        task_fn: the meta-loss of one task, called with `task_loss`'s arguments on both
            paths (default `task_loss`; MAML++ passes its multi-step loss).

    Returns:
        A `MetaBatch`.
    """
    if not tasks:
        raise ValueError("the meta-batch is empty; pass at least one Task")
    if on_nonfinite not in ("raise", "skip"):
        raise ValueError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}")
    mode = choose_vectorize(model, tasks, inner, vectorize)
    common = dict(buffers=buffers, regularizer=regularizer)
    results: list[TaskResult | None] = [None] * len(tasks)
    vectorized = 0
    skipped: list[int] = []
    if mode == "vmap":
        for indices in _buckets(tasks, inner).values():
            if len(indices) == 1:
                continue  # a bucket of one runs in the loop below, same function
            bucket = _run_bucket(model, params, tasks, indices, inner, common, task_fn)
            errors = [e for i, r in zip(indices, bucket) if (e := _nonfinite(r, i)) is not None]
            if errors:
                if on_nonfinite == "raise":
                    raise errors[0]
                # The bucket shares one backward, where a dropped task's 0 * NaN would poison
                # the others' meta-gradient: its finite tasks rerun in the loop below.
                skipped += [e.task_index for e in errors]
                continue
            for i, r in zip(indices, bucket):
                results[i] = r
            vectorized += len(indices)
    for i, task in enumerate(tasks):
        if results[i] is None and i not in skipped:
            try:
                # No transform runs here, so batch norm may take the fused kernel (faster);
                # not under checkpointing, whose recomputation must replay the same ops.
                with fused_norm(not inner.checkpoint):
                    results[i] = task_fn(
                        model, params, task.support, task.query, inner,
                        steps=task.steps, model_kwargs=task.model_kwargs, stop=task.stop,
                        check_finite=True, task_index=i, **common,
                    )  # fmt: skip
            except NonFiniteLossError:
                if on_nonfinite == "raise":
                    raise
                skipped.append(i)
    return _combine(results, sorted(skipped), vectorized, params)


def _buckets(tasks: Sequence[Task], inner: InnerLoop) -> dict[Hashable, list[int]]:
    """Group tasks whose vmapped computation is identical up to the data."""
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, t in enumerate(tasks):
        key = (
            tuple(t.support[0].shape), tuple(t.support[1].shape),
            tuple(t.query[0].shape), tuple(t.query[1].shape),
            inner.steps if t.steps is None else t.steps,
            tuple(sorted((k, _kwarg_key(v)) for k, v in t.model_kwargs.items())),
        )  # fmt: skip
        groups[key].append(i)
    return groups


def _kwarg_key(value: Any) -> Hashable:
    """A forward kwarg's part of the bucket key; a bucket runs with its first task's kwargs.

    Tensors count by identity: their repr rounds to 4 digits and elides large tensors, so
    two different tensors could share a bucket and one task would run with the other's.
    """
    if isinstance(value, Tensor):
        return ("tensor", id(value))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *map(_kwarg_key, value))
    return repr(value)


def _run_bucket(
    model: nn.Module,
    params: Mapping[str, Tensor],
    tasks: Sequence[Task],
    indices: list[int],
    inner: InnerLoop,
    common: dict[str, Any],
    task_fn: TaskFn = task_loss,
) -> list[TaskResult]:
    first = tasks[indices[0]]

    def one(xs: Tensor, ys: Tensor, xq: Tensor, yq: Tensor) -> TaskResult:
        return task_fn(
            model, params, (xs, ys), (xq, yq), inner,
            steps=first.steps, model_kwargs=first.model_kwargs, **common,
        )  # fmt: skip

    parts = [(*tasks[i].support, *tasks[i].query) for i in indices]
    stacked = [torch.stack(column) for column in zip(*parts)]
    batched = vmap(one, randomness="different")(*stacked)
    return [TaskResult(*(field[n] for field in batched)) for n in range(len(indices))]


def _nonfinite(result: TaskResult, index: int) -> NonFiniteLossError | None:
    support_losses, loss = result.support_losses.detach(), result.loss.detach()
    bad = (~torch.isfinite(support_losses)).nonzero()
    if len(bad):
        step = int(bad[0, 0])
        return NonFiniteLossError("support", index, step, float(support_losses[step]))
    if not torch.isfinite(loss):
        return NonFiniteLossError("query", index, None, float(loss))
    return None


class AllTasksSkippedError(FloatingPointError):
    """Every task of a meta-batch had a non-finite loss (``on_nonfinite="skip"``)."""

    def __init__(self, n_tasks: int) -> None:
        self.n_tasks = n_tasks
        super().__init__(
            f"all {n_tasks} tasks of the meta-batch had non-finite losses; lower the inner "
            "learning rate or check the data for NaNs"
        )


def _combine(
    results: list[TaskResult | None],
    skipped: list[int],
    vectorized: int,
    params: Mapping[str, Tensor],
) -> MetaBatch:
    kept = [r for i, r in enumerate(results) if i not in skipped and r is not None]
    nan = torch.full((), float("nan"), device=next(iter(params.values())).device)
    task_losses = torch.stack([r.loss.detach() if r is not None else nan for r in results])
    task_accuracies = torch.stack([r.accuracy.detach() if r is not None else nan for r in results])
    if not kept:
        raise AllTasksSkippedError(len(results))
    loss = torch.stack([r.loss for r in kept]).mean()
    accuracy = torch.stack([r.accuracy for r in kept]).mean().detach()
    return MetaBatch(loss, accuracy, task_losses, task_accuracies, skipped, vectorized)
