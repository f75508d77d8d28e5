"""The outer loop: one task's meta-loss, written once, run over a meta-batch.

`task_loss` adapts theta on a task's support set and returns the query loss of the adapted
weights (MAML's outer objective, Finn et al., 2017, Eq. 2, for one task). `run_meta_batch`
runs it over many tasks in the mode it is given (`metalearn.engine.plan` decides it):

* ``"vmap"``: under ``torch.func.vmap``, tasks bucketed by shape, each bucket one vmap call;
* ``"loop"``: a Python loop, which allows anything: per-task step counts, early stopping,
  per-task branches, checkpointing, and the finite-loss guard at every inner step.

Both modes call the same `task_loss`; ``tests/test_outer.py`` asserts they agree.
`meta_batch` plans its tasks as one chunk and runs them.

"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from metalearn.engine.inner import InnerLoop, Regularizer, run_inner_loop
from metalearn.engine.plan import Mode, Vectorize, plan
from metalearn.engine.task import (
    AllTasksSkippedError,
    MetaBatch,
    NonFiniteLossError,
    StopRule,
    Task,
    TaskResult,
    accuracy,
)

__all__ = [
    "OnNonfinite",
    "TaskFn",
    "meta_batch",
    "run_meta_batch",
    "task_loss",
]

OnNonfinite = Literal["raise", "skip"]
TaskFn = Callable[..., TaskResult]
"""A per-task meta-loss with `task_loss`'s signature (MAML++'s multi-step loss is one)."""


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
        task_index: the task's place in the meta-batch, for error messages.

    Returns:
        A `TaskResult` (query loss, query accuracy, support losses).
    """
    if steps is not None:
        inner = replace(inner, steps=steps)
    fast, support_losses = run_inner_loop(
        model, params, support, inner, buffers=buffers, model_kwargs=model_kwargs,
        regularizer=regularizer, stop=stop, check_finite=check_finite, task_index=task_index,
    )  # fmt: skip
    xq, yq = query
    out = functional_call(model, {**(buffers or {}), **fast}, (xq,), dict(model_kwargs or {}))
    loss = inner.loss_fn(out, yq)
    if check_finite and not torch.isfinite(loss):
        raise NonFiniteLossError("query", task_index, None, float(loss))
    return TaskResult(loss, accuracy(out, yq), support_losses)


def meta_batch(
    model: nn.Module,
    params: Mapping[str, Tensor],
    tasks: Sequence[Task],
    inner: InnerLoop,
    *,
    buffers: Mapping[str, Tensor] | None = None,
    vectorize: Vectorize = "auto",
    on_nonfinite: OnNonfinite = "raise",
    regularizer: Regularizer | None = None,
    task_fn: TaskFn = task_loss,
) -> MetaBatch:
    """Mean query loss of a meta-batch of tasks, each adapted from the same ``params``.

    The tasks run as one chunk, in the mode `metalearn.engine.plan.plan` gives it (``vectorize``
    ``"vmap"`` that cannot be right raises there).

    Args:
        model: the network.
        params: theta, name -> tensor (differentiate ``result.loss`` with respect to them).
        tasks: the meta-batch (T tasks; shapes, steps and branches may differ).
        inner: inner-loop settings.
        buffers: non-adapted tensors for ``functional_call``.
        vectorize: ``"vmap"``, ``"loop"`` or ``"auto"``.
        on_nonfinite: ``"raise"`` a `NonFiniteLossError` naming the task and inner step, or
            ``"skip"`` such tasks (listed in ``result.skipped``).
        regularizer: added to every task's support loss.
        task_fn: the meta-loss of one task, called with `task_loss`'s arguments in both
            modes (default `task_loss`; MAML++ passes its multi-step loss).

    Returns:
        A `MetaBatch`.
    """
    (chunk,) = plan(model, tasks, inner, vectorize, chunk_size=None)
    return run_meta_batch(
        model, params, tasks, inner, chunk.mode, buffers=buffers, on_nonfinite=on_nonfinite,
        regularizer=regularizer, task_fn=task_fn,
    )  # fmt: skip


def run_meta_batch(
    model: nn.Module,
    params: Mapping[str, Tensor],
    tasks: Sequence[Task],
    inner: InnerLoop,
    mode: Mode,
    *,
    buffers: Mapping[str, Tensor] | None = None,
    on_nonfinite: OnNonfinite = "raise",
    regularizer: Regularizer | None = None,
    task_fn: TaskFn = task_loss,
    first_index: int = 0,
) -> MetaBatch:
    """`meta_batch` in a mode already decided (a chunk of a `metalearn.engine.plan.plan`).

    Args:
        model, params, tasks, inner, buffers, on_nonfinite, regularizer, task_fn: as for
            `meta_batch`.
        mode: ``"vmap"`` or ``"loop"``; not checked against `metalearn.engine.plan.vmap_blockers`
            (the planner did that).
        first_index: the meta-batch index of ``tasks[0]``, so that errors name a task's place
            in the whole meta-batch when ``tasks`` is one of its chunks.

    Returns:
        A `MetaBatch` of ``tasks`` (``skipped`` counts positions in ``tasks``).
    """
    if not tasks:
        raise ValueError("the meta-batch is empty; pass at least one Task")
    if on_nonfinite not in ("raise", "skip"):
        raise ValueError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}")
    common = dict(buffers=buffers, regularizer=regularizer)
    results: list[TaskResult | None] = [None] * len(tasks)
    skipped: set[int] = set()
    vectorized = 0
    if mode == "vmap":
        for indices in _buckets(tasks, inner).values():
            if len(indices) == 1:
                continue  # a bucket of one runs in the loop below, same function
            bucket = _run_bucket(model, params, tasks, indices, inner, common, task_fn)
            bad = [(i, e) for i, r in zip(indices, bucket)
                   if (e := _nonfinite(r, first_index + i)) is not None]  # fmt: skip
            if bad and on_nonfinite == "raise":
                raise bad[0][1]
            if bad:
                # The bucket shares one backward, where a dropped task's 0 * NaN would poison
                # the others' meta-gradient: its finite tasks rerun in the loop below.
                skipped.update(i for i, _ in bad)
                continue
            for i, r in zip(indices, bucket):
                results[i] = r
            vectorized += len(indices)
    for i, task in enumerate(tasks):
        if results[i] is not None or i in skipped:
            continue
        try:
            results[i] = task_fn(
                model, params, task.support, task.query, inner,
                steps=task.steps, model_kwargs=task.model_kwargs, stop=task.stop,
                check_finite=True, task_index=first_index + i, **common,
            )  # fmt: skip
        except NonFiniteLossError:
            if on_nonfinite == "raise":
                raise
            skipped.add(i)
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
    task_fn: TaskFn,
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


def _combine(
    results: list[TaskResult | None],
    skipped: list[int],
    vectorized: int,
    params: Mapping[str, Tensor],
) -> MetaBatch:
    kept = [r for r in results if r is not None]
    nan = torch.full((), float("nan"), device=next(iter(params.values())).device)
    task_losses = torch.stack([r.loss.detach() if r is not None else nan for r in results])
    task_accuracies = torch.stack([r.accuracy.detach() if r is not None else nan for r in results])
    if not kept:
        raise AllTasksSkippedError(len(results))
    loss = torch.stack([r.loss for r in kept]).mean()
    accuracy_ = torch.stack([r.accuracy for r in kept]).mean().detach()
    return MetaBatch(loss, accuracy_, task_losses, task_accuracies, skipped, vectorized)
