"""Hutchinson's estimate of the trace of a Hessian from Hessian-vector products."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from metalearn.functional import Tree, tree_dot, tree_map
from metalearn.second_order._checks import check_params
from metalearn.second_order._random import generator_device
from metalearn.second_order.hessian_vector import DEFAULT_HVP_METHOD, HVPMethod, hvp

__all__ = ["TraceEstimate", "hessian_trace"]


class TraceEstimate(NamedTuple):
    """Hutchinson's estimate of tr(H) with its standard error."""

    estimate: float
    """Mean of v'Hv over the probes."""
    std_error: float
    """Sample standard deviation of v'Hv divided by sqrt(samples)."""
    samples: int


def hessian_trace(
    f: Callable[[Tree], Tensor],
    params: Tree,
    samples: int = 100,
    *,
    generator: torch.Generator | None = None,
    hvp_method: HVPMethod = DEFAULT_HVP_METHOD,
) -> TraceEstimate:
    """Hutchinson's (1989) unbiased estimate of tr(H) from Rademacher probes: E[v'Hv] = tr H.

    Args:
        f: ``f(params) -> Tensor[]``.
        params: parameter tree.
        samples: number of probes (>= 2, for the standard error).
        generator: seeds the probes, so the estimate is reproducible.
        hvp_method: which `hvp` method computes each H v (default
            `DEFAULT_HVP_METHOD`, double backward).

    Returns:
        A `TraceEstimate` (estimate, standard error, samples).

    Raises:
        ValueError: ``params`` mixes dtypes or devices (named, with both dtypes), or ``f``
            runs a training-mode batch norm that tracks running statistics (see `hvp`).
    """
    check_params(params, uniform=True)
    if samples < 2:
        raise ValueError(f"samples must be >= 2 to estimate a standard error, got {samples}")
    device = generator_device(generator)
    quads = []
    for _ in range(samples):
        v = tree_map(
            lambda t: (
                torch.randint(0, 2, t.shape, generator=generator, device=device).to(t) * 2 - 1
            ),
            params,
        )
        quads.append(float(tree_dot(v, hvp(f, params, v, method=hvp_method))))
    values = torch.tensor(quads, dtype=torch.float64)
    return TraceEstimate(float(values.mean()), float(values.std() / math.sqrt(samples)), samples)
