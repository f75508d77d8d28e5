"""Test-time augmentation (`evaluate_tasks(views=V)`): the mean of the query logits of each
task and its V - 1 augmented copies, against that mean written out here; the same tasks and
copies whatever the chunk; one view is the plain evaluation."""

from __future__ import annotations

import pytest
import torch

from metalearn.algorithms.registry import make_learner
from metalearn.data.augment import SmallAffine
from metalearn.engine import Task
from metalearn.models import Conv4
from metalearn.runs.evaluation import evaluate_tasks, view_seed

WAYS, SHOTS, QUERIES = 3, 2, 2


class RandomTasks:
    """A task source (`metalearn.runs.evaluation.TaskSource`): task ``i`` is random images
    drawn from seed ``i``, in [0, 1] as the samplers give them."""

    def sample_indices(self, generator: torch.Generator, tasks: int):
        return torch.randint(1000, (tasks,), generator=generator), torch.zeros(tasks)

    def tasks_from_indices(self, classes: torch.Tensor, examples: torch.Tensor) -> list[Task]:
        out = []
        for seed in classes.tolist():
            g = torch.Generator().manual_seed(seed)
            ys, yq = torch.arange(WAYS).repeat(SHOTS), torch.arange(WAYS).repeat(QUERIES)
            xs, xq = (torch.rand(len(y), 1, 16, 16, generator=g) for y in (ys, yq))
            out.append(Task((xs, ys), (xq, yq)))
        return out


@pytest.mark.parametrize("algorithm", ["maml", "protonet"])
def test_views_average_the_logits_of_each_task_and_its_copies(algorithm):
    torch.manual_seed(0)
    model = Conv4(in_channels=1, ways=WAYS, hidden=4)
    arguments = {"inner_lr": 0.3, "inner_steps": 1} if algorithm == "maml" else {}
    learner = make_learner(algorithm, model, {**arguments, "vectorize": "loop"})
    source, aug, views, tasks = RandomTasks(), SmallAffine(), 3, 5
    got = [evaluate_tasks(learner, source, tasks, 1, torch.Generator().manual_seed(4), chunk=c,
                          progress=False, views=views, augment=aug)[0] for c in (2, 5)]  # fmt: skip
    assert got[0] == got[1]  # the copies do not depend on the chunk
    drawn = source.tasks_from_indices(
        *source.sample_indices(torch.Generator().manual_seed(4), tasks)
    )
    right = []
    for t, task in enumerate(drawn):
        logits = learner.query_logits(task, 1).double()
        for v in range(1, views):
            g = torch.Generator().manual_seed(view_seed(t, v))
            copy = Task((aug(task.support[0], g), task.support[1]),
                        (aug(task.query[0], g), task.query[1]))  # fmt: skip
            logits = logits + learner.query_logits(copy, 1).double()
        right.append((logits.argmax(1) == task.query[1]).double().mean())
    assert got[0] == pytest.approx(float(torch.stack(right).mean()), abs=1e-6)  # float32 gather
    plain = evaluate_tasks(learner, source, tasks, 1, torch.Generator().manual_seed(4),
                           progress=False)  # fmt: skip
    one = evaluate_tasks(learner, source, tasks, 1, torch.Generator().manual_seed(4),
                         progress=False, views=1, augment=aug)  # fmt: skip
    assert one == plain


@pytest.mark.parametrize("views, augment", [(0, SmallAffine()), (65, SmallAffine()), (2, None)])
def test_views_out_of_range_or_without_an_augmentation_are_refused(views, augment):
    learner = make_learner("protonet", Conv4(in_channels=1, ways=WAYS, hidden=4), {})
    with pytest.raises(ValueError, match="views must be 1..64"):
        evaluate_tasks(learner, RandomTasks(), 2, 0, torch.Generator(), progress=False,
                       views=views, augment=augment)  # fmt: skip
