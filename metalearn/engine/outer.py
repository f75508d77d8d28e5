"""The outer loop: one task's meta-loss, written once, run over a meta-batch.

`task_loss` adapts theta on a task's support set and returns the query loss of the adapted
weights (MAML's outer objective, Finn et al., 2017, Eq. 2, for one task). Every per-task
meta-loss (a `TaskFn`) takes the model, theta and one `TaskCall`, the record of what else it
needs. `run_meta_batch` runs it over one chunk of tasks (a `ChunkCall`: the tasks, the mode
`metalearn.engine.plan` decided and the settings they share):

* ``"vmap"``: under ``torch.func.vmap``, tasks bucketed by `vmap_buckets`, each bucket one
  vmap call (`vmapped_task_results`);
* ``"loop"``: a Python loop, which allows anything: per-task step counts, early stopping,
  per-task branches, checkpointing, and the finite-loss guard at every inner step.

Both modes call the same `task_loss`; ``tests/engine/test_outer.py`` asserts they agree.
`meta_batch` plans its tasks as one chunk and runs them. `run_meta_batch` is also the default
`ChunkRunner`, what `MetaLossLearner.backward` hands each chunk of its plan to
(`metalearn.engine.compiled.CompiledChunkRunner` is the compiled one).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from metalearn.attention import attention_kernel
from metalearn.engine.inner import InnerLoop, Regularizer, run_inner_loop
from metalearn.engine.plan import Mode, Vectorize, plan
from metalearn.normalisation import Normalisation
from metalearn.task import (
    AllTasksSkippedError,
    MetaBatch,
    NonFiniteLossError,
    StopRule,
    Task,
    TaskResult,
    accuracy,
)

__all__ = [
    "ChunkCall",
    "ChunkRunner",
    "OnNonfinite",
    "QueryFn",
    "StartFn",
    "TaskCall",
    "TaskFn",
    "meta_batch",
    "query_outputs",
    "run_meta_batch",
    "stack_tasks",
    "task_loss",
    "vmap_buckets",
    "vmapped_task_results",
]

OnNonfinite = Literal["raise", "skip"]


@dataclass(frozen=True, eq=False)
class TaskCall:
    """What a per-task meta-loss (`TaskFn`) is given besides the model and theta.

    `run_meta_batch` builds one per task (`TaskCall.of`) in the loop, and one per vmapped
    function call from a task's slices of a bucket's stacked tensors.

    Attributes:
        support: ``(x [N_s, ...], y [N_s])``.
        query: ``(x [N_q, ...], y [N_q])``.
        inner: the inner-loop settings.
        buffers: non-adapted tensors for ``functional_call`` (None: none).
        steps: overrides ``inner.steps`` for this task (None: ``inner.steps``).
        model_kwargs: forward keyword arguments for this task (None: none).
        stop: early-stopping rule (loop path only).
        regularizer: added to the support loss (iMAML's proximal term).
        check_finite: raise on a non-finite support or query loss (loop path only).
        task_index: the task's place in the meta-batch, for error messages.
    """

    support: tuple[Tensor, Tensor]
    query: tuple[Tensor, Tensor]
    inner: InnerLoop
    buffers: Mapping[str, Tensor] | None = None
    steps: int | None = None
    model_kwargs: Mapping[str, Any] | None = None
    stop: StopRule | None = None
    regularizer: Regularizer | None = None
    check_finite: bool = False
    task_index: int | None = None

    @classmethod
    def of(
        cls,
        task: Task,
        inner: InnerLoop,
        *,
        buffers: Mapping[str, Tensor] | None = None,
        regularizer: Regularizer | None = None,
        check_finite: bool = False,
        task_index: int | None = None,
    ) -> TaskCall:
        """The call of ``task``: its sets, step count, forward kwargs and stop rule, with
        the settings given here."""
        return cls(
            task.support, task.query, inner, buffers=buffers, steps=task.steps,
            model_kwargs=task.model_kwargs, stop=task.stop, regularizer=regularizer,
            check_finite=check_finite, task_index=task_index,
        )  # fmt: skip


class TaskFn(Protocol):
    """A per-task meta-loss: `task_loss`, or a relative such as MAML++'s
    `metalearn.algorithms.mamlpp.multi_step_task_loss` with its own settings bound by
    ``functools.partial``. The same function runs in the loop and under vmap."""

    def __call__(
        self, model: nn.Module, params: Mapping[str, Tensor], call: TaskCall, /
    ) -> TaskResult:
        """The task's `TaskResult` from theta ``params`` (name -> tensor)."""
        ...


class StartFn(Protocol):
    """Where a task's inner loop starts: phi_0 from theta and the task, differentiable in
    theta (Proto-MAML's prototype head; `metalearn.algorithms.base.MetaLearner.start`)."""

    def __call__(
        self, model: nn.Module, params: Mapping[str, Tensor], call: TaskCall, /
    ) -> Mapping[str, Tensor]:
        """phi_0, name -> tensor, from theta ``params`` and the task's ``call``."""
        ...


class QueryFn(Protocol):
    """The network's outputs on a task's query inputs at adapted weights, ``[Q, ...]``
    (`query_outputs`; Proto-MAML's reading with the support set's batch-norm statistics)."""

    def __call__(self, model: nn.Module, params: Mapping[str, Tensor], call: TaskCall, /) -> Tensor:
        """The outputs at ``params`` (the adapted weights) on ``call.query``'s inputs."""
        ...


def query_outputs(model: nn.Module, params: Mapping[str, Tensor], call: TaskCall) -> Tensor:
    """One forward of the query batch at ``params``, ``[Q, ...]`` (its batch norm reads the
    query batch's own statistics): the `QueryFn` of `task_loss` unless another is given.

    Differentiated once (the meta-gradient's first backward), so attention keeps its fused
    kernel, except under vmap (`metalearn.attention.attention_kernel`)."""
    with attention_kernel(twice_differentiated=False, inputs=call.query[0]):
        return functional_call(
            model, {**(call.buffers or {}), **params}, (call.query[0],),
            dict(call.model_kwargs or {}),
        )  # fmt: skip


def task_loss(
    model: nn.Module,
    params: Mapping[str, Tensor],
    call: TaskCall,
    *,
    start: StartFn | None = None,
    query: QueryFn = query_outputs,
) -> TaskResult:
    """The meta-loss of one task: adapt on ``call.support``, evaluate on ``call.query``.

    Args:
        model: the network (called through ``functional_call``).
        params: theta, name -> tensor.
        call: the task's sets and settings (a `TaskCall`).
        start: where the inner loop starts, ``phi_0 = start(model, params, call)``; None:
            theta itself (MAML). Bound by ``functools.partial``, the result is a `TaskFn`.
        query: the adapted network's outputs on the query (`query_outputs`: the query
            batch alone); bound as ``start`` is.

    Returns:
        A `TaskResult` (query loss, query accuracy, support losses).
    """
    if start is not None:
        params = start(model, params, call)
    inner = call.inner if call.steps is None else replace(call.inner, steps=call.steps)
    fast, support_losses = run_inner_loop(
        model, params, call.support, inner, buffers=call.buffers, model_kwargs=call.model_kwargs,
        regularizer=call.regularizer, stop=call.stop, check_finite=call.check_finite,
        task_index=call.task_index,
    )  # fmt: skip
    yq = call.query[1]
    out = query(model, fast, call)
    loss = inner.loss_fn(out, yq)
    if call.check_finite and not torch.isfinite(loss):
        raise NonFiniteLossError("query", call.task_index, None, float(loss))
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
    normalisation: Normalisation | None = None,
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
        task_fn: the meta-loss of one task, called with a `TaskCall` in both modes
            (default `task_loss`; MAML++ passes its multi-step loss).
        normalisation: the model's normalisation calls, for the planner's vmap choice (a
            learner's cached one); None: read from the first task's forward.

    Returns:
        A `MetaBatch`.
    """
    (chunk,) = plan(model, tasks, inner, vectorize, None, normalisation)
    return run_meta_batch(
        model, params, ChunkCall(tasks, inner, chunk.mode, task_fn, buffers=buffers,
                                 on_nonfinite=on_nonfinite, regularizer=regularizer),
    )  # fmt: skip


@dataclass(frozen=True, eq=False)
class ChunkCall:
    """One chunk of a plan and the settings its tasks share: what a `ChunkRunner` is given.

    Attributes:
        tasks: the chunk's tasks.
        inner: the inner-loop settings.
        mode: ``"vmap"`` or ``"loop"``, as the planner decided it; not checked against
            `metalearn.engine.plan.vmap_blockers` (the planner did that).
        task_fn: the meta-loss of one task, called with a `TaskCall` in both modes
            (`task_loss`, or an algorithm's own such as MAML++'s multi-step loss).
        buffers: non-adapted tensors for ``functional_call`` (None: none).
        on_nonfinite: ``"raise"`` a `NonFiniteLossError` naming the task and inner step, or
            ``"skip"`` such tasks (listed in the result's ``skipped``).
        regularizer: added to every task's support loss (iMAML's proximal term).
        first_index: the meta-batch index of ``tasks[0]``, so that errors name a task's
            place in the whole meta-batch.
    """

    tasks: Sequence[Task]
    inner: InnerLoop
    mode: Mode
    task_fn: TaskFn = task_loss
    buffers: Mapping[str, Tensor] | None = None
    on_nonfinite: OnNonfinite = "raise"
    regularizer: Regularizer | None = None
    first_index: int = 0


class ChunkRunner(Protocol):
    """Runs one chunk of a plan (`run_meta_batch` is the default runner).

    `MetaLossLearner.backward` hands each chunk to one;
    `metalearn.engine.compiled.CompiledChunkRunner` is the compiled one.
    """

    def __call__(
        self, model: nn.Module, params: Mapping[str, Tensor], chunk: ChunkCall, /
    ) -> MetaBatch:
        """The chunk's `MetaBatch`, as `run_meta_batch` gives it."""
        ...


def run_meta_batch(model: nn.Module, params: Mapping[str, Tensor], chunk: ChunkCall) -> MetaBatch:
    """One chunk of a meta-batch, in the mode already decided (a chunk of a
    `metalearn.engine.plan.plan`): the default `ChunkRunner`.

    Args:
        model: the network.
        params: theta, name -> tensor (differentiate ``result.loss`` with respect to them).
        chunk: the chunk's tasks, mode and shared settings.

    Returns:
        A `MetaBatch` of ``chunk.tasks`` (``skipped`` counts positions in ``chunk.tasks``).
    """
    tasks, inner, task_fn = chunk.tasks, chunk.inner, chunk.task_fn
    buffers, regularizer, on_nonfinite = chunk.buffers, chunk.regularizer, chunk.on_nonfinite
    first_index = chunk.first_index
    if not tasks:
        raise ValueError("the meta-batch is empty; pass at least one Task")
    if on_nonfinite not in ("raise", "skip"):
        raise ValueError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}")
    results: list[TaskResult | None] = [None] * len(tasks)
    skipped: set[int] = set()
    vectorized = 0
    if chunk.mode == "vmap":
        for indices in vmap_buckets(tasks, inner):
            if len(indices) == 1:
                continue  # a bucket of one runs in the loop below, same function
            bucket = [tasks[i] for i in indices]
            settings = TaskCall.of(bucket[0], inner, buffers=buffers, regularizer=regularizer)
            batched = vmapped_task_results(task_fn, model, params, settings, *stack_tasks(bucket))
            per_task = [TaskResult(*(field[n] for field in batched)) for n in range(len(bucket))]
            bad = [(i, e) for i, r in zip(indices, per_task)
                   if (e := _nonfinite(r, first_index + i)) is not None]  # fmt: skip
            if bad and on_nonfinite == "raise":
                raise bad[0][1]
            if bad:
                # The bucket shares one backward, where a dropped task's 0 * NaN would poison
                # the others' meta-gradient: its finite tasks rerun in the loop below.
                skipped.update(i for i, _ in bad)
                continue
            for i, r in zip(indices, per_task):
                results[i] = r
            vectorized += len(indices)
    for i, task in enumerate(tasks):
        if results[i] is not None or i in skipped:
            continue
        call = TaskCall.of(task, inner, buffers=buffers, regularizer=regularizer,
                           check_finite=True, task_index=first_index + i)  # fmt: skip
        try:
            results[i] = task_fn(model, params, call)
        except NonFiniteLossError:
            if on_nonfinite == "raise":
                raise
            skipped.add(i)
    return _combine(results, sorted(skipped), vectorized, params)


def vmap_buckets(tasks: Sequence[Task], inner: InnerLoop) -> list[list[int]]:
    """The rule for which tasks stack into one vmap call: groups of task indices, in order.

    Tasks share a bucket when their vmapped computation is identical up to the data: the
    same shapes and dtypes of the four tensors (stacking would promote a task to another's
    dtype, so it would not compute in its own), the same inner steps and the same forward
    kwargs. A bucket runs with its first task's step count and kwargs.
    """
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, t in enumerate(tasks):
        tensors = (*t.support, *t.query)
        key = (
            tuple((tuple(x.shape), x.dtype) for x in tensors),
            inner.steps if t.steps is None else t.steps,
            tuple(sorted((k, _kwarg_key(v)) for k, v in t.model_kwargs.items())),
        )
        groups[key].append(i)
    return list(groups.values())


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


def stack_tasks(tasks: Sequence[Task]) -> list[Tensor]:
    """A bucket's four stacked tensors ``[xs [T, N_s, ...], ys, xq [T, N_q, ...], yq]``."""
    return [torch.stack(column) for column in zip(*((*t.support, *t.query) for t in tasks))]


def vmapped_task_results(
    task_fn: TaskFn,
    model: nn.Module,
    params: Mapping[str, Tensor],
    settings: TaskCall,
    xs: Tensor,
    ys: Tensor,
    xq: Tensor,
    yq: Tensor,
) -> TaskResult:
    """``task_fn`` of a bucket's T tasks in one vmap call (`vmap_buckets` made the bucket).

    Each vmapped call is ``task_fn(model, params, call)`` with ``call`` the bucket's
    ``settings`` on one task's slices of the stacked sets; nothing is checked there (the
    caller reads the losses).

    Args:
        task_fn, model, params: as for `run_meta_batch`.
        settings: the bucket's first task's `TaskCall` (its steps, forward kwargs, buffers,
            regularizer; its sets are replaced by each task's).
        xs, ys: the stacked support sets, ``[T, N_s, ...]`` and ``[T, N_s]``.
        xq, yq: the stacked query sets, ``[T, N_q, ...]`` and ``[T, N_q]``.

    Returns:
        A `TaskResult` of ``[T]`` losses and accuracies and ``[T, steps]`` support losses.
    """

    def one(xs: Tensor, ys: Tensor, xq: Tensor, yq: Tensor) -> TaskResult:
        return task_fn(model, params, replace(settings, support=(xs, ys), query=(xq, yq)))

    return vmap(one, randomness="different")(xs, ys, xq, yq)


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
