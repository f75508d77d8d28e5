"""Where this process stands among the ranks, and what a meta-step does across them.

The meta-step's side of `metalearn.distributed`: `info` (this rank's `DistInfo`, set by
`metalearn.distributed.launch.init_from_env`), this rank's share of a meta-batch
(`shard_slice`) and the shares' meta-gradient and metrics averaged into the whole
meta-batch's (`average_meta_step`), with the collective wrapper every module of the package
calls (`_collective`: a dead or stalled peer becomes a `PeerError`).

Each rank's meta-loss is a *mean* over its kept tasks, so the shares are weighted by their
task counts: ``sum_r n_r * g_r / sum_r n_r`` equals the single-process mean over the union
of the tasks in real arithmetic (``tests/core/test_distributed.py`` checks it to 1e-12 in
float64), also when ranks hold unequal shares or skip non-finite tasks. Without a process
group every function here returns its input or does nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "DistInfo",
    "GradSync",
    "PeerError",
    "average_gradients",
    "average_meta_step",
    "average_metrics",
    "info",
    "is_main",
    "set_info",
    "shard",
    "shard_slice",
]

T = TypeVar("T")
M = TypeVar("M")

DEFAULT_TIMEOUT_S = 600.0
"""How long a rank waits for its peers in one collective (torch's NCCL default)."""


class PeerError(RuntimeError):
    """A collective failed: another rank crashed, or stalled longer than the timeout."""


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands in the job."""

    rank: int = 0
    """Global rank, ``0 <= rank < world_size``."""
    world_size: int = 1
    """Number of processes in the job."""
    local_rank: int = 0
    """Rank on this machine (picks the GPU)."""
    device: torch.device = torch.device("cpu")
    """The device this rank computes on."""
    backend: str | None = None
    """``"gloo"`` or ``"nccl"``; None when there is no process group."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """The process group's collective timeout."""

    @property
    def distributed(self) -> bool:
        """True when a process group with more than one rank is running."""
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs, writes checkpoints and shows progress bars."""
        return self.rank == 0


_INFO = DistInfo()


def info() -> DistInfo:
    """This process's `DistInfo` (rank 0 of 1 until
    `metalearn.distributed.launch.init_from_env` starts a group)."""
    return _INFO


def is_main() -> bool:
    """True on rank 0 (and in a process that is not part of a distributed job)."""
    return _INFO.is_main


def set_info(new: DistInfo) -> DistInfo:
    """Make ``new`` this process's `DistInfo` (what `metalearn.distributed.launch` calls when
    it joins or leaves a process group); returns it."""
    global _INFO
    _INFO = new
    return _INFO


# --------------------------------------------------------------------------- sharding


def shard_slice(n: int, rank: int | None = None, world_size: int | None = None) -> slice:
    """This rank's contiguous block of ``range(n)``; the first ``n % world`` get one more.

    Concatenating the blocks of ranks ``0..world-1`` gives ``0..n-1`` in order, so results
    gathered in rank order are in the original order.
    """
    rank = _INFO.rank if rank is None else rank
    world = _INFO.world_size if world_size is None else world_size
    if n < 0 or not 0 <= rank < world:
        raise ValueError(f"cannot shard n={n} for rank {rank} of {world}")
    size, extra = divmod(n, world)
    start = rank * size + min(rank, extra)
    return slice(start, start + size + (rank < extra))


def shard(items: Sequence[T], rank: int | None = None, world_size: int | None = None) -> Any:
    """``items[shard_slice(len(items))]``: this rank's block of a list or a tensor's rows."""
    return items[shard_slice(len(items), rank, world_size)]


# --------------------------------------------------------------------------- gradients


class GradSync(NamedTuple):
    """What one `average_gradients` call did."""

    weight: float
    """The total weight over all ranks (the global task count)."""
    elements: int
    """Elements all-reduced (gradients, plus one weight and one flag per tensor)."""
    bytes: int
    """Bytes of the all-reduced buffers (what each rank contributes to the all_reduce)."""


def average_gradients(params: Iterable[Tensor], weight: float = 1.0) -> GradSync:
    """Replace every ``.grad`` by the weighted mean of that ``.grad`` over all ranks.

    Each rank's ``.grad`` is taken to be a mean over ``weight`` items (tasks): the result is
    ``sum_r weight_r * grad_r / sum_r weight_r`` on every rank. Gradients are flattened into
    one buffer per (dtype, device), so a step costs one ``all_reduce`` per buffer. A
    parameter whose ``.grad`` is None on some ranks counts as zeros there and gets a
    ``.grad`` on every rank if any rank had one (optimisers skip None grads, so ranks must
    agree on them).

    Args:
        params: the parameters (e.g. ``learner.parameters()``); same order on every rank.
        weight: this rank's number of items (>= 0); 0 contributes nothing.

    Returns:
        A `GradSync`. Without a process group, ``.grad`` is left as it is.

    Raises:
        PeerError: another rank crashed or stalled past the timeout.
        FloatingPointError: the total weight is 0 (no rank had a task).
    """
    params = [p for p in params if p.requires_grad]
    if weight < 0:
        raise ValueError(f"weight must be >= 0 (a task count), got {weight}")
    if not _INFO.distributed:
        return GradSync(float(weight), 0, 0)
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for p in params:
        groups.setdefault((p.dtype, p.device), []).append(p)
    total, elements, size = 0.0, 0, 0
    for (dtype, device), group in groups.items():
        # [weight * grads..., weight, has-grad flags...]: one collective carries all of it.
        parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() * weight
                 for p in group]  # fmt: skip
        flags = [float(p.grad is not None) for p in group]
        tail = torch.tensor([float(weight), *flags], dtype=dtype, device=device)
        flat = torch.cat([*parts, tail])
        _collective(dist.all_reduce, flat, what="all_reduce of the meta-gradient")
        total = float(flat[-len(tail)])
        if total <= 0:
            raise FloatingPointError("no rank had a task: the total weight is 0")
        _unflatten_grads(group, flat[: -len(tail)] / total, flat[-len(flags) :])
        elements, size = elements + flat.numel(), size + flat.numel() * flat.element_size()
    return GradSync(total if groups else float(weight), elements, size)


def _unflatten_grads(group: list[Tensor], flat: Tensor, flags: Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p, flag in zip(group, flags.tolist()):
            n = p.numel()
            if flag > 0:
                p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n


def average_metrics(metrics: M, weight: float, *, maxima: Collection[str] = ("cg_residual",)) -> M:
    """Combine a metrics dataclass (e.g. `StepMetrics`) over all ranks.

    Float fields become the ``weight``-weighted mean, int fields the sum, and fields named
    in ``maxima`` the maximum (iMAML's ``cg_residual`` is a largest residual). One
    ``all_reduce`` (two with maxima). Without a process group, ``metrics`` is returned.
    """
    if not _INFO.distributed:
        return metrics
    fields = [f.name for f in dataclasses.fields(metrics)]
    values = {f: getattr(metrics, f) for f in fields}
    summed = [f for f in fields if f not in maxima]
    scaled = [float(values[f]) * (weight if isinstance(values[f], float) else 1) for f in summed]
    buf = _to_comm(torch.tensor([*scaled, float(weight)], dtype=torch.float64))
    _collective(dist.all_reduce, buf, what="all_reduce of the step metrics")
    buf, total = buf.cpu(), float(buf[-1])
    for i, f in enumerate(summed):
        is_float = isinstance(values[f], float)
        values[f] = float(buf[i]) / total if is_float else type(values[f])(round(float(buf[i])))
    if present := [f for f in fields if f in maxima]:
        top = _to_comm(torch.tensor([float(values[f]) for f in present], dtype=torch.float64))
        _collective(dist.all_reduce, top, op=dist.ReduceOp.MAX, what="all_reduce of metrics")
        values.update(zip(present, top.tolist()))
    return dataclasses.replace(metrics, **values)


def average_meta_step(learner: nn.Module, metrics: M, tasks: int) -> M:
    """`average_gradients` and `average_metrics` after ``learner.backward(tasks)``.

    Weights by the tasks this rank kept (``tasks - metrics.skipped``), since a
    `MetaLearner`'s meta-loss is a mean over its kept tasks.

    Args:
        learner: the `MetaLearner` whose ``.grad`` was just filled.
        metrics: what ``learner.backward`` returned on this rank.
        tasks: how many tasks this rank passed to ``learner.backward``.

    Returns:
        The metrics of the whole meta-batch (the same on every rank).
    """
    kept = tasks - int(getattr(metrics, "skipped", 0))
    average_gradients(learner.parameters(), kept)
    return average_metrics(metrics, kept)


def _to_comm(t: Tensor) -> Tensor:
    """``t`` on the device the backend communicates from (NCCL: this rank's GPU)."""
    return t.to(_INFO.device) if _INFO.backend == "nccl" else t


def _collective(op: Callable[..., Any], *args: Any, what: str, **kwargs: Any) -> None:
    """Run a collective; turn a dead or stalled peer into a `PeerError` that says so."""
    try:
        op(*args, **kwargs)
    except (RuntimeError, dist.DistError) as err:
        raise PeerError(
            f"rank {_INFO.rank} of {_INFO.world_size}: {what} failed ({type(err).__name__}: "
            f"{str(err).strip().splitlines()[0][:300]}). Another rank probably crashed or "
            f"stalled for over the {_INFO.timeout_s:g} s timeout; see its log above"
        ) from err
