"""A learner's meta-step under ``torch.compile`` (`CompiledMetaGradient`), what ``--compile``
runs, and which learners it refuses (`compile_blocker`).

The compiled step is the learner's own `MetaLossLearner.backward` with a compiled chunk
runner (`metalearn.engine.compiled.CompiledChunkRunner`, whose docstring says what compiles
and how it falls back): the plan, the per-task function and the sum over chunks are
``backward``'s, so the two compute the same meta-gradient (``tests/engine/test_compiled.py``).
Evaluation (`MetaLearner.evaluate`) is not compiled.
"""

from __future__ import annotations

from collections.abc import Sequence

from metalearn.algorithms.base import MetaLearner, MetaLossLearner, StepMetrics
from metalearn.engine import Task
from metalearn.engine.compiled import CompiledChunkRunner

__all__ = ["CompiledMetaGradient", "compile_blocker"]


def compile_blocker(learner: MetaLearner) -> str | None:
    """Why ``learner``'s meta-step cannot be compiled, with the fix; None when it can."""
    name = type(learner).__name__
    if not isinstance(learner, MetaLossLearner):
        return (f"{name} computes its meta-gradient its own way, not as the gradient of a "
                f"meta-loss, so it has no meta-step to compile; compile MAML or a relative "
                f"(a MetaLossLearner), or run {name} uncompiled")  # fmt: skip
    if type(learner).backward is not MetaLossLearner.backward:
        return (f"{name} overrides backward, which need not hand its chunks to the compiled "
                f"chunk runner; run {name} uncompiled")  # fmt: skip
    if learner.not_compiled is not None:
        return f"{name}: {learner.not_compiled}; run {name} uncompiled"
    if learner.gradient_checkpointing:
        return ("gradient_checkpointing=True: Dynamo cannot trace the checkpointed inner step "
                "(it breaks at its torch.autograd.grad) and compiling it did not pay "
                "(docs/claims.md section 6); drop checkpointing or run uncompiled")  # fmt: skip
    return None


class CompiledMetaGradient:
    """``learner.backward`` with its chunks compiled: call it on a meta-batch.

    Usage (what ``--compile`` does in the experiments)::

        backward = CompiledMetaGradient(learner)
        opt.zero_grad()
        metrics = backward(tasks)  # fills .grad of learner.parameters(), as learner.backward
        opt.step()

    Args:
        learner: a `MetaLossLearner` without checkpointing (`compile_blocker`).

    Attributes:
        learner: the learner.
        runner: the `metalearn.engine.compiled.CompiledChunkRunner` its ``backward`` is given
            (its ``whole``, ``per_task`` and ``break_reason`` say what runs compiled).

    Raises:
        ValueError: a learner `compile_blocker` refuses.
    """

    def __init__(self, learner: MetaLearner) -> None:
        if (blocker := compile_blocker(learner)) is not None:
            raise ValueError(blocker)
        self.learner: MetaLossLearner = learner  # type: ignore[assignment]
        self.runner = CompiledChunkRunner()

    def __call__(self, tasks: Sequence[Task]) -> StepMetrics:
        """Accumulate the meta-gradient of ``tasks`` into ``.grad``; the step's metrics."""
        return self.learner.backward(tasks, run_chunk=self.runner)
