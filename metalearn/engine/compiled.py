"""A learner's meta-gradient under ``torch.compile`` (`CompiledMetaGradient`).

What pays to compile is the largest piece that traces as one graph:

* **the whole chunk**, where it traces without a graph break: a vmapped chunk of the
  learner's plan, i.e. its per-task meta-loss (`metalearn.engine.outer.task_loss`, or MAML++'s)
  under ``torch.func.vmap`` over the chunk's stacked tasks, compiled with
  ``fullgraph=True``. AOTAutograd derives the backward, so the inner gradients, the query
  losses and the chunk's meta-gradient (Finn et al., 2017, Eq. 2 over the chunk) are all
  generated code. Only the Adam update and the sum over chunks run eagerly.
* **the per-task function** otherwise: each task's meta-loss compiled as one graph, called
  in `metalearn.engine.outer.run_meta_batch`'s loop. That is the path of the chunks the plan runs
  in the loop, and of every chunk once the whole chunk failed to trace as one graph.
* **nothing** when neither traces as one graph: the chunks run eagerly, as ``backward``
  runs them. MAML++'s multi-step loss at torch 2.13 is such a case: its zero-step query
  pass calls ``torch.result_type``, which Dynamo cannot put in a graph.

Every compile asks for one graph (``fullgraph=True``), so what is compiled has no graph
break; a failed trace costs about a second and leaves the reason in ``break_reason``.

The plan (`MetaLearner.plan`), the per-task function (`MetaLossLearner.task_fn`) and the
sum over chunks (`metalearn.engine.accumulate.ChunkedMetaGradient`) are the learner's own, so a
compiled step computes `MetaLossLearner.backward`'s meta-gradient: in float64 they agree to
rounding (``tests/test_compiled.py``); in float32 the generated code rounds differently
(1e-3 relative at 16 tasks, docs/claims.md section 5).

Non-finite losses are checked after the compiled code ran, not inside it (a check is a
data-dependent branch, hence a graph break): a chunk or task with a non-finite loss reruns
eagerly, which raises or skips exactly as ``backward`` does.

Each new chunk shape compiles once (``dynamic=False``): on a CPU the first step of a run
takes minutes for Conv4, and the compiled step then took 1.36x eager's time on the default
Omniglot meta-step (docs/benchmarks.md, "`--compile` on the CPU"). Evaluation
(`MetaLearner.evaluate`) is not compiled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch._dynamo
from torch import Tensor, nn
from torch.func import vmap

from metalearn.algorithms import MetaLearner, MetaLossLearner, StepMetrics
from metalearn.engine.accumulate import ChunkedMetaGradient
from metalearn.engine.inner import InnerLoop
from metalearn.engine.outer import TaskFn, run_meta_batch
from metalearn.engine.plan import Chunk
from metalearn.engine.task import AllTasksSkippedError, MetaBatch, Task, TaskResult

__all__ = ["CompiledMetaGradient", "compile_blocker"]


def compile_blocker(learner: MetaLearner) -> str | None:
    """Why ``learner``'s meta-step cannot be compiled, with the fix; None when it can."""
    name = type(learner).__name__
    if not isinstance(learner, MetaLossLearner):
        return (f"{name} computes its meta-gradient its own way, not as the gradient of a "
                f"meta-loss, so it has no meta-step to compile; compile MAML or a relative "
                f"(a MetaLossLearner), or run {name} uncompiled")  # fmt: skip
    if type(learner).backward is not MetaLossLearner.backward:
        return (f"{name} overrides backward, which the compiled meta-step would bypass; "
                f"run {name} uncompiled")  # fmt: skip
    if learner.checkpoint:
        return ("checkpoint=True: Dynamo cannot trace the checkpointed inner step (it breaks "
                "at its torch.autograd.grad) and compiling it did not pay (docs/claims.md "
                "section 6); drop checkpointing or run uncompiled")  # fmt: skip
    return None


