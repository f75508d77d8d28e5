"""Each chunk of a meta-batch under ``torch.compile``: `CompiledChunkRunner`.

`MetaLossLearner.backward` plans a meta-batch, hands each chunk to a chunk runner
(`metalearn.engine.outer.ChunkRunner`) and accumulates the chunks' meta-gradients; the
default runner is `metalearn.engine.outer.run_meta_batch`. `CompiledChunkRunner` is the
compiled one (``--compile``): it returns what `run_meta_batch` returns for the chunk, with the
largest piece that traces as one graph compiled:

* **the whole chunk**, where it is one vmap bucket (`metalearn.engine.outer.vmap_buckets`,
  the engine's one rule) and traces without a graph break: the engine's own vmapped bucket,
  `metalearn.engine.outer.vmapped_task_results` (the per-task meta-loss under
  ``torch.func.vmap`` over the chunk's stacked tasks), compiled with ``fullgraph=True``.
  AOTAutograd derives the backward, so the inner gradients, the query losses and the
  chunk's meta-gradient (Finn et al., 2017, Eq. 2 over the chunk) are all generated code.
  Only the Adam update and the sum over chunks run eagerly.
* **the per-task function** otherwise: each task's meta-loss compiled as one graph, called
  in `run_meta_batch`'s loop. That is the path of the chunks the plan runs in the loop (and
  of a vmapped chunk of one task, which `run_meta_batch` runs in the loop too), and of every
  chunk once the whole chunk failed to trace as one graph.
* **nothing** when neither traces as one graph: the chunk runs eagerly through
  `run_meta_batch`, as the default runner runs it. So does a vmapped chunk of several
  buckets (mixed shapes, dtypes, steps or forward kwargs) while whole chunks compile.

Every compile asks for one graph (``fullgraph=True``), so what is compiled has no graph
break; a failed trace costs about a second and leaves the reason in ``break_reason``.

The plan, the per-task function, the one-chunk shortcut, the all-skipped handling and the
sum over chunks (`metalearn.engine.accumulate.ChunkedMetaGradient`) stay the learner's
``backward``'s, so a compiled step computes the eager meta-gradient: in float64 they agree to
rounding (``tests/engine/test_compiled.py``); in float32 the generated code rounds differently
(1e-3 relative at 16 tasks, docs/claims.md section 5).

Non-finite losses are checked after the compiled code ran, not inside it (a check is a
data-dependent branch, hence a graph break): a chunk or task with a non-finite loss reruns
eagerly, which raises or skips exactly as `run_meta_batch` does.

Each new chunk shape compiles once (``dynamic=False``): on a CPU the first step of a run
takes minutes for Conv4, and the compiled step then took 1.36x eager's time on the default
Omniglot meta-step (docs/benchmarks.md, "`--compile` on the CPU"). Evaluation is not
compiled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch
import torch._dynamo
from torch import Tensor, nn

from metalearn.engine.outer import (
    ChunkCall,
    TaskCall,
    TaskFn,
    run_meta_batch,
    stack_tasks,
    vmap_buckets,
    vmapped_task_results,
)
from metalearn.task import MetaBatch, Task, TaskResult

__all__ = ["CompiledChunkRunner"]


class CompiledChunkRunner:
    """A `metalearn.engine.outer.ChunkRunner` that compiles what traces as one graph.

    Usage (what ``--compile`` does, through `metalearn.algorithms.compiled`)::

        runner = CompiledChunkRunner()
        opt.zero_grad()
        metrics = learner.backward(tasks, run_chunk=runner)  # fills .grad, as without it
        opt.step()

    One runner keeps its compiled code across calls: reuse it for every step of a run.

    Attributes:
        whole: whether vmapped chunks run as one compiled graph; False (for good) once the
            whole chunk failed to trace as one, after which they run per task.
        per_task: whether tasks run through the compiled per-task function; False (for good)
            once it failed to trace as one graph, after which they run eagerly.
        break_reason: the first line of Dynamo's last reason for turning either off.
    """

    def __init__(self) -> None:
        self.whole = self.per_task = True
        self.break_reason: str | None = None
        self._chunk_fn = torch.compile(vmapped_task_results, fullgraph=True, dynamic=False)
        self._task_fn = torch.compile(_call, fullgraph=True, dynamic=False)

    def __call__(
        self, model: nn.Module, params: Mapping[str, Tensor], chunk: ChunkCall, /
    ) -> MetaBatch:
        """One chunk, as `metalearn.engine.outer.run_meta_batch` (same arguments, same
        result): compiled whole if it can be, else its tasks through the compiled per-task
        function, else eagerly."""
        tasks, mode = chunk.tasks, chunk.mode
        if mode == "vmap" and self.whole and len(tasks) > 1:
            settings = TaskCall.of(tasks[0], chunk.inner, buffers=chunk.buffers,
                                   regularizer=chunk.regularizer)  # fmt: skip
            result = self._whole_chunk(chunk.task_fn, model, params, tasks, settings)
            if result is not None:
                return result
        per_task = self.per_task and (mode == "loop" or not self.whole or len(tasks) == 1)
        if per_task:
            chunk = replace(chunk, mode="loop", task_fn=self._per_task(chunk.task_fn))
        return run_meta_batch(model, params, chunk)

    def _whole_chunk(
        self,
        task_fn: TaskFn,
        model: nn.Module,
        params: Mapping[str, Tensor],
        tasks: Sequence[Task],
        settings: TaskCall,
    ) -> MetaBatch | None:
        """The chunk as one compiled graph; None when it is not one vmap bucket, does not
        trace, or a loss is not finite (the caller then runs it another way, which raises or
        skips as eager does)."""
        if len(vmap_buckets(tasks, settings.inner)) != 1:
            return None
        try:
            batched = self._chunk_fn(task_fn, model, params, settings, *stack_tasks(tasks))
        except torch._dynamo.exc.Unsupported as err:
            self.whole, self.break_reason = False, _first_line(err)
            return None
        if not _finite(batched):
            return None
        losses = batched.loss
        return MetaBatch(losses.mean(), batched.accuracy.mean().detach(), losses.detach(),
                         batched.accuracy.detach(), [], len(tasks))  # fmt: skip

    def _per_task(self, task_fn: TaskFn) -> TaskFn:
        """``task_fn`` compiled, for `run_meta_batch`'s loop.

        The compiled call checks nothing (``check_finite`` and ``task_index`` stay out of it:
        a check breaks the graph, an index would recompile per task); a task with a
        non-finite loss reruns eagerly with the check, which raises naming task and step.
        A task with an early-stopping rule runs eagerly (its branch is on data).
        """

        def run(model: nn.Module, params: Mapping[str, Tensor], call: TaskCall) -> TaskResult:
            if call.stop is None and self.per_task:
                unchecked = replace(call, check_finite=False, task_index=None)
                try:
                    result = self._task_fn(task_fn, model, params, unchecked)
                except torch._dynamo.exc.Unsupported as err:
                    self.per_task, self.break_reason = False, _first_line(err)
                else:
                    if not call.check_finite or _finite(result):
                        return result
            return task_fn(model, params, call)

        return run


def _call(
    task_fn: TaskFn, model: nn.Module, params: Mapping[str, Tensor], call: TaskCall
) -> TaskResult:
    """``task_fn(model, params, call)``: one compiled function for every learner's task_fn."""
    return task_fn(model, params, call)


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0]


def _finite(result: TaskResult) -> bool:
    """Whether every query and support loss of ``result`` is finite (one sync)."""
    losses = torch.cat([result.loss.detach().reshape(-1),
                        result.support_losses.detach().reshape(-1)])  # fmt: skip
    return bool(torch.isfinite(losses).all())
