"""The test-time ensemble of the best validations (``--ensemble-top-k``): which weights a run
keeps (`metalearn.runs.run.top_k`), how their predictions are combined
(`metalearn.runs.evaluation.ensemble_accuracies`), and the query logits each model gives
(`MetaLearner.query_logits`).

The combination is checked against MAML++'s reference written out in numpy
(HowToTrainYourMAMLPytorch, experiment_builder.py, ``evaluated_test_set_using_the_best_models``:
``np.mean`` of the models' logits over the models, ``np.argmax`` over the classes,
``np.equal`` with the targets, ``np.mean``); the query logits against what `evaluate`
scores (its loss is their cross-entropy, its accuracy their argmax's)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from metalearn.algorithms import make_learner
from metalearn.engine import Task
from metalearn.models import Conv4
from metalearn.runs.evaluation import ensemble_accuracies
from metalearn.runs.run import top_k

F64 = torch.float64
WAYS, SHOTS = 3, 2


# --------------------------------------------------------------------------- which weights


def ranked(validations: list[tuple[int, float]], k: int) -> list[tuple[int, float]]:
    """The k best of every validation, the earlier first among equal accuracies: the
    best-validation rule (strictly better replaces) extended to k."""
    return sorted(validations, key=lambda v: (-v[1], v[0]))[:k]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_top_k_keeps_the_k_best_validations_ranked(seed, k):
    rng = random.Random(seed)
    accuracies = [rng.choice([0.2, 0.4, 0.5, 0.6, 0.8]) for _ in range(12)]  # many ties
    top, copies = [], []
    for step, acc in enumerate(accuracies, start=1):
        top = top_k(top, step, acc, k, lambda step=step: copies.append(step) or {"w": step})
    kept = [(e["iteration"], e["val"]) for e in top]
    assert kept == ranked(list(enumerate(accuracies, start=1)), k)
    assert all(e["learner"] == {"w": e["iteration"]} for e in top)
    # the first is the best-validation step: the first maximum
    assert top[0]["iteration"] == accuracies.index(max(accuracies)) + 1
    # weights are copied only for a validation that enters the top k
    so_far = [ranked(list(enumerate(accuracies[:s], 1)), k) for s in range(1, 13)]
    entered = [s for s in range(1, 13) if (s, accuracies[s - 1]) in so_far[s - 1]]
    assert copies == entered


def test_top_k_returns_a_new_list():
    """A snapshot holding the old list keeps it (`Run._take_snapshot`)."""
    old = top_k([], 1, 0.5, 2, dict)
    new = top_k(old, 2, 0.7, 2, dict)
    assert [e["iteration"] for e in old] == [1] and [e["iteration"] for e in new] == [2, 1]


# --------------------------------------------------------------------------- how combined


class Linear(nn.Module):
    """A stand-in learner whose query logits are ``x W^T + b`` of its state."""

    def __init__(self, features: int, classes: int) -> None:
        super().__init__()
        self.head = nn.Linear(features, classes)

    def query_logits(self, task: Task, steps: int | None = None) -> torch.Tensor:
        with torch.no_grad():
            return self.head(task.query[0])


def reference_accuracies(per_model_logits: list[list[np.ndarray]], targets: list[np.ndarray]):
    """experiment_builder.py's combination per task: np.mean over the models, np.argmax over
    the classes, np.equal with the targets, np.mean over the queries."""
    per_batch_preds = np.mean(np.array(per_model_logits), axis=0)  # [T, Q, C]
    per_batch_max = np.argmax(per_batch_preds, axis=2)
    return np.equal(np.array(targets), per_batch_max).mean(axis=1)


def test_ensemble_accuracies_equal_the_references_combination():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    tasks = [Task((torch.randn(4, 6, generator=g), torch.arange(4)),
                  (torch.randn(9, 6, generator=g), torch.randint(0, 4, (9,), generator=g)))
             for _ in range(5)]  # fmt: skip
    states = [Linear(6, 4).state_dict() for _ in range(3)]
    learner = Linear(6, 4)
    got = ensemble_accuracies(learner, states, tasks, steps=0)
    for name, value in learner.state_dict().items():  # left holding the first (the best)
        assert torch.equal(value, states[0][name])

    per_model = []
    for state in states:
        learner.load_state_dict(state)
        per_model.append([learner.query_logits(t).double().numpy() for t in tasks])
    want = reference_accuracies(per_model, [t.query[1].numpy() for t in tasks])
    np.testing.assert_array_equal(got.numpy(), want)
    assert 0 < want.mean() < 1  # the models disagree: not a vacuous comparison


def test_equal_mean_logits_take_the_first_class_as_np_argmax():
    """Two models whose logits average to a tie between classes 0 and 1: class 0."""
    x = torch.eye(2)
    tasks = [Task((x, torch.tensor([0, 1])), (x, torch.tensor([0, 0])))]
    a, b = Linear(2, 2), Linear(2, 2)
    with torch.no_grad():
        a.head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
        b.head.weight.copy_(torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
        a.head.bias.zero_()
        b.head.bias.zero_()
    got = ensemble_accuracies(Linear(2, 2), [a.state_dict(), b.state_dict()], tasks, 0)
    want = reference_accuracies([[a.query_logits(tasks[0]).double().numpy()],
                                 [b.query_logits(tasks[0]).double().numpy()]],
                                [np.array([0, 0])])  # fmt: skip
    assert got.tolist() == want.tolist() == [1.0]


def test_an_ensemble_needs_weights():
    with pytest.raises(ValueError, match="at least one"):
        ensemble_accuracies(Linear(2, 2), [], [], 0)


# --------------------------------------------------------------------------- each model's logits


def image_tasks(n: int = 3, seed: int = 1) -> list[Task]:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(WAYS).repeat(SHOTS)
    return [
        Task(*[(torch.randn(len(y), 1, 16, 16, generator=g, dtype=F64), y) for _ in range(2)])
        for _ in range(n)
    ]


LEARNERS = {
    "maml": {"inner_lr": 0.3, "inner_steps": 2},
    "mamlpp": {"inner_lr": 0.3, "inner_steps": 2, "msl_steps": 10, "msl_epoch_length": 1},
    "protomaml": {"inner_lr": 0.3, "inner_steps": 2},
    "metasgd": {"inner_steps": 1},
    "anil": {"inner_lr": 0.3, "inner_steps": 2},
    "imaml": {"inner_lr": 0.1, "inner_steps": 3},
}
# The learners that score queries otherwise than the network at adapted weights in the
# query's own batch: their query_logits are their own predictions (the solved head, with
# the query set's or the support set's batch-norm statistics; Reptile's query beside the
# support set).
OWN_LOGITS = {
    "protonet": {}, "protonet-support": {"transductive": False}, "r2d2": {},
    "metaoptnet": {}, "reptile": {"inner_steps": 2}, "reptile-transductive": {"inner_steps": 2,
    "transductive": True},
}  # fmt: skip


@pytest.mark.parametrize("case", list(LEARNERS) + list(OWN_LOGITS))
def test_query_logits_are_what_evaluate_scores(case):
    torch.manual_seed(0)
    algorithm, arguments = case.split("-")[0], {**LEARNERS, **OWN_LOGITS}[case]
    model = Conv4(in_channels=1, ways=WAYS, hidden=4).double()
    learner = make_learner(algorithm, model, {**arguments, "vectorize": "loop"})
    learner = learner.double()
    tasks = image_tasks()
    losses, accs = learner.evaluate(tasks, steps=3)
    for task, loss, acc in zip(tasks, losses, accs, strict=True):
        logits = learner.query_logits(task, steps=3)
        assert logits.shape == (len(task.query[1]), WAYS)
        torch.testing.assert_close(F.cross_entropy(logits, task.query[1]), loss.to(F64),
                                   rtol=1e-10, atol=1e-12)  # fmt: skip
        assert torch.equal((logits.argmax(1) == task.query[1]).to(acc.dtype).mean(), acc)
    # one model's ensemble is that model's accuracy
    one = ensemble_accuracies(learner, [learner.state_dict()], tasks, 3)
    torch.testing.assert_close(one, accs.to(F64), rtol=0, atol=1e-7)  # evaluate's: float32