class CompiledMetaGradient:
    """``learner.backward`` with its meta-loss compiled: call it on a meta-batch.

    Usage (what ``--compile`` does in the experiments)::

        backward = CompiledMetaGradient(learner)
        opt.zero_grad()
        metrics = backward(tasks)  # fills .grad of learner.parameters(), as learner.backward
        opt.step()

    Args:
        learner: a `MetaLossLearner` without checkpointing (`compile_blocker`).

    Attributes:
        whole: whether vmapped chunks run as one compiled graph; False (for good) once the
            whole chunk failed to trace as one, after which they run per task.
        per_task: whether tasks run through the compiled per-task function; False (for good)
            once it failed to trace as one graph, after which they run eagerly.
        break_reason: the first line of Dynamo's last reason for turning either off.

    Raises:
        ValueError: a learner `compile_blocker` refuses.
    """

    def __init__(self, learner: MetaLearner) -> None:
        if (blocker := compile_blocker(learner)) is not None:
            raise ValueError(blocker)
        self.learner: MetaLossLearner = learner  # type: ignore[assignment]
        self.whole = self.per_task = True
        self.break_reason: str | None = None
        self._chunk_fn = torch.compile(_vmapped_task_results, fullgraph=True, dynamic=False)
        self._task_fn = torch.compile(_call, fullgraph=True, dynamic=False)

    def __call__(self, tasks: Sequence[Task]) -> StepMetrics:
        """Accumulate the meta-gradient of ``tasks`` into ``.grad``; the step's metrics."""
        learner = self.learner
        inner = learner.inner_loop()
        theta, task_fn = learner.theta(), learner.task_fn()
        total = ChunkedMetaGradient(dict(learner.named_parameters()))
        for chunk in learner.plan(tasks, inner):
            try:
                part = self._run_chunk(theta, tasks, chunk, inner, task_fn)
            except AllTasksSkippedError:
                part = None
            total.add(chunk.tasks, part)
        result = total.finish()
        return StepMetrics(float(result.loss), float(result.accuracy), len(result.skipped),
                           result.vectorized)  # fmt: skip

    def _run_chunk(
        self,
        theta: Mapping[str, Tensor],
        tasks: Sequence[Task],
        chunk: Chunk,
        inner: InnerLoop,
        task_fn: TaskFn,
    ) -> MetaBatch:
        """One chunk: compiled whole if it can be, else its tasks through the compiled per-task
        function, else eagerly as ``backward`` runs it (a vmapped chunk of mixed shapes, which
        vmap buckets, also runs eagerly)."""
        part = [tasks[i] for i in chunk.tasks]
        if chunk.mode == "vmap" and self.whole and _one_bucket(part):
            result = self._whole_chunk(theta, part, inner, task_fn)
            if result is not None:
                return result
        per_task = self.per_task and (chunk.mode == "loop" or not self.whole)
        return run_meta_batch(
            self.learner.model, theta, part, inner, "loop" if per_task else chunk.mode,
            buffers=self.learner.buffers_dict(), on_nonfinite=self.learner.on_nonfinite,
            task_fn=self._per_task(task_fn) if per_task else task_fn,
            first_index=chunk.tasks.start,
        )  # fmt: skip

    def _whole_chunk(
        self, theta: Mapping[str, Tensor], tasks: Sequence[Task], inner: InnerLoop, task_fn: TaskFn
    ) -> MetaBatch | None:
        """The chunk as one compiled graph; None when it does not trace or a loss is not
        finite (the caller then runs it another way, which raises or skips as eager does)."""
        stacked = [torch.stack(column) for column in zip(*((*t.support, *t.query) for t in tasks))]
        try:
            batched = self._chunk_fn(task_fn, self.learner.model, theta,
                                     self.learner.buffers_dict(), inner, tasks[0].steps,
                                     *stacked)  # fmt: skip
        except torch._dynamo.exc.Unsupported as err:
            self.whole, self.break_reason = False, _first_line(err)
            return None
        if not _finite(batched):
            return None
        losses = batched.loss
        return MetaBatch(losses.mean(), batched.accuracy.mean().detach(), losses.detach(),
                         batched.accuracy.detach(), [], len(tasks))  # fmt: skip

    def _per_task(self, task_fn: TaskFn) -> TaskFn:
        """``task_fn`` compiled, with `task_loss`'s signature for `run_meta_batch`'s loop.

        The compiled call checks nothing (``check_finite`` and ``task_index`` stay out of it:
        a check breaks the graph, an index would recompile per task); a task with a
        non-finite loss reruns eagerly with the check, which raises naming task and step.
        A task with an early-stopping rule runs eagerly (its branch is on data).
        """

        def run(
            model: nn.Module,
            params: Mapping[str, Tensor],
            support: tuple[Tensor, Tensor],
            query: tuple[Tensor, Tensor],
            inner: InnerLoop,
            *,
            stop: Any = None,
            check_finite: bool = False,
            task_index: int | None = None,
            **kwargs: Any,
        ) -> TaskResult:
            if stop is None and self.per_task:
                try:
                    result = self._task_fn(task_fn, model, params, support, query, inner, **kwargs)
                except torch._dynamo.exc.Unsupported as err:
                    self.per_task, self.break_reason = False, _first_line(err)
                else:
                    if not check_finite or _finite(result):
                        return result
            return task_fn(model, params, support, query, inner, stop=stop,
                           check_finite=check_finite, task_index=task_index, **kwargs)  # fmt: skip

        return run


