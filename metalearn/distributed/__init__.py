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

Modules:

* `ranks`: where this process stands (`DistInfo`, `info`) and what a meta-step does across
  the ranks: its share of the tasks (`shard_slice`) and the shares' meta-gradient averaged
  (`average_meta_step`; why the shares are weighted by their task counts is said there);
* `launch`: joining and leaving ``torchrun``'s process group (`init_from_env`, `cleanup`);
* `sync`: keeping the ranks in step outside the meta-step (`broadcast_params`,
  `check_same`, `gather_tensor`, `from_main`, `barrier`, `main_first`).

Without a process group (a plain ``python`` run, or ``torchrun --nproc_per_node=1``) every
function here does nothing or returns its input, so one script serves both cases. Every
name is imported from here (``from metalearn import distributed``).
"""

from metalearn.distributed.launch import cleanup, init_from_env
from metalearn.distributed.ranks import (
    DEFAULT_TIMEOUT_S,
    DistInfo,
    GradSync,
    PeerError,
    average_gradients,
    average_meta_step,
    average_metrics,
    info,
    is_main,
    shard,
    shard_slice,
)
from metalearn.distributed.sync import (
    barrier,
    broadcast_params,
    check_same,
    from_main,
    gather_tensor,
    main_first,
)

__all__ = [
    "DEFAULT_TIMEOUT_S",
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
