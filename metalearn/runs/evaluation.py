"""Evaluate a learner on freshly drawn tasks: mean query accuracy and its 95% interval.

The task source is a parameter (`TaskSource`): the Omniglot experiment's episodic sampler,
or any other protocol that draws task indices from a generator and builds tasks from
them. Every index is drawn up front, in one call, so the tasks a seed means do not
depend on how many are built and adapted at a time (``chunk``), nor on the number of
processes: under ``torchrun`` every rank draws the same indices, adapts its share of
each chunk, and the accuracies are gathered in task order, so every rank returns the
same numbers.

With ``one_to_one=k`` the queries of each task are classified jointly instead: assigned to
the classes one-to-one, ``k`` to a class, on the same logits (`metalearn.assignment`): a
transductive reading, reported beside the inductive accuracy, never in its place.

With ``views=V`` (test-time augmentation) each task is read as itself and as ``V - 1``
copies whose support and query images are augmented together (view ``v`` of task ``t`` by a
generator of seed `view_seed` ``(t, v)``, so the copies do not depend on ``chunk``), and the
query logits of the ``V`` readings are averaged before they are scored (`logit_accuracies`):
every copy classifies each query as its learner does, so an inductive reading stays one.

The interval is the normal approximation over tasks, ``1.96 * std / sqrt(T)`` (the
experiment's reporting, as in Finn et al., 2017, Sec. 5.2).

An ensemble (``ensemble=``: several state dicts of one learner, ``--ensemble-top-k``) scores
each task as MAML++'s reference tests its top models (HowToTrainYourMAMLPytorch,
experiment_builder.py, ``evaluated_test_set_using_the_best_models``): every model adapts to
the task and gives its query logits, the logits are averaged over the models, and a query
is right when the argmax of the average (the first class among equal maxima, as
``np.argmax``) is its label (`ensemble_accuracies`). The reference's accuracy is the mean
over all queries, which, every task having the same queries, is the mean over tasks here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch
from torch import Tensor
from tqdm import tqdm

from metalearn import distributed
from metalearn.algorithms import MetaLearner
from metalearn.assignment import assign_queries
from metalearn.data.sampler import Augmentation
from metalearn.engine import Task
from metalearn.models import evaluation_mode

__all__ = ["MAX_VIEWS", "TEST_SEED", "VAL_SEED", "VIEW_SEED", "TaskSource", "accuracy_interval",
           "augmented_view", "ensemble_accuracies", "evaluate_tasks", "logit_accuracies",
           "view_seed"]  # fmt: skip

VAL_SEED = 1
"""Seed of the validation tasks: every validation of a run sees the same tasks."""
TEST_SEED = 2
"""Seed of the test tasks (a checkpoint re-evaluated with it sees the run's test tasks)."""
VIEW_SEED = 3
"""Seeds test-time augmentation's copies (`view_seed`)."""
MAX_VIEWS = 64


class TaskSource(Protocol):
    """Where evaluation tasks come from (`metalearn.data.EpisodicSampler` is one)."""

    def sample_indices(self, generator: torch.Generator, tasks: int) -> tuple[Tensor, Tensor]:
        """Indices of ``tasks`` tasks, first dimension ``[tasks, ...]`` in both."""
        ...

    def tasks_from_indices(self, classes: Tensor, examples: Tensor) -> list[Task]:
        """The tasks of (a slice along the first dimension of) `sample_indices`' output."""
        ...


def evaluate_tasks(
    learner: MetaLearner,
    source: TaskSource,
    tasks: int,
    steps: int,
    generator: torch.Generator,
    *,
    chunk: int = 50,
    progress: bool | Callable[[int], object] = True,
    desc: str = "evaluate",
    ensemble: Sequence[Mapping[str, Tensor]] | None = None,
    one_to_one: int | None = None,
    views: int = 1,
    augment: Augmentation | None = None,
) -> tuple[float, float]:
    """Mean query accuracy of ``learner`` over ``tasks`` tasks, and its 95% half-width.

    Args:
        learner: adapted per task with ``learner.evaluate(tasks, steps)``.
        source: draws the tasks (see `TaskSource`).
        tasks: how many tasks ``T`` (>= 1).
        steps: inner steps on each support set (>= 0).
        generator: all task randomness; the same seed gives the same tasks.
        chunk: tasks built and adapted at a time (memory only: the result is the same).
        progress: True: a progress bar over tasks (on rank 0 only); False: none; a
            callable: called with the number of tasks after each chunk (e.g. the update of
            a bar the caller owns), times the ensemble's size with ``ensemble``: each of
            its models adapts to every task.
        desc: the bar's label.
        ensemble: state dicts of ``learner`` whose averaged query logits score each task
            (`ensemble_accuracies`; the learner is left holding the first); None: the
            learner as it is.
        one_to_one: ``k``, the queries each class of a task holds: the queries are
            assigned to the classes one-to-one (`logit_accuracies`); None: each query's
            argmax, as `MetaLearner.evaluate` scores it.
        views: ``V``, the readings of each task whose query logits are averaged: the task
            and ``V - 1`` copies through ``augment`` (see the module docstring); 1: none.
        augment: the augmentation of the copies (needed when ``views > 1``).

    Returns:
        ``(mean, ci95)``: the mean of the ``[T]`` per-task accuracies and
        `accuracy_interval` of them (NaN for one task).

    Raises:
        ValueError: ``tasks < 1``, ``steps < 0`` or ``chunk < 1``.
    """
    if tasks < 1 or steps < 0 or chunk < 1:
        raise ValueError(
            f"need tasks >= 1, steps >= 0 and chunk >= 1, got tasks={tasks}, steps={steps}, "
            f"chunk={chunk}"
        )
    if not 1 <= views <= MAX_VIEWS or (views > 1 and augment is None):
        raise ValueError(f"views must be 1..{MAX_VIEWS}, and above 1 needs an augmentation; "
                         f"got views={views}, augment={augment}")  # fmt: skip
    classes, examples = source.sample_indices(generator, tasks)
    models = 1 if ensemble is None else len(ensemble)
    accs = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(evaluation_mode(learner))  # no dropout
        if not callable(progress):
            bar = tqdm(total=tasks * models, desc=desc, unit="task", dynamic_ncols=True,
                       leave=False, disable=not (progress and distributed.is_main()))  # fmt: skip
            progress = stack.enter_context(bar).update
        for start in range(0, tasks, chunk):
            stop = min(start + chunk, tasks)
            part = distributed.shard_slice(stop - start)
            mine = slice(start + part.start, start + part.stop)
            local = torch.empty(0)
            if part.stop > part.start:
                batch = source.tasks_from_indices(classes[mine], examples[mine])
                if ensemble is None and one_to_one is None and views == 1:
                    local = learner.evaluate(batch, steps=steps)[1].detach().cpu()
                else:
                    copies = None if views == 1 else (views, augment, mine.start)
                    local = logit_accuracies(learner, ensemble, batch, steps, one_to_one, copies)
            accs.append(distributed.gather_tensor(local.float()))
            progress((stop - start) * models)
    acc = torch.cat(accs).double()
    return acc.mean().item(), accuracy_interval(acc)


def accuracy_interval(accuracies: Tensor) -> float:
    """95% half-width of the mean of ``accuracies [T]``: ``1.96 * std / sqrt(T)`` (NaN if T=1)."""
    if len(accuracies) < 2:
        return float("nan")
    return 1.96 * accuracies.double().std().item() / math.sqrt(len(accuracies))


def ensemble_accuracies(
    learner: MetaLearner, states: Sequence[Mapping[str, Tensor]], tasks: Sequence[Task], steps: int
) -> Tensor:
    """Query accuracy of each task under the ensemble of ``states``, ``[T]`` (float64).

    Each state is loaded into ``learner`` in turn and gives every task's query logits
    (`MetaLearner.query_logits`, ``[Q, C]``); their mean over the states, in float64, is
    argmaxed (the first of equal maxima). A task whose mean logits are not finite scores
    NaN. ``learner`` is left holding ``states[0]``.

    Raises:
        ValueError: no states.
    """
    if not states:
        raise ValueError("an ensemble needs at least one set of weights")
    return logit_accuracies(learner, states, tasks, steps)


def logit_accuracies(
    learner: MetaLearner,
    states: Sequence[Mapping[str, Tensor]] | None,
    tasks: Sequence[Task],
    steps: int,
    one_to_one: int | None = None,
    copies: tuple[int, Augmentation, int] | None = None,
) -> Tensor:
    """Query accuracy of each task from its query logits, ``[T]`` (float64).

    The logits (`MetaLearner.query_logits`, ``[Q, C]``) are the learner's as it is
    (``states`` None) or their mean in float64 over the ``states`` loaded in turn (the
    learner is left holding ``states[0]``); with ``copies=(V, augment, first)``, each state's
    are the mean over the task and its ``V - 1`` augmented copies (`augmented_view`, the
    tasks numbered from ``first``). Each query's class is their argmax (the first of equal
    maxima), or, with ``one_to_one=k``, the class `metalearn.assignment.assign_queries`
    gives it, ``k`` queries to a class. A task whose logits are not finite scores NaN.
    """
    views, augment, first = copies or (1, None, 0)
    readings = [
        [task] + [augmented_view(task, augment, view_seed(first + t, v)) for v in range(1, views)]
        for t, task in enumerate(tasks)
    ]
    total: list[Tensor] = []
    for state in reversed(states or [None]):  # ends on states[0]
        if state is not None:
            learner.load_state_dict(state)
        logits = [sum(learner.query_logits(view, steps).detach().double().cpu() for view in task)
                  for task in readings]  # fmt: skip
        total = logits if not total else [a + b for a, b in zip(total, logits, strict=True)]
    accs = []
    for summed, task in zip(total, tasks, strict=True):
        mean = summed / (len(states or [None]) * views)
        if not mean.isfinite().all():
            accs.append(torch.tensor(float("nan"), dtype=torch.float64))
            continue
        chosen = mean.argmax(dim=-1) if one_to_one is None else assign_queries(mean, one_to_one)
        accs.append((chosen == task.query[1].cpu()).double().mean())
    return torch.stack(accs) if accs else torch.empty(0, dtype=torch.float64)


def view_seed(task: int, view: int) -> int:
    """The seed of copy ``view`` (1..`MAX_VIEWS` - 1) of evaluation task ``task``."""
    return (VIEW_SEED * 2**32 + task) * MAX_VIEWS + view


def augmented_view(task: Task, augment: Augmentation, seed: int) -> Task:
    """``task`` with its support and query images through ``augment`` (one generator of
    ``seed``, the support first), labels and control flow unchanged."""
    (xs, ys), (xq, yq) = task.support, task.query
    generator = torch.Generator(device=xs.device).manual_seed(seed)
    return dataclasses.replace(task, support=(augment(xs, generator), ys),
                               query=(augment(xq, generator), yq))  # fmt: skip
