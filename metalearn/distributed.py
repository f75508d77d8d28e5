"""Meta-training on several processes with `torch.distributed` (launched by ``torchrun``).

A meta-batch is sharded across ranks: every rank computes the meta-gradient of its share of
the tasks with the engine as usual (vmap or loop), then one ``all_reduce`` turns the shares
into the meta-gradient of the whole meta-batch, so every rank applies the same update and
holds identical parameters after every step::

    info = init_from_env()                          # no-op unless launched by torchrun
    broadcast_params(learner)                       # every rank starts from rank 0's weights
    for step in range(steps):
        classes, examples = sampler.sample_indices(gen, meta_batch)  # same gen on every rank
        part = shard_slice(meta_batch)
        tasks = sampler.tasks_from_indices(classes[part], examples[part])
        opt.zero_grad()
        metrics = learner.backward(tasks)           # this rank's mean over its tasks
        metrics = average_meta_step(learner, metrics, len(tasks))  # the global mean
        opt.step()

Why explicit collectives rather than ``DistributedDataParallel``: DDP's reducer hooks fire
on ``loss.backward()`` of a module's parameters and assume one forward and one backward per
step. Here the meta-gradient comes from ``torch.func`` transforms, and some algorithms never
call ``backward`` on a loss (iMAML solves for it by conjugate gradient, Reptile writes a
difference of weights into ``.grad``). One ``all_reduce`` of the filled ``.grad`` buffers
after ``learner.backward`` is correct for every `MetaLearner`, needs no hooks, and sends
what DDP's buckets would (one flat buffer per dtype and device). What it gives up, DDP's
overlap of communication with the backward pass, is worth little here: a meta-step is
hundreds of ms of compute against 0.4 ms for Conv4's 449 KB all_reduce (2 gloo processes
on one machine, measured after a barrier).

Each rank's meta-loss is a *mean* over its kept tasks, so the shares are weighted by their
task counts: ``sum_r n_r * g_r / sum_r n_r`` equals the single-process mean over the union
of the tasks in real arithmetic (``tests/core/test_distributed.py`` checks it to 1e-12 in
float64), also when ranks hold unequal shares or skip non-finite tasks.

Without a process group (a plain ``python`` run, or ``torchrun --nproc_per_node=1``) every
function here does nothing or returns its input, so one script serves both cases.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import os
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = [
    "DistInfo",
    "GradSync",
    "PeerError",
    "average_gradients",
    "average_meta_step",
    "average_metrics",
    "barrier",
    "broadcast_params",
    "check_same",
    "cleanup",
    "from_main",
    "gather_tensor",
    "info",
    "init_from_env",
    "is_main",
    "main_first",
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
    """This process's `DistInfo` (rank 0 of 1 until `init_from_env` starts a group)."""
    return _INFO


def is_main() -> bool:
    """True on rank 0 (and in a process that is not part of a distributed job)."""
    return _INFO.is_main


def init_from_env(
    backend: str | None = None,
    *,
    device: str | torch.device | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> DistInfo:
    """Join the process group that ``torchrun`` describes in the environment.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (and ``MASTER_ADDR``/``MASTER_PORT``) as
    ``torchrun`` sets them. With no ``WORLD_SIZE`` or ``WORLD_SIZE=1`` nothing is started and
    the returned info says rank 0 of 1, so the same script runs under plain ``python``.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; None picks nccl for a CUDA device, else gloo.
        device: ``"cpu"``, ``"cuda"`` (this rank's GPU, ``cuda:LOCAL_RANK``, is used and set
            current) or None (CUDA when available).
        timeout_s: seconds a collective waits for the other ranks before it fails, so a
            stalled peer ends the job with a `PeerError` instead of hanging it.

    Returns:
        The `DistInfo`, also available later from `info`.

    Raises:
        ValueError: a bad backend/device pair, a non-positive timeout, or inconsistent
            environment variables (each named).
    """
    global _INFO
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    world, rank = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is not in [0, WORLD_SIZE={world}); launch with torchrun")
    if world == 1:
        _INFO = DistInfo(device=device, timeout_s=timeout_s)
        return _INFO
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"backend='nccl' needs a CUDA device, got {device}; use backend='gloo'")
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)  # one GPU per rank on each machine
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend, timeout=timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,
        )  # fmt: skip
        if backend == "gloo":
            # A gloo group still alive at interpreter shutdown can abort the process
            # ("terminate called without an active exception", pytorch#190489): its worker
            # threads free tensors after Python is gone. Destroying it at exit, while the
            # interpreter still runs, avoids that (measured: 8 of 15 exits aborted without a
            # destroy). Destroying a gloo group is local: no collective, no wait on peers.
            atexit.register(cleanup)
    _INFO = DistInfo(rank, world, local_rank, device, backend, timeout_s)
    return _INFO


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"${name}={text!r} is not an integer; launch with torchrun") from None


def cleanup() -> None:
    """Leave the process group (safe to call when none was started)."""
    global _INFO
    if dist.is_initialized():
        dist.destroy_process_group()
    _INFO = DistInfo(device=_INFO.device, timeout_s=_INFO.timeout_s)


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


# --------------------------------------------------------------------------- state


def broadcast_params(module: nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and buffers into every rank's ``module``."""
    if not _INFO.distributed:
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
    if not _INFO.distributed:
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
    if not _INFO.distributed:
        return local
    sizes = torch.tensor([local.shape[0]], dtype=torch.int64)
    every = [torch.zeros_like(_to_comm(sizes)) for _ in range(_INFO.world_size)]
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
    if not _INFO.distributed:
        return fn(*args, **kwargs)
    box: list[Any] = [None]
    if _INFO.is_main:
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
    if _INFO.distributed:
        _collective(dist.barrier, what="barrier")


@contextlib.contextmanager
def main_first(local: bool = True) -> Iterator[None]:
    """Run the block on each machine's local rank 0 first, then on the other ranks.

    For downloads and caches: the first rank fills the cache, the others then read it.
    With ``local=False`` only global rank 0 goes first (a filesystem all machines share).
    """
    lead = (_INFO.local_rank if local else _INFO.rank) == 0
    if not lead:
        barrier()
    try:
        yield
    finally:
        if lead:
            barrier()


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
