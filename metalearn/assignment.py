"""The one-to-one assignment of a task's queries to its classes (the Hungarian method).

With every query of a task in hand and each class known to hold the same number ``k`` of
them (Lake et al.'s 20-way one-shot runs: one query a class), a transductive reader assigns
the queries to the classes jointly, so that each class receives exactly ``k``, maximising the
summed scores, instead of taking each query's argmax on its own (Polis & Ilin, 2021, read a
run this way). It is a linear assignment problem: the ``[Q, C]`` score matrix with each
class column repeated ``k`` times is a square ``[Q, Q]`` problem, solved exactly by the
Hungarian method with potentials (Kuhn, 1955; Munkres, 1957; the ``O(n^3)`` form of
Jonker & Volgenant, 1987), in float64 on the CPU: ``Q`` is a few dozen.

This is a transductive reading (a query's class depends on the other queries) and is only
ever reported beside the inductive accuracy, never in its place.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["assign_queries", "linear_assignment"]


def linear_assignment(cost: Tensor) -> Tensor:
    """The permutation minimising ``sum_i cost[i, p[i]]`` of a square cost matrix.

    The shortest-augmenting-path Hungarian method: row potentials ``u`` and column potentials
    ``v`` keep every reduced cost ``cost[i, j] - u[i] - v[j] >= 0``; each row is added by a
    Dijkstra-like search over reduced costs for the cheapest augmenting path, after which the
    potentials are updated so the matched edges have reduced cost 0 (the dual certificate of
    optimality). Ties are broken by the lowest index.

    Args:
        cost: ``[n, n]``, finite.

    Returns:
        ``p [n]`` (int64): row ``i`` is assigned column ``p[i]``; a permutation of ``0..n-1``.

    Raises:
        ValueError: ``cost`` not square or not finite.
    """
    if cost.dim() != 2 or cost.shape[0] != cost.shape[1]:
        raise ValueError(f"linear_assignment needs a square [n, n] cost, got {tuple(cost.shape)}")
    if not torch.isfinite(cost).all():
        raise ValueError("linear_assignment needs finite costs")
    n = cost.shape[0]
    a = cost.detach().double().cpu().tolist()
    u, v = [0.0] * (n + 1), [0.0] * (n + 1)  # potentials; index 0 is the virtual start
    match = [0] * (n + 1)  # match[j]: the row (1-based) holding column j, 0 if none
    for row in range(1, n + 1):
        match[0], col = row, 0
        reach, way, used = [math.inf] * (n + 1), [0] * (n + 1), [False] * (n + 1)
        while match[col] != 0:  # grow the tree until a free column is reached
            used[col] = True
            i, delta, nxt = match[col], math.inf, 0
            for j in range(1, n + 1):
                if not used[j]:
                    reduced = a[i - 1][j - 1] - u[i] - v[j]
                    if reduced < reach[j]:
                        reach[j], way[j] = reduced, col
                    if reach[j] < delta:
                        delta, nxt = reach[j], j
            for j in range(n + 1):  # shift the potentials by the cheapest step
                if used[j]:
                    u[match[j]] += delta
                    v[j] -= delta
                else:
                    reach[j] -= delta
            col = nxt
        while col:  # augment along the path back to the start
            back = way[col]
            match[col] = match[back]
            col = back
    rows = [0] * n
    for j in range(1, n + 1):
        rows[match[j] - 1] = j - 1
    return torch.tensor(rows, dtype=torch.int64)


def assign_queries(scores: Tensor, per_class: int) -> Tensor:
    """Each query's class under the one-to-one assignment maximising the summed scores.

    Args:
        scores: ``[Q, C]`` (logits or log-probabilities: any score whose sum over a
            query-to-class assignment ranks the assignments), finite.
        per_class: ``k``, the queries each class holds, ``Q = k C``.

    Returns:
        ``[Q]`` int64 classes in ``0..C-1``, each exactly ``k`` times.

    Raises:
        ValueError: ``Q != per_class * C``, or scores not finite.
    """
    queries, classes = scores.shape
    if per_class < 1 or queries != per_class * classes:
        raise ValueError(
            f"a one-to-one assignment needs {per_class} queries for each of the {classes} "
            f"classes, got {queries} queries"
        )
    columns = linear_assignment(-scores.repeat_interleave(per_class, dim=1))
    return columns // per_class
