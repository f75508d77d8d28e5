"""Conjugate gradient: solve (A + damping I) x = b from matrix-vector products only."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from metalearn.functional import Tree, tree_axpy, tree_dot, tree_map
from metalearn.second_order._checks import check_like, check_params

__all__ = ["CGResult", "conjugate_gradient"]


class CGResult(NamedTuple):
    """Solution of (A + damping I) x = b by conjugate gradient."""

    x: Tree
    """The solution, shaped like ``b``."""
    iterations: int
    """Number of matrix-vector products used."""
    residual_norm: float
    """||b - (A + damping I) x|| at exit (recursively updated residual)."""
    converged: bool
    """Whether ``residual_norm <= max(tol * ||b||, atol)`` was reached."""


def conjugate_gradient(
    matvec: Callable[[Tree], Tree],
    b: Tree,
    *,
    damping: float = 0.0,
    max_iter: int = 100,
    tol: float = 1e-10,
    atol: float = 0.0,
    x0: Tree | None = None,
) -> CGResult:
    """Solve (A + damping·I) x = b for symmetric positive-definite A given only x -> A x.

    Hestenes & Stiefel (1952), on trees of tensors so ``matvec`` can be an HVP over a
    parameter dict. Used by iMAML (Rajeswaran et al., 2019, Eq. 7) with
    ``A = H / lambda`` and ``damping = 1``.

    Args:
        matvec: ``x -> A x`` on trees shaped like ``b``.
        b: right-hand side (tree of tensors, leaves ``[*b_i]``).
        damping: the ``damping * I`` added to A (regularises an indefinite Hessian).
        max_iter: the most matrix-vector products to use.
        tol: stop when ``||r|| <= tol * ||b||`` (relative residual) ...
        atol: ... or when ``||r|| <= atol``.
        x0: starting point (zeros by default).

    Returns:
        A `CGResult` with the solution tree ``x``, iterations used, final residual norm and
        whether the tolerance was met.
    """
    check_params(b, "b")
    if x0 is not None:
        check_like(b, x0, "x0")
    if max_iter < 1:
        raise ValueError(f"max_iter must be >= 1, got {max_iter}")
    if damping < 0:
        raise ValueError(f"damping must be >= 0, got {damping}; CG needs A + damping I to be SPD")

    def apply(x: Tree) -> Tree:
        ax = matvec(x)
        return tree_axpy(damping, x, ax) if damping else ax

    with torch.no_grad():
        if x0 is None:
            x = tree_map(torch.zeros_like, b)
            r = tree_map(torch.clone, b)
        else:
            x = tree_map(torch.clone, x0)
            r = tree_axpy(-1.0, apply(x), b)
        threshold = max(tol * math.sqrt(float(tree_dot(b, b))), atol)
        p = tree_map(torch.clone, r)
        rs = tree_dot(r, r)
        iterations = 0
        while iterations < max_iter and math.sqrt(float(rs)) > threshold:
            ap = apply(p)
            curvature = tree_dot(p, ap)
            if float(curvature) <= 0:
                raise ValueError(
                    f"CG met non-positive curvature p'Ap = {float(curvature):.3e} at iteration "
                    f"{iterations}: the matrix is not positive definite; add damping"
                )
            alpha = rs / curvature
            x = tree_axpy(alpha, p, x)
            r = tree_axpy(-alpha, ap, r)
            rs_new = tree_dot(r, r)
            p = tree_axpy(rs_new / rs, p, r)
            rs = rs_new
            iterations += 1
    residual = math.sqrt(float(rs))
    return CGResult(x, iterations, residual, residual <= threshold)
