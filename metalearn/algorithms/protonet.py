"""Prototypical Networks (Snell, Swersky & Zemel, 2017): the nearest class mean, no inner loop.

A class's prototype is the mean of its support features, ``c_k = mean_{y_i = k} f(x_i)``
(Eq. 1), and a query is scored by its negative squared Euclidean distance to each prototype,
``p(y = k | x) = softmax_k(-||f(x) - c_k||^2)`` (Eq. 2). The distance is a linear head up to
a term the softmax ignores::

    -||f(x) - c_k||^2 = 2 c_k . f(x) - ||c_k||^2 - ||f(x)||^2

so the head is ``W_k = 2 c_k``, ``b_k = -||c_k||^2`` (`prototype_classifier`), the same
linear form `metalearn.algorithms.protomaml` starts its inner loop from. The meta-gradient is
the query loss's gradient through the prototypes into the backbone (Eq. 4's episode loss).
"""

from __future__ import annotations

from torch import Tensor

from metalearn.algorithms.heads import HeadLearner, LinearHead, class_targets

__all__ = ["ProtoNet", "prototype_classifier"]


def prototype_classifier(support: Tensor, labels: Tensor, columns: int) -> LinearHead:
    """The nearest-prototype classifier of the support features as a linear head.

    Args:
        support: features ``[S, D]``.
        labels: classes ``[S]`` in ``0..columns-1``.
        columns: the head's rows ``C`` (a class with no example gets a zero prototype,
            masked in `LinearHead.logits`).

    Returns:
        ``W = 2 c [C, D]``, ``b = -||c||^2 [C]``, ``c`` the prototypes (Snell et al., Eq. 1).
    """
    onehot, present = class_targets(labels, columns, support.dtype)
    counts = onehot.sum(0).clamp(min=1)
    prototypes = (onehot.T @ support) / counts[:, None]
    return LinearHead(2 * prototypes, -(prototypes**2).sum(1), present)


class ProtoNet(HeadLearner):
    """Prototypical Networks: the nearest support prototype in the backbone's feature space.

    Args:
        model: the network (its linear ``head`` is replaced per task).
        head: the classifier's name.
        **kwargs: as for `metalearn.algorithms.heads.HeadLearner`.
    """

    def solve(self, support: Tensor, labels: Tensor, columns: int) -> LinearHead:
        """`prototype_classifier` of the support features."""
        return prototype_classifier(support, labels, columns)
