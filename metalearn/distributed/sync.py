"""Keeping the ranks in step outside the meta-step: rank 0's weights broadcast, the ranks'
weights compared, results gathered, work done once on rank 0 and waits for the others.

Each is a no-op, or returns its input, without a process group.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from metalearn.distributed.ranks import _collective, _to_comm, info

__all__ = ["barrier", "broadcast_params", "check_same", "from_main", "gather_tensor", "main_first"]

T = TypeVar("T")


def broadcast_params(module: nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and buffers into every rank's ``module``."""
    if not info().distributed:
        return
    tensors = [*module.parameters(), *module.buffers()]
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for group in groups.values():
            flat = torch.cat([t.detach().flatten() for t in group])
            _collective(dist.broadcast, flat, src=src, what="broadcast of the parameters")
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def check_same(tensors: Iterable[Tensor], what: str = "parameters") -> None:
    """Raise unless ``tensors`` are bitwise identical on every rank (a 64-bit digest each).

    Cheap enough to run at every checkpoint: one small ``all_gather``.

    Raises:
        RuntimeError: naming the ranks that disagree with rank 0.
    """
    if not info().distributed:
        return
    digest = hashlib.blake2b(digest_size=8)
    for t in tensors:
        digest.update(t.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    mine = torch.tensor([int.from_bytes(digest.digest(), "little", signed=True)])
    every = gather_tensor(mine).tolist()
    if bad := [r for r, d in enumerate(every) if d != every[0]]:
        raise RuntimeError(
            f"{what} differ between rank 0 and ranks {bad}: the ranks diverged; every rank "
            "must start from the same weights (broadcast_params) and apply the same gradients"
        )


def gather_tensor(local: Tensor) -> Tensor:
    """Concatenate every rank's ``local`` along dim 0, in rank order, on every rank.

    Ranks may hold different numbers of rows (even none); dtype and trailing shape must
    agree. ``local``: ``[n_r, ...]`` -> ``[sum_r n_r, ...]`` on this rank's device.
    """
    if not info().distributed:
        return local
    sizes = torch.tensor([local.shape[0]], dtype=torch.int64)
    every = [torch.zeros_like(_to_comm(sizes)) for _ in range(info().world_size)]
    _collective(dist.all_gather, every, _to_comm(sizes), what="all_gather of sizes")
    counts = [int(c) for c in every]
    padded = torch.zeros((max(counts), *local.shape[1:]), dtype=local.dtype)
    padded = _to_comm(padded)
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in counts]
    _collective(dist.all_gather, parts, padded, what="all_gather of results")
    return torch.cat([p[:c] for p, c in zip(parts, counts)]).to(local.device)


def from_main(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call ``fn`` on rank 0 only; return its result (or raise its exception) on every rank.

    For work that must happen once, e.g. reading a checkpoint that only rank 0's machine
    holds: the result is pickled and broadcast (``broadcast_object_list``), so it should be
    small (a checkpoint of a few MB is fine).
    """
    if not info().distributed:
        return fn(*args, **kwargs)
    box: list[Any] = [None]
    if info().is_main:
        try:
            box[0] = (True, fn(*args, **kwargs))
        except Exception as err:  # re-raised below, on every rank
            box[0] = (False, err)
    _collective(dist.broadcast_object_list, box, src=0, what="broadcast from rank 0")
    ok, value = box[0]
    if not ok:
        raise value
    return value


def barrier() -> None:
    """Wait until every rank gets here (no-op without a process group)."""
    if info().distributed:
        _collective(dist.barrier, what="barrier")


@contextlib.contextmanager
def main_first(local: bool = True) -> Iterator[None]:
    """Run the block on each machine's local rank 0 first, then on the other ranks.

    For downloads and caches: the first rank fills the cache, the others then read it.
    With ``local=False`` only global rank 0 goes first (a filesystem all machines share).
    """
    lead = (info().local_rank if local else info().rank) == 0
    if not lead:
        barrier()
    try:
        yield
    finally:
        if lead:
            barrier()
