"""A meta-batch's meta-gradient accumulated chunk by chunk (`ChunkedMetaGradient`).

MAML's meta-gradient is a mean over tasks (Finn et al., 2017, Eq. 2 summed over the
meta-batch), so it can be accumulated chunk by chunk:

    grad = sum_c (k_c / K) * grad(mean query loss of chunk c),

with ``k_c`` the kept (finite) tasks of chunk ``c`` and ``K`` their total. Each chunk's graph
is built, differentiated and freed in turn; the chunks and their modes come from
`metalearn.engine.plan.plan`, their results from `metalearn.engine.outer.run_meta_batch`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from metalearn.engine.plan import ChunkSize
from metalearn.functional import accumulate_grad
from metalearn.task import AllTasksSkippedError, MetaBatch

__all__ = ["ChunkSize", "ChunkedMetaGradient"]


class ChunkedMetaGradient:
    """Sums the chunks' meta-gradients; `finish` writes their mean into ``.grad``.

    Usage (what `MetaLearner.backward` does)::

        total = ChunkedMetaGradient(dict(learner.named_parameters()))
        for chunk in plan(...):
            total.add(chunk.tasks, run_meta_batch(...))  # None: every task was skipped
        result = total.finish()

    Args:
        params: the leaves to differentiate (those with ``requires_grad``); their ``.grad``
            gains the meta-gradient of the whole meta-batch, as ``result.loss.backward()``
            of the unchunked meta-loss would give.
    """

    def __init__(self, params: Mapping[str, Tensor]) -> None:
        self.leaves = {k: p for k, p in params.items() if p.requires_grad}
        if not self.leaves:
            raise ValueError(
                "no parameter requires grad: nothing to accumulate the meta-gradient in"
            )
        self.sums: dict[str, Tensor] = {}  # only leaves the graph reaches, as backward() does
        self.parts: list[tuple[range, MetaBatch]] = []

    def add(self, chunk: range, result: MetaBatch | None) -> None:
        """Differentiate one chunk's result (its graph can be freed after this).

        Args:
            chunk: the chunk's task indices in the meta-batch.
            result: its `MetaBatch`, or None when every task of the chunk was skipped.
        """
        if result is None:
            self.parts.append((chunk, _all_skipped(len(chunk), self.leaves)))
            return
        kept = len(chunk) - len(result.skipped)
        # The sum of the chunk's per-task losses; divided by the global kept count in finish.
        grads = torch.autograd.grad(
            result.loss * kept, list(self.leaves.values()), allow_unused=True
        )
        for name, g in zip(self.leaves, grads):
            if g is not None:
                self.sums[name] = g if name not in self.sums else self.sums[name] + g
        self.parts.append((chunk, result._replace(loss=result.loss.detach())))

    def finish(self) -> MetaBatch:
        """Write the mean meta-gradient into ``.grad``; the whole meta-batch's `MetaBatch`.

        Returns:
            The merged result (detached ``loss``; ``skipped`` as meta-batch indices).

        Raises:
            AllTasksSkippedError: no chunk kept a task.
        """
        merged = _merge(self.parts)
        kept_all = len(merged.task_losses) - len(merged.skipped)
        if kept_all == 0:
            raise AllTasksSkippedError(len(merged.task_losses))
        accumulate_grad(
            {k: self.leaves[k] for k in self.sums},
            {k: g / kept_all for k, g in self.sums.items()},
        )
        return merged


def _all_skipped(n: int, like: Mapping[str, Tensor]) -> MetaBatch:
    """A chunk whose every task was dropped: NaN losses, weight zero in `_merge`."""
    ref = next(iter(like.values()))
    nan = torch.full((n,), float("nan"), dtype=ref.dtype, device=ref.device)
    return MetaBatch(nan[0], nan[0], nan, nan, list(range(n)), 0)


def _merge(parts: list[tuple[range, MetaBatch]]) -> MetaBatch:
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
