"""Meta-batches in chunks: each chunk's graph is built, differentiated and freed in turn.

MAML's meta-gradient is a mean over tasks (Finn et al., 2017, Eq. 2 summed over the
meta-batch), so it can be accumulated chunk by chunk:

    grad = sum_c (k_c / K) * grad(mean query loss of chunk c),

with ``k_c`` the kept (finite) tasks of chunk ``c`` and ``K`` their total. Chunking changes
nothing in the maths and two things in the cost:

* **memory**: only one chunk's graph is alive at a time (the loop with chunks of one task
  holds one task's graph, as learn2learn does; vmapped chunks hold ``k`` tasks');
* **speed on a CPU**: vmap's batched activations ``[tasks, batch, 64, 14, 14]`` outgrow the
  cache as the meta-batch grows; chunks of a few tasks keep them in it while still batching.

`plan_chunks` decides the chunks (the ``"auto"`` rule below), `meta_backward` runs them and
accumulates ``.grad`` like ``loss.backward()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from metalearn.functional import accumulate_grad
from metalearn.outer import (
    AllTasksSkippedError,
    InnerLoop,
    MetaBatch,
    Task,
    choose_vectorize,
    vmap_blockers,
)

__all__ = [
    "AUTO_CHUNK_EXAMPLES",
    "ChunkSize",
    "meta_backward",
    "plan_chunks",
]

ChunkSize = int | Literal["auto"] | None
"""Tasks per chunk: an int, ``"auto"`` (by workload) or None (the whole meta-batch)."""

# Examples (support + query, summed over tasks) per vmapped chunk, by device. Measured on 2
# CPU cores, conv4, 5-way 1-shot, 32 tasks, 2 threads, malloc tuned (`metalearn.tune_malloc`),
# median ms of a meta-step by tasks per chunk (learn2learn in the same run):
#   10 examples/task, 2nd order: 32 tasks 166, 16 184, 8 217, loop 479 (l2l 457)
#   30 examples/task, 2nd order: 16 tasks 302, 8 331, 32 448, loop 480 (l2l 464)
#   80 examples/task, 2nd order: 8 tasks 649, 4 690, 16 823, loop 866 (l2l 842)
#   10 / 30 / 80 examples/task, 1st order: 32 tasks 81; 16 222 = 8 222; 4 597, 8 598,
#   loop 589 (l2l 167 / 260 / 561)
# 480 examples gives 1 chunk of 32, 2 of 16 and 6 of 6: on or next to the best of each row.
# Under glibc's default malloc every method pays page faults that depend on the process's
# history (glibc's mmap threshold rises with the largest block freed so far); in fresh
# processes no chunk size avoided them (README). `metalearn.tune_malloc` does.
# On a GPU the loop is launch-bound and only memory argues for chunks: the CUDA figure is a
# guess until measured.
AUTO_CHUNK_EXAMPLES = {"cpu": 480, "cuda": 65536}


def plan_chunks(
    model: nn.Module,
    tasks: Sequence[Task],
    inner: InnerLoop,
    vectorize: Literal["vmap", "loop", "auto"] = "auto",
    chunk_size: ChunkSize = "auto",
) -> list[range]:
    """Split a meta-batch into consecutive chunks of task indices.

    The ``"auto"`` rule: when the meta-batch must run in the loop (``vectorize="loop"``, or
    `metalearn.outer.choose_vectorize`'s blockers such as early stopping), one task per chunk,
    so each task's graph is freed after its backward. Otherwise vmapped chunks of about
    ``AUTO_CHUNK_EXAMPLES[device]`` examples (support + query): with ``E`` examples in the
    meta-batch's ``T`` tasks, ``ceil(T / ceil(E / limit))`` tasks per chunk. On CPU, 32 tasks
    of 10 examples make 1 chunk of 32, of 30 examples 2 of 16, of 80 examples 6 of 6 (the
    last 2); a task larger than the limit runs alone (in the loop).

    Args:
        model: the network (for the vmap blockers).
        tasks: the meta-batch.
        inner: inner-loop settings.
        vectorize: as for `metalearn.outer.meta_batch`.
        chunk_size: tasks per chunk, ``"auto"``, or None for one chunk.

    Returns:
        Ranges of task indices covering ``range(len(tasks))`` in order.
    """
    n = len(tasks)
    if chunk_size is None:
        return [range(n)]
    if chunk_size == "auto":
        chunk_size = _auto_chunk_size(model, tasks, inner, vectorize)
    elif not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, 'auto' or None, got {chunk_size!r}")
    return [range(start, min(start + chunk_size, n)) for start in range(0, n, chunk_size)]


def _auto_chunk_size(
    model: nn.Module, tasks: Sequence[Task], inner: InnerLoop, vectorize: str
) -> int:
    if not tasks:
        return 1
    if vectorize == "loop" or (vectorize == "auto" and vmap_blockers(model, tasks, inner)):
        return 1
    if vectorize == "vmap":
        choose_vectorize(model, tasks, inner, "vmap")  # raise early if vmap cannot be right
    device = tasks[0].support[0].device.type
    limit = AUTO_CHUNK_EXAMPLES.get(device, AUTO_CHUNK_EXAMPLES["cpu"])
    total = sum(t.support[0].shape[0] + t.query[0].shape[0] for t in tasks)
    n_chunks = -(-total // limit)  # ceil
    return max(1, -(-len(tasks) // n_chunks))


def meta_backward(
    meta_loss: Callable[[Sequence[Task]], MetaBatch],
    params: Mapping[str, Tensor],
    tasks: Sequence[Task],
    chunks: Sequence[range],
) -> MetaBatch:
    """Accumulate the meta-gradient of ``tasks`` into ``params[...].grad``, chunk by chunk.

    Args:
        meta_loss: ``meta_loss(chunk_tasks) -> MetaBatch`` (e.g. a `metalearn.outer.meta_batch`
            partial, or `MetaLearner.meta_loss`); its ``loss`` is the mean over kept tasks.
        params: the leaves to differentiate (those with ``requires_grad``); their ``.grad``
            gains the meta-gradient of the whole meta-batch, as ``result.loss.backward()``
            of the unchunked meta-loss would give.
        tasks: the meta-batch.
        chunks: from `plan_chunks`.

    Returns:
        The whole meta-batch's `MetaBatch`, with a detached ``loss``.
    """
    leaves = {k: p for k, p in params.items() if p.requires_grad}
    if not leaves:
        raise ValueError("no parameter requires grad: nothing to accumulate the meta-gradient in")
    total: dict[str, Tensor] = {}  # only leaves the graph reaches, as backward() leaves .grad
    parts: list[tuple[range, MetaBatch]] = []
    for chunk in chunks:
        try:
            result = meta_loss([tasks[i] for i in chunk])
        except AllTasksSkippedError:
            if len(chunks) == 1:
                raise
            parts.append((chunk, _all_skipped(len(chunk), leaves)))
            continue
        kept = len(chunk) - len(result.skipped)
        # Sum of the chunk's per-task losses; divided by the global kept count at the end.
        grads = torch.autograd.grad(result.loss * kept, list(leaves.values()), allow_unused=True)
        for (name, _), g in zip(leaves.items(), grads):
            if g is not None:
                total[name] = g if name not in total else total[name] + g
        parts.append((chunk, result._replace(loss=result.loss.detach())))
    merged = _merge(parts)
    kept_all = len(tasks) - len(merged.skipped)
    if kept_all == 0:
        raise AllTasksSkippedError(len(tasks))
    accumulate_grad({k: leaves[k] for k in total}, {k: g / kept_all for k, g in total.items()})
    return merged


def _all_skipped(n: int, like: Mapping[str, Tensor]) -> MetaBatch:
    """A chunk whose every task was dropped: NaN losses, weight zero in `_merge`."""
    ref = next(iter(like.values()))
    nan = torch.full((n,), float("nan"), dtype=ref.dtype, device=ref.device)
    return MetaBatch(nan[0], nan[0], nan, nan, list(range(n)), 0)


def _merge(parts: Sequence[tuple[range, MetaBatch]]) -> MetaBatch:
    """One `MetaBatch` from its chunks' (losses weighted by their kept tasks)."""
    task_losses = torch.cat([r.task_losses for _, r in parts])
    task_accuracies = torch.cat([r.task_accuracies for _, r in parts])
    skipped = [chunk[i] for chunk, r in parts for i in r.skipped]
    kept = torch.tensor([len(c) - len(r.skipped) for c, r in parts], dtype=task_losses.dtype)
    weights = (kept / kept.sum()).to(task_losses.device)
    # A chunk with no kept task has weight 0 and a NaN loss: leave it out, not 0 * NaN.
    live = [i for i, (c, r) in enumerate(parts) if len(r.skipped) < len(c)]
    loss = sum(parts[i][1].loss * weights[i] for i in live)
    accuracy = sum(parts[i][1].accuracy * weights[i] for i in live)
    vectorized = sum(r.vectorized for _, r in parts)
    return MetaBatch(loss, accuracy, task_losses, task_accuracies, skipped, vectorized)
