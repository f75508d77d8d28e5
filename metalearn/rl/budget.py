"""A step budget: which sampled episodes maml_rl's vectorized sampler would have kept.

maml_rl samples a number of environment steps, not of episodes (cbfinn/maml_rl at 9c8e2eb,
``sandbox/rocky/tf/samplers/vectorized_sampler.py``): a batch of environments (streams) is
stepped in lockstep, each starting a new episode as soon as its last one ends (at its goal
or at the horizon, ``vec_env_executor.py``), and sampling stops at the first lockstep time
at which the completed episodes of all streams hold at least the budget,
``while n_samples < self.algo.batch_size``; the episodes still running are dropped. Its
MAML sampler steps one stream per task with a budget of ``fast_batch_size x
max_path_length`` steps a task (``batch_maml_polopt.py``: ``n_envs = meta_batch_size``);
its test scripts' VPG sampler runs ``batch_size / max_path_length`` streams on one task
(at most 100).

Here the episodes are sampled in parallel, each from its own seed, and the budget picks the
ones that sequence keeps: episode b of a task is the ``b // S``-th of its stream ``b % S``
(S streams a task), so it ends at lockstep time ``sum of its stream's lengths up to it``.
An episode's steps do not depend on when it starts (its noise and reset are its seed's), so
the kept episodes are those maml_rl's loop would have run.
"""

from __future__ import annotations

import torch
from torch import Tensor

from metalearn.rl.episodes import Episodes

__all__ = ["budget_cut", "keep_episodes"]


def budget_cut(lengths: Tensor, streams: int, steps: int) -> Tensor | None:
    """The episodes a lockstep sampler keeps for a budget of ``steps`` a task.

    Args:
        lengths: ``[K, B]`` the sampled episodes' lengths (valid steps), B a multiple of
            ``streams``; episode b is the ``b // streams``-th of stream ``b % streams``.
        streams: the environments stepped in lockstep per task.
        steps: the budget per task; the stop is when all K tasks' completed episodes hold
            ``K * steps`` steps (maml_rl's budget is the meta-batch's total).

    Returns:
        ``[K, B]`` bool, the kept episodes; None when the episodes given do not reach the
        stop in some stream (its next episode might end before it: sample more).
    """
    k, b = lengths.shape
    if b % streams:
        raise ValueError(f"{b} episodes a task is not a multiple of {streams} streams")
    per_stream = lengths.reshape(k, b // streams, streams)
    ends = per_stream.cumsum(1)  # [K, R, S]: the lockstep time each episode ends at
    order = ends.flatten().argsort(stable=True)
    completed = lengths.reshape(k, -1, streams).flatten()[order].cumsum(0)
    reached = (completed >= k * steps).nonzero()
    if len(reached) == 0:
        return None
    stop = ends.flatten()[order[reached[0, 0]]]
    if (ends[:, -1, :] < stop).any():  # a stream's next, unsampled episode could end first
        return None
    return (ends <= stop).reshape(k, b)


def keep_episodes(episodes: Episodes, kept: Tensor) -> Episodes:
    """``episodes [K, B, T]`` with only the ``kept [K, B]`` ones, first in each task, the
    tasks with fewer padded by empty episodes (mask 0): ``[K, max kept, T]``."""
    order = (~kept).to(torch.int8).argsort(dim=1, stable=True)  # kept first, in order
    count = int(kept.sum(1).max())
    order = order[:, :count]
    keep = torch.gather(kept, 1, order).to(episodes.mask.dtype)[..., None]  # [K, n, 1]

    def take(x: Tensor) -> Tensor:
        index = order.reshape(*order.shape, *([1] * (x.dim() - 2))).expand(
            *order.shape, *x.shape[2:]
        )
        return torch.gather(x, 1, index)

    obs, actions, rewards, mask = (take(x) for x in episodes)
    return Episodes(obs, actions, rewards * keep, mask * keep)
