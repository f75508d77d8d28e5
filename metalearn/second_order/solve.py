"""Conjugate gradient: solve (A + damping I) x = b from matrix-vector products only."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, NamedTuple, get_args

import torch

from metalearn.functional import Tree, tree_axpy, tree_dot, tree_map
from metalearn.second_order._checks import check_like, check_params

__all__ = ["NEGATIVE_CURVATURE_POLICIES", "CGResult", "NegativeCurvature",
           "check_negative_curvature", "conjugate_gradient"]  # fmt: skip

NegativeCurvature = Literal["raise", "continue", "stop"]
NEGATIVE_CURVATURE_POLICIES: tuple[str, ...] = get_args(NegativeCurvature)
"""What CG does at a direction of non-positive curvature ``p'(A + damping I)p <= 0``."""


def check_negative_curvature(policy: str, name: str = "on_negative_curvature") -> None:
    """Refuse a policy that is none of `NEGATIVE_CURVATURE_POLICIES`.

    Raises:
        ValueError: naming ``name`` (the argument that carries it) and the choices.
    """
    if policy not in NEGATIVE_CURVATURE_POLICIES:
        raise ValueError(
            f"unknown {name} {policy!r}; choose one of {', '.join(NEGATIVE_CURVATURE_POLICIES)}"
        )


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
    negative_curvature: int | None = None
    """The iteration (0-based) at which CG first met ``p'(A + damping I)p <= 0``; None when
    it met none (always None under ``on_negative_curvature="raise"``, which raises there)."""


def conjugate_gradient(
    matvec: Callable[[Tree], Tree],
    b: Tree,
    *,
    damping: float = 0.0,
    max_iter: int = 100,
    tol: float = 1e-10,
    atol: float = 0.0,
    x0: Tree | None = None,
    on_negative_curvature: NegativeCurvature = "raise",
) -> CGResult:
    """Solve (A + damping·I) x = b for symmetric positive-definite A given only x -> A x.

    Hestenes & Stiefel (1952), on trees of tensors so ``matvec`` can be an HVP over a
    parameter dict. Used by iMAML (Rajeswaran et al., 2019, Eq. 7) with
    ``A = H / lambda`` and ``damping = 1``.

    On an indefinite A a search direction p can have curvature ``p'(A + damping I)p <= 0``,
    where CG's derivation (minimising ``x'Ax/2 - b'x`` along p) no longer holds.
    ``on_negative_curvature`` says what happens there:

    * ``"raise"``: a ValueError naming the curvature and the iteration;
    * ``"continue"``: the plain recurrence regardless, the step ``alpha = r'r / p'Ap``
      negative (it still solves the system if no ``p'Ap`` is 0: CG's iterates are
      Krylov-subspace Galerkin solutions whatever the sign); it stops on the residual or
      ``max_iter`` only. An exactly zero ``p'Ap`` leaves alpha undefined (division by zero):
      CG stops there with the iterate it has, as ``"stop"`` does;
    * ``"stop"``: truncated CG (Newton-CG; Nocedal & Wright, Numerical Optimization, 2nd ed.,
      Alg. 7.1): the iterate reached before the direction of non-positive curvature; at the
      first iteration, where that iterate is ``x0`` (0), the algorithm's steepest-descent
      step ``x0 + r0`` (``b`` itself from 0: ``-grad f`` of ``f = x'Ax/2 - b'x``, unscaled),
      whose residual ``r0 - A r0`` uses the product already made. Unlike CG's iterates this
      step depends on how the system is scaled (``cA x = cb`` gives ``b``, not ``b / c``):
      pose the system on the scale whose ``b`` is the answer wanted (iMAML: Eq. 7's
      ``I + H/lam``, whose first answer is the query gradient, first-order MAML's).

    Args:
        matvec: ``x -> A x`` on trees shaped like ``b``.
        b: right-hand side (tree of tensors, leaves ``[*b_i]``).
        damping: the ``damping * I`` added to A (regularises an indefinite Hessian).
        max_iter: the most matrix-vector products to use.
        tol: stop when ``||r|| <= tol * ||b||`` (relative residual) ...
        atol: ... or when ``||r|| <= atol``.
        x0: starting point (zeros by default).
        on_negative_curvature: ``"raise"`` (default), ``"continue"`` or ``"stop"`` (above).

    Returns:
        A `CGResult` with the solution tree ``x``, matrix-vector products used, final
        residual norm, whether the tolerance was met and where non-positive curvature was met.
    """
    check_params(b, "b")
    if x0 is not None:
        check_like(b, x0, "x0")
    if max_iter < 1:
        raise ValueError(f"max_iter must be >= 1, got {max_iter}")
    if damping < 0:
        raise ValueError(f"damping must be >= 0, got {damping}; CG needs A + damping I to be SPD")
    check_negative_curvature(on_negative_curvature)

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
        iterations, met = 0, None
        while iterations < max_iter and math.sqrt(float(rs)) > threshold:
            ap = apply(p)
            curvature = tree_dot(p, ap)
            if float(curvature) <= 0:
                if on_negative_curvature == "raise":
                    raise ValueError(
                        f"CG met non-positive curvature p'Ap = {float(curvature):.3e} at "
                        f"iteration {iterations}: the matrix is not positive definite; add "
                        "damping"
                    )
                met = iterations if met is None else met
                if on_negative_curvature == "stop" or float(curvature) == 0:
                    if on_negative_curvature == "stop" and iterations == 0:
                        x, r = tree_axpy(1.0, p, x), tree_axpy(-1.0, ap, r)
                        rs = tree_dot(r, r)
                    iterations += 1  # the product that found the curvature
                    break
            alpha = rs / curvature
            x = tree_axpy(alpha, p, x)
            r = tree_axpy(-alpha, ap, r)
            rs_new = tree_dot(r, r)
            p = tree_axpy(rs_new / rs, p, r)
            rs = rs_new
            iterations += 1
    residual = math.sqrt(float(rs))
    return CGResult(x, iterations, residual, residual <= threshold, met)