def _vmapped_task_results(
    task_fn: TaskFn,
    model: nn.Module,
    params: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor],
    inner: InnerLoop,
    steps: int | None,
    xs: Tensor,
    ys: Tensor,
    xq: Tensor,
    yq: Tensor,
) -> TaskResult:
    """``task_fn`` of T same-shaped tasks under vmap (what `run_meta_batch` runs per bucket).

    Args:
        task_fn, model, params, buffers, inner, steps: as `metalearn.engine.outer.task_loss` takes.
        xs, ys: the stacked support sets, ``[T, N_s, ...]`` and ``[T, N_s]``.
        xq, yq: the stacked query sets, ``[T, N_q, ...]`` and ``[T, N_q]``.

    Returns:
        A `TaskResult` of ``[T]`` losses and accuracies and ``[T, steps]`` support losses.
    """

    def one(xs: Tensor, ys: Tensor, xq: Tensor, yq: Tensor) -> TaskResult:
        return task_fn(model, params, (xs, ys), (xq, yq), inner, buffers=buffers, steps=steps)

    return vmap(one, randomness="different")(xs, ys, xq, yq)


def _call(task_fn: TaskFn, *args: Any, **kwargs: Any) -> TaskResult:
    """``task_fn(*args, **kwargs)``: one compiled function for every learner's task_fn."""
    return task_fn(*args, **kwargs)


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0]


def _one_bucket(tasks: Sequence[Task]) -> bool:
    """Whether ``tasks`` stack into one vmap call: same shapes, steps and dtypes, no forward
    kwargs and no early stopping (`metalearn.engine.outer` buckets the others)."""
    first = tasks[0]

    def key(t: Task) -> tuple:
        tensors = (*t.support, *t.query)
        return (*(x.shape for x in tensors), *(x.dtype for x in tensors), t.steps)

    return all(key(t) == key(first) and not t.model_kwargs and t.stop is None for t in tasks)


def _finite(result: TaskResult) -> bool:
    """Whether every query and support loss of ``result`` is finite (one sync)."""
    losses = torch.cat([result.loss.detach().reshape(-1),
                        result.support_losses.detach().reshape(-1)])  # fmt: skip
    return bool(torch.isfinite(losses).all())
