"""The meta-learning engine: a task's inner loop and meta-loss, how a meta-batch is planned
and run, and its meta-gradient accumulated chunk by chunk.

Modules, bottom-up (each imports only those before it); what flows through them (`Task`,
`TaskResult`, `MetaBatch`, the non-finite-loss errors) is `metalearn.task`, a floor below:

* `inner`: MAML's inner loop on a parameter dict (`InnerLoop`, `adapt`);
* `plan`: the one place that decides a meta-batch's chunks and each chunk's mode;
* `outer`: one task's meta-loss (`task_loss`, a `TaskFn` given a `TaskCall`) run over a
  chunk, under vmap or in a loop (`run_meta_batch`, the default `ChunkRunner`);
* `accumulate`: the meta-gradient summed over chunks (`ChunkedMetaGradient`);
* `compiled`: a `ChunkRunner` that runs each chunk under ``torch.compile``
  (`metalearn.engine.compiled.CompiledChunkRunner`, imported from there: it loads Dynamo).

`Task` and the other names below are imported from here.
"""

from metalearn.engine.accumulate import ChunkedMetaGradient
from metalearn.engine.inner import (
    InnerLoop,
    LossFn,
    Regularizer,
    adapt,
    run_inner_loop,
)
from metalearn.engine.outer import (
    ChunkCall,
    ChunkRunner,
    OnNonfinite,
    QueryFn,
    TaskCall,
    TaskFn,
    meta_batch,
    query_outputs,
    run_meta_batch,
    task_loss,
)
from metalearn.engine.plan import (
    VMAP_CHUNK_EXAMPLES,
    Chunk,
    ChunkSize,
    Mode,
    Vectorize,
    plan,
    vmap_blockers,
)
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
    "VMAP_CHUNK_EXAMPLES",
    "AllTasksSkippedError",
    "Chunk",
    "ChunkCall",
    "ChunkRunner",
    "ChunkSize",
    "ChunkedMetaGradient",
    "InnerLoop",
    "LossFn",
    "MetaBatch",
    "Mode",
    "NonFiniteLossError",
    "OnNonfinite",
    "QueryFn",
    "Regularizer",
    "StopRule",
    "Task",
    "TaskCall",
    "TaskFn",
    "TaskResult",
    "Vectorize",
    "accuracy",
    "adapt",
    "meta_batch",
    "plan",
    "query_outputs",
    "run_inner_loop",
    "run_meta_batch",
    "task_loss",
    "vmap_blockers",
]
