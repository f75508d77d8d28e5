"""Tasks from learn2learn: a ``Taskset``'s batches as metalearn `Task` lists.

learn2learn (Arnold et al., 2020) draws a task as one batch ``(data, labels)`` of
``ways * (shots + queries)`` examples, built by transforms such as
``NWays(ways), KShots(shots + queries), LoadData``; its users then split it into adaptation
and evaluation halves by hand. `from_learn2learn` does that split and yields meta-batches
any metalearn learner trains on::

    import learn2learn as l2l
    import torch
    from torchvision import datasets, transforms as T

    from metalearn.algorithms import MAML
    from metalearn.data import from_learn2learn
    from metalearn.models import Conv4

    images = datasets.ImageFolder("my_images", transform=T.Compose([T.Resize((84, 84)),
                                                                    T.ToTensor()]))
    dataset = l2l.data.MetaDataset(images)  # any dataset of (image tensor, label)
    taskset = l2l.data.Taskset(dataset, num_tasks=-1, task_transforms=[
        l2l.data.transforms.NWays(dataset, 5),
        l2l.data.transforms.KShots(dataset, 1 + 15),  # shots + queries per class
        l2l.data.transforms.LoadData(dataset),
    ])
    model = Conv4(in_channels=3, ways=5, hidden=32, pool="max", head="flatten", image_size=84)
    learner = MAML(model, inner_lr=0.01, inner_steps=5)
    opt = torch.optim.Adam(learner.parameters(), lr=1e-3)
    for step, tasks in zip(range(1000), from_learn2learn(taskset, 5, 1, 15, meta_batch=4)):
        opt.zero_grad()
        learner.backward(tasks)
        opt.step()

Nothing here imports learn2learn: a task set is anything with ``sample() -> (data,
labels)``, so this module loads where learn2learn is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import torch
from torch import Tensor

from metalearn.task import Task

__all__ = ["TaskSet", "from_learn2learn", "task_from_l2l_batch"]


class TaskSet(Protocol):
    """What `from_learn2learn` needs of a learn2learn ``Taskset`` (learn2learn 0.2 still
    accepts its older name, ``TaskDataset``, with a deprecation warning)."""

    def sample(self) -> Any: ...


def task_from_l2l_batch(
    batch: tuple[Tensor, Tensor] | list[Tensor], ways: int, shots: int, queries: int
) -> Task:
    """One learn2learn task batch as a `Task`, split per class into support and query.

    Classes are numbered 0..ways-1 in increasing order of their labels in the batch (any
    labels, remapped or not); within a class, the first ``shots`` examples in batch order
    are the support and the next ``queries`` the query.

    Args:
        batch: ``(data [ways * (shots + queries), ...], labels [ways * (shots + queries)])``.
        ways, shots, queries: N, K and Q the task set was built with.

    Returns:
        A `Task` with support ``[ways * shots, ...]`` and query ``[ways * queries, ...]``,
        each class after class, labels ``int64``.

    Raises:
        ValueError: the batch does not hold ``ways`` classes of ``shots + queries``
            examples each (the message says how to build the task set).
    """
    data, labels = batch[0], torch.as_tensor(batch[1])
    classes, counts = torch.unique(labels, return_counts=True)  # sorted
    if len(classes) != ways or bool((counts != shots + queries).any()):
        raise ValueError(
            f"the batch holds {len(classes)} classes with {sorted(set(counts.tolist()))} "
            f"examples each, not {ways} with {shots} + {queries}; build the Taskset "
            f"with NWays(dataset, {ways}) and KShots(dataset, {shots + queries})"
        )
    # [ways, shots + queries]: each class's batch positions in batch order (stable sort).
    order = torch.argsort(labels, stable=True).reshape(ways, shots + queries)
    support, query = order[:, :shots].reshape(-1), order[:, shots:].reshape(-1)
    target = torch.arange(ways, device=labels.device)
    return Task(
        support=(data[support], target.repeat_interleave(shots)),
        query=(data[query], target.repeat_interleave(queries)),
    )


def from_learn2learn(
    taskset: TaskSet, ways: int, shots: int, queries: int, *, meta_batch: int = 1
) -> Iterator[list[Task]]:
    """Endless meta-batches of ``meta_batch`` tasks drawn from a learn2learn task set.

    Args:
        taskset: a learn2learn ``Taskset`` (anything whose ``sample()`` gives one task
            batch ``(data, labels)``); its own seeding decides the tasks.
        ways, shots, queries: N, K and Q the task set was built with.
        meta_batch: tasks per yielded list.

    Yields:
        Lists of `Task` (see `task_from_l2l_batch`), for ``learner.backward``.

    Raises:
        ValueError: ``meta_batch < 1``, or a batch that does not fit N, K and Q.
    """
    if meta_batch < 1:
        raise ValueError(f"meta_batch={meta_batch}; draw at least one task per meta-batch")
    while True:
        yield [task_from_l2l_batch(taskset.sample(), ways, shots, queries)
               for _ in range(meta_batch)]  # fmt: skip
