"""The one-to-one assignment against brute force over every permutation."""

from __future__ import annotations

import itertools

import pytest
import torch

from metalearn.assignment import assign_queries, linear_assignment


def brute_force_cost(cost: torch.Tensor) -> float:
    n = cost.shape[0]
    return min(
        sum(float(cost[i, p[i]]) for i in range(n)) for p in itertools.permutations(range(n))
    )


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 7])
@pytest.mark.parametrize("kind", ["real", "ties"])
def test_the_assignment_is_a_permutation_of_least_cost(n, kind):
    g = torch.Generator().manual_seed(10 * n + (kind == "ties"))
    for _ in range(20):
        if kind == "real":
            cost = torch.randn(n, n, generator=g, dtype=torch.float64) * 10
        else:  # small integers: many optimal assignments
            cost = torch.randint(0, 3, (n, n), generator=g).double()
        p = linear_assignment(cost)
        assert sorted(p.tolist()) == list(range(n))
        got = float(cost[torch.arange(n), p].sum())
        assert got == pytest.approx(brute_force_cost(cost), abs=1e-9)


def test_an_identity_of_scores_is_read_back():
    scores = torch.eye(20, dtype=torch.float64)[
        torch.randperm(20, generator=torch.Generator().manual_seed(0))
    ]
    assert torch.equal(assign_queries(scores, 1), scores.argmax(1))


def test_assignment_corrects_two_queries_claiming_one_class():
    # queries 0 and 1 both prefer class 0; query 1 is the better fit for class 1 jointly
    scores = torch.tensor([[5.0, 0.0, 0.0], [4.0, 3.5, 0.0], [0.0, 0.0, 1.0]])
    assert scores.argmax(1).tolist() == [0, 0, 2]
    assert assign_queries(scores, 1).tolist() == [0, 1, 2]


def test_k_queries_a_class_each_class_gets_k_and_the_total_is_the_best():
    g = torch.Generator().manual_seed(3)
    classes, k = 3, 2
    for _ in range(10):
        scores = torch.randn(classes * k, classes, generator=g, dtype=torch.float64)
        got = assign_queries(scores, k)
        assert torch.bincount(got, minlength=classes).tolist() == [k] * classes
        best = max(
            sum(float(scores[q, c]) for q, c in enumerate(labels))
            for labels in set(itertools.permutations([c for c in range(classes) for _ in range(k)]))
        )
        assert float(scores[torch.arange(classes * k), got].sum()) == pytest.approx(best, abs=1e-9)


@pytest.mark.parametrize(
    "scores, k, match",
    [
        (torch.zeros(5, 3), 1, "needs 1 queries for each of the 3 classes, got 5"),
        (torch.zeros(6, 3), 0, "needs 0 queries"),
        (torch.full((2, 2), float("nan")), 1, "finite"),
    ],
)
def test_bad_shapes_are_one_line(scores, k, match):
    with pytest.raises(ValueError, match=match):
        assign_queries(scores, k)


def test_a_non_square_cost_is_refused():
    with pytest.raises(ValueError, match="square"):
        linear_assignment(torch.zeros(2, 3))
