"""How a meta-batch runs: its chunks of tasks, and each chunk's mode (vmap or loop).

`plan` is the one place this is decided, from one table of limits
(`VMAP_CHUNK_EXAMPLES`) and the reasons a meta-batch cannot run under vmap
(`vmap_blockers`). `MetaLearner` plans, then hands each chunk with its mode to
`metalearn.engine.outer.run_meta_batch`; `metalearn.engine.outer.meta_batch` plans its tasks
as one chunk. Whether the model's normalisation lets vmap be exact is read from its forward
(`metalearn.normalisation`), never from its modules' classes.

Chunking changes nothing in the maths (the meta-gradient is a mean over tasks, see
`metalearn.engine.accumulate`) and two things in the cost:

* **memory**: only one chunk's graph is alive at a time (the loop with chunks of one task
  holds one task's graph, as learn2learn does; vmapped chunks hold ``k`` tasks');
* **speed on a CPU**: vmap's batched activations ``[tasks, batch, 64, 14, 14]`` outgrow the
  cache as the meta-batch grows; chunks of a few tasks keep them in it while still batching.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple

from torch import nn

from metalearn.engine.inner import InnerLoop
from metalearn.normalisation import Normalisation, read_normalisation
from metalearn.task import Task

__all__ = [
    "VMAP_CHUNK_EXAMPLES",
    "Chunk",
    "ChunkSize",
    "Mode",
    "Vectorize",
    "plan",
    "vmap_blockers",
]

Vectorize = Literal["vmap", "loop", "auto"]
"""What the caller asks for: vmap, the Python loop, or `plan`'s choice."""
Mode = Literal["vmap", "loop"]
"""How one chunk runs."""
ChunkSize = int | Literal["auto"] | None
"""Tasks per chunk: an int, ``"auto"`` (by workload) or None (the whole meta-batch)."""

# Examples (support + query, summed over a chunk's tasks) per vmapped chunk, by device.
# Measured on 2 CPU cores, conv4, 5-way 1-shot, 32 tasks, 2 threads, malloc tuned
# (`metalearn.tune_malloc`), median ms of a meta-step by tasks per chunk (learn2learn in the
# same run):
#   10 examples/task, 2nd order: 32 tasks 166, 16 184, 8 217, loop 479 (l2l 457)
#   30 examples/task, 2nd order: 16 tasks 302, 8 331, 32 448, loop 480 (l2l 464)
#   80 examples/task, 2nd order: 8 tasks 649, 4 690, 16 823, loop 866 (l2l 842)
#   10 / 30 / 80 examples/task, 1st order: 32 tasks 81; 16 222 = 8 222; 4 597, 8 598,
#   loop 589 (l2l 167 / 260 / 561)
# 480 gives 1 chunk of 32, 2 of 16 and 6 of 6: on or next to the best of each row. Past it,
# the batched activations outgrow the cache and vmap loses to the loop (32 x 30 examples in
# one vmapped chunk: 448 ms against 302 for two chunks of 16).
# CUDA: unmeasured. There the loop is launch-bound and only memory argues for chunks, so the
# figure is a placeholder until scripts/bench_chunks.py --device cuda measures it.
VMAP_CHUNK_EXAMPLES = {"cpu": 480, "cuda": 65536}


class Chunk(NamedTuple):
    """Consecutive tasks of a meta-batch that run together, and how they run."""

    tasks: range
    """Indices of the chunk's tasks in the meta-batch."""
    mode: Mode
    """``"vmap"`` (one batched graph per shape bucket) or ``"loop"`` (task by task)."""


def plan(
    model: nn.Module,
    tasks: Sequence[Task],
    inner: InnerLoop,
    vectorize: Vectorize = "auto",
    chunk_size: ChunkSize = "auto",
    normalisation: Normalisation | None = None,
) -> list[Chunk]:
    """Split a meta-batch into chunks and give each its mode.

    The rule, with ``L = VMAP_CHUNK_EXAMPLES[device]``:

    * ``vectorize="vmap"`` with a `vmap_blockers` reason raises; ``"loop"`` runs every
      chunk in the loop; ``"auto"`` runs in the loop when there is a blocker.
    * ``chunk_size="auto"``: one task per chunk for the loop (each task's graph is freed after
      its backward); otherwise the most tasks whose examples fit in ``L`` (counting every
      task as the largest), spread evenly: ``ceil(T / ceil(T / floor(L / e_max)))`` tasks per
      chunk. On CPU 32 tasks of 10 examples make 1 chunk of 32, of 30 examples 2 of 16, of
      80 examples 6 of 6 (the last 2); a task larger than ``L`` runs alone.
    * A chunk runs under vmap for ``"vmap"``; for ``"auto"`` when it has no blocker, holds
      at least 2 tasks and at most ``L`` examples.

    Args:
        model: the network (for the blockers).
        tasks: the meta-batch (T >= 1 tasks).
        inner: the inner-loop settings.
        vectorize: ``"vmap"``, ``"loop"`` or ``"auto"``.
        chunk_size: tasks per chunk, ``"auto"``, or None for one chunk.
        normalisation: the model's normalisation calls on these tasks' inputs (the learner's
            cached `metalearn.normalisation.Normalisation`); None: read from the first task.

    Returns:
        Chunks covering ``range(T)`` in order.
    """
    if vectorize not in ("vmap", "loop", "auto"):
        raise ValueError(f"vectorize must be 'vmap', 'loop' or 'auto', got {vectorize!r}")
    if chunk_size != "auto" and chunk_size is not None and not _positive_int(chunk_size):
        raise ValueError(f"chunk_size must be a positive int, 'auto' or None, got {chunk_size!r}")
    if not tasks:
        raise ValueError("the meta-batch is empty; pass at least one Task")
    blockers = [] if vectorize == "loop" else vmap_blockers(model, tasks, inner, normalisation)
    if vectorize == "vmap" and blockers:
        raise ValueError(f"vectorize='vmap' cannot run this meta-batch: {'; '.join(blockers)}")
    batched = vectorize == "vmap" or (vectorize == "auto" and not blockers)
    device = tasks[0].support[0].device.type
    limit = VMAP_CHUNK_EXAMPLES.get(device, VMAP_CHUNK_EXAMPLES["cpu"])
    n = len(tasks)
    if chunk_size is None:
        size = n
    elif chunk_size == "auto":
        size = _fitting_size(tasks, limit) if batched else 1
    else:
        size = chunk_size
    chunks = [range(start, min(start + size, n)) for start in range(0, n, size)]
    return [Chunk(c, _mode(tasks, c, vectorize, batched, limit)) for c in chunks]


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _fitting_size(tasks: Sequence[Task], limit: int) -> int:
    """Tasks per chunk: as many as fit in ``limit`` examples, spread evenly over the chunks."""
    fit = max(1, limit // max(t.examples() for t in tasks))
    n_chunks = -(-len(tasks) // fit)  # ceil
    return -(-len(tasks) // n_chunks)


def _mode(
    tasks: Sequence[Task], chunk: range, vectorize: Vectorize, batched: bool, limit: int
) -> Mode:
    if vectorize == "vmap":
        return "vmap"
    if not batched or len(chunk) < 2:  # a single task has nothing to batch
        return "loop"
    return "vmap" if sum(tasks[i].examples() for i in chunk) <= limit else "loop"


def vmap_blockers(
    model: nn.Module,
    tasks: Sequence[Task],
    inner: InnerLoop,
    normalisation: Normalisation | None = None,
) -> list[str]:
    """Why a meta-batch cannot run under vmap (empty when it can), one reason per entry.

    Args:
        model: the network.
        tasks: the meta-batch.
        inner: the inner-loop settings.
        normalisation: the model's normalisation calls (None: read from ``tasks[0]``'s
            support set, `metalearn.normalisation.read_normalisation`).
    """
    blockers = []
    if any(t.stop is not None for t in tasks):
        blockers.append("a task has an early-stopping rule (data-dependent control flow)")
    if inner.checkpoint:
        blockers.append("checkpoint=True (torch.func.grad refuses checkpointing's hooks)")
    if not inner.first_order:
        if normalisation is None:
            (x, _), task = tasks[0].support, tasks[0]
            normalisation = read_normalisation(model, x, kwargs=task.model_kwargs)
        # What the forward calls decides it, not the modules' classes: a weighted fused batch,
        # instance or layer norm has a wrong vmapped second derivative (`NormCall.vmap_exact`).
        if inexact := normalisation.vmap_inexact():
            named = [f"{c.function.rsplit('.', 1)[-1]}({', '.join(c.parameters)})"
                     for c in inexact[:3]]  # fmt: skip
            blockers.append(
                f"the model's forward calls {', '.join(named)}, torch's fused norm with a "
                "weight, whose second derivative is wrong under vmap (torch 2.13); use "
                "metalearn.models.MetaBatchNorm, a norm written from mean/var, or "
                "vectorize='loop'"
            )
    return blockers
