"""Implicit differentiation of any inner solver, by the implicit function theorem.

An inner problem's solution ``x*(theta)`` is defined by an optimality condition
``F(x*, theta) = 0`` (the gradient of a convex objective, iMAML's proximal condition, a
fixed point) and found by any solver, whose steps are not differentiated. Where ``dF/dx`` is
invertible the implicit function theorem gives ``dx*/dtheta = -(dF/dx)^{-1} dF/dtheta``, so
for a loss ``L(x*)`` with cotangent ``g = dL/dx*`` (Rajeswaran et al., 2019, Eq. 5-7; Lee et
al., 2019, Sec. 3.3)::

    (dF/dx)^T u = g,        dL/dtheta = -(dF/dtheta)^T u                     (IFT)

The linear system is solved from Jacobian-vector products only; no Jacobian is formed:

* ``"cg"``: conjugate gradient (`metalearn.second_order.conjugate_gradient`) on
  ``(dF/dx)^T``, which must be symmetric positive definite: F the gradient of a strictly
  convex objective, the common case (`argmin`, where the products are HVPs);
* ``"normal-cg"``: CG on the normal equations ``(dF/dx)(dF/dx)^T u = (dF/dx) g``, for any
  invertible Jacobian (a jvp and a vjp per iteration; the condition number is squared);
* ``"neumann"``: ``u = a sum_k (I - a (dF/dx)^T)^k g`` (Lorraine et al., 2020), for a
  Jacobian whose eigenvalues ``l`` all have ``|1 - a l| < 1``; one vjp per term.

Usage::

    from metalearn.implicit import root

    def F(w, x, y):                                   # ridge regression's optimality
        return x.T @ (x @ w - y) + 0.1 * w
    def solver(x, y):                                  # any solver: not differentiated
        return torch.linalg.solve(x.T @ x + 0.1 * torch.eye(x.shape[1]), x.T @ y)

    w = root(F, solver)(x, y)                          # w*(x, y), differentiable by IFT
    w.sum().backward()                                 # x.grad, y.grad

`argmin(f, solver)` is the same for ``x* = argmin_x f(x, theta)`` (F = grad_x f, solved by
CG on HVPs of f). `implicit_vjp` is the IFT product alone, with the linear solve's report
(iMAML's meta-gradient, `metalearn.algorithms.imaml`).

Checks: the function `root` returns refuses a solver output whose residual
``||F(x*, theta)||`` exceeds ``tol`` (the IFT holds at a root only), and a linear solve that
did not reach its tolerance, each with a ValueError naming the residual and the fix.

Transforms: `root` and `argmin` return a ``torch.autograd.Function``, differentiable once
by autograd (``loss.backward()``, ``torch.autograd.grad``), which is what the engine's
meta-gradient takes. A second derivative is refused with a RuntimeError (``create_graph=True``
and ``torch.func.grad`` / ``vjp``, which differentiate with a graph: the IFT's own derivative
is not implemented), and so is ``torch.func.vmap`` (the solver and the linear solve stop on
data-dependent residuals).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor
from torch.func import grad, jvp, vjp

from metalearn.functional import Tree, tree_axpy, tree_dot, tree_leaves, tree_map, tree_unflatten
from metalearn.second_order import (
    DEFAULT_HVP_METHOD,
    HVPMethod,
    NegativeCurvature,
    conjugate_gradient,
    hvp,
)

__all__ = [
    "SOLVES",
    "LinearSolve",
    "NotPositiveDefiniteError",
    "Optimality",
    "Solve",
    "argmin",
    "implicit_vjp",
    "root",
    "solve_transposed",
]

Solve = Literal["cg", "normal-cg", "neumann"]
SOLVES: tuple[str, ...] = ("cg", "normal-cg", "neumann")


class LinearSolve(NamedTuple):
    """The solution of ``((dF/dx)^T + damping I) u = g`` and how well it was solved."""

    u: Tree
    """The solution, shaped like ``g`` (and x)."""
    iterations: int
    """Jacobian products used (CG: matrix-vector products; normal-cg: pairs of them)."""
    residual_norm: float
    """``||g - ((dF/dx)^T + damping I) u||`` at exit (CG: its recursive residual)."""
    converged: bool
    """Whether the residual reached ``tol * ||g||``."""
    negative_curvature: int | None = None
    """CG: the iteration at which it first met non-positive curvature ``p'(dF/dx)^T p <= 0``
    (under ``on_negative_curvature`` "continue" or "stop"); None when it met none, and for
    the other solves."""


class NotPositiveDefiniteError(ValueError):
    """CG met non-positive curvature: ``(dF/dx)^T`` is not symmetric positive definite."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        """CG's own message (the curvature and the iteration)."""
        super().__init__(
            f"{reason}. (dF/dx)^T is not symmetric positive definite here: for a non-symmetric "
            "Jacobian use solve='normal-cg' or 'neumann'; for an indefinite one, damping > 0"
        )


@dataclass(frozen=True)
class Optimality:
    """An optimality condition ``F(x, *theta) = 0`` and the products the IFT needs.

    Give either ``F`` (any condition; products by ``torch.func.vjp`` / ``jvp``) or
    ``objective`` (``F = grad_x objective``, whose Jacobian is the symmetric Hessian; its
    products are `metalearn.second_order.hvp` with ``hvp_method``).

    Attributes:
        F: ``F(x, *theta) -> tree shaped like x``.
        objective: ``f(x, *theta) -> Tensor[]``.
        hvp_method: how HVPs of ``objective`` are computed.
    """

    F: Callable[..., Tree] | None = None
    objective: Callable[..., Tensor] | None = None
    hvp_method: HVPMethod = DEFAULT_HVP_METHOD

    def __post_init__(self) -> None:
        if (self.F is None) == (self.objective is None):
            raise ValueError("give exactly one of F (the condition) and objective (F = its grad)")

    def residual(self, x: Tree, theta: Sequence[Tree]) -> Tree:
        """``F(x, *theta)``, shaped like x."""
        if self.F is not None:
            return self.F(x, *theta)
        return grad(self.objective)(x, *theta)

    def transposed(self, x: Tree, theta: Sequence[Tree]) -> Callable[[Tree], Tree]:
        """``u -> (dF/dx)^T u`` at ``(x, theta)``."""
        if self.objective is not None:
            return lambda u: hvp(lambda p: self.objective(p, *theta), x, u, method=self.hvp_method)
        _, pullback = vjp(lambda p: self.F(p, *theta), x)
        return lambda u: pullback(u)[0]

    def forward(self, x: Tree, theta: Sequence[Tree]) -> Callable[[Tree], Tree]:
        """``v -> (dF/dx) v`` at ``(x, theta)`` (the same as `transposed` for an objective)."""
        if self.objective is not None:
            return self.transposed(x, theta)
        return lambda v: jvp(lambda p: self.F(p, *theta), (x,), (v,))[1]

    def theta_vjp(self, x: Tree, theta: Sequence[Tree], u: Tree, wrt: Sequence[int]) -> list[Tree]:
        """``(dF/dtheta_i)^T u`` for each ``i`` in ``wrt`` (the others held constant)."""
        if not wrt:
            return []
        condition = self.F if self.F is not None else grad(self.objective)

        def of(*chosen: Tree) -> Tree:
            args = list(theta)
            for i, value in zip(wrt, chosen):
                args[i] = value
            return condition(x, *args)

        _, pullback = vjp(of, *(theta[i] for i in wrt))
        return list(pullback(u))


def solve_transposed(
    transposed: Callable[[Tree], Tree],
    g: Tree,
    *,
    method: Solve = "cg",
    forward: Callable[[Tree], Tree] | None = None,
    damping: float = 0.0,
    max_iter: int = 100,
    tol: float = 1e-10,
    neumann_step: float = 1.0,
    on_negative_curvature: NegativeCurvature = "raise",
) -> LinearSolve:
    """Solve ``(J^T + damping I) u = g`` from products ``u -> J^T u`` (and ``v -> J v``).

    Args:
        transposed: ``u -> J^T u``.
        g: the right-hand side (a tree).
        method: ``"cg"`` (J^T symmetric positive definite), ``"normal-cg"`` (needs
            ``forward``) or ``"neumann"`` (see the module docstring).
        forward: ``v -> J v``, for ``"normal-cg"``.
        damping: added to the diagonal (regularises a nearly singular J).
        max_iter: the most iterations.
        tol: stop at ``||residual|| <= tol * ||g||``.
        neumann_step: the ``a`` of the Neumann series.
        on_negative_curvature: what ``"cg"`` does at non-positive curvature (J^T not
            positive definite): ``"raise"`` a `NotPositiveDefiniteError`, ``"continue"`` the
            plain recurrence, ``"stop"`` truncated CG (`conjugate_gradient`); recorded in
            the result's ``negative_curvature``.

    Returns:
        A `LinearSolve`.

    Raises:
        ValueError: an unknown method.
        NotPositiveDefiniteError: CG met non-positive curvature under
            ``on_negative_curvature="raise"`` (J^T is not positive definite; the message
            names the non-symmetric solves).
    """
    if method not in SOLVES:
        raise ValueError(f"unknown solve {method!r}; choose one of {', '.join(SOLVES)}")

    def apply(u: Tree) -> Tree:
        out = transposed(u)
        return tree_axpy(damping, u, out) if damping else out

    if method == "cg":
        try:
            cg = conjugate_gradient(transposed, g, damping=damping, max_iter=max_iter, tol=tol,
                                    on_negative_curvature=on_negative_curvature)  # fmt: skip
        except ValueError as error:
            raise NotPositiveDefiniteError(str(error)) from None
        return LinearSolve(cg.x, cg.iterations, cg.residual_norm, cg.converged,
                           cg.negative_curvature)  # fmt: skip
    if method == "normal-cg":
        if forward is None:
            raise ValueError("solve='normal-cg' needs forward, the product v -> J v")

        def normal(u: Tree) -> Tree:  # (J + dI)(J^T + dI) u
            v = apply(u)
            out = forward(v)
            return tree_axpy(damping, v, out) if damping else out

        rhs = forward(g)
        rhs = tree_axpy(damping, g, rhs) if damping else rhs
        # CG's tolerance is relative to its own right-hand side; the caller's is to g's.
        relative = tol * _norm(g) / _norm(rhs) if _norm(rhs) > 0 else tol
        cg = conjugate_gradient(normal, rhs, max_iter=max_iter, tol=relative)
        u, iterations = cg.x, cg.iterations
    else:
        u, iterations = _neumann(apply, g, neumann_step, max_iter, tol)
    with torch.no_grad():
        residual = _norm(tree_axpy(-1.0, apply(u), g))
    return LinearSolve(u, iterations, residual, residual <= tol * _norm(g))


def _neumann(
    apply: Callable[[Tree], Tree], g: Tree, step: float, max_iter: int, tol: float
) -> tuple[Tree, int]:
    """``u = a sum_{k<K} (I - a M)^k g``; the term ``(I - a M)^K g`` is the residual
    ``g - M u``, so the series stops when it is below ``tol * ||g||``."""
    with torch.no_grad():
        u = tree_map(torch.zeros_like, g)
        term = tree_map(torch.clone, g)
        threshold, iterations = tol * _norm(g), 0
        while iterations < max_iter and _norm(term) > threshold:
            u = tree_axpy(step, term, u)
            term = tree_axpy(-step, apply(term), term)
            iterations += 1
    return u, iterations


def _norm(tree: Tree) -> float:
    return math.sqrt(max(float(tree_dot(tree, tree)), 0.0))


def implicit_vjp(
    condition: Optimality,
    x: Tree,
    theta: Sequence[Tree],
    cotangent: Tree,
    *,
    wrt: Sequence[int] | None = None,
    solve: Solve = "cg",
    damping: float = 0.0,
    max_iter: int = 100,
    tol: float = 1e-10,
    neumann_step: float = 1.0,
    on_negative_curvature: NegativeCurvature = "raise",
) -> tuple[list[Tree], LinearSolve]:
    """The IFT's product: ``dL/dtheta_i = -(dF/dtheta_i)^T u`` with ``(dF/dx)^T u = g``.

    Builds no graph and checks neither residual (`root` does): iMAML uses it at an
    approximate inner solution, as the paper does.

    Args:
        condition: ``F`` and its products.
        x: the solution ``x*`` (a tree; used as a constant).
        theta: the condition's other arguments (trees, used as constants).
        cotangent: ``g = dL/dx*``, shaped like ``x``.
        wrt: the positions in ``theta`` to differentiate (None: all).
        solve, damping, max_iter, tol, neumann_step, on_negative_curvature: the linear
            solve (`solve_transposed`).

    Returns:
        ``([dL/dtheta_i for i in wrt], LinearSolve)``.
    """
    wrt = list(range(len(theta))) if wrt is None else list(wrt)
    x, theta = _constant(x), [_constant(t) for t in theta]
    with torch.no_grad():
        solved = solve_transposed(
            condition.transposed(x, theta), cotangent, method=solve,
            forward=condition.forward(x, theta) if solve == "normal-cg" else None,
            damping=damping, max_iter=max_iter, tol=tol, neumann_step=neumann_step,
            on_negative_curvature=on_negative_curvature,
        )  # fmt: skip
        products = condition.theta_vjp(x, theta, solved.u, wrt)
    return [tree_map(torch.neg, p) for p in products], solved


def _constant(tree: Tree) -> Tree:
    return tree_map(lambda t: t.detach(), tree)


def root(
    F: Callable[..., Tree],
    solver: Callable[..., Tree],
    *,
    tol: float = 1e-6,
    solve: Solve = "cg",
    damping: float = 0.0,
    max_iter: int = 100,
    solve_tol: float = 1e-10,
    neumann_step: float = 1.0,
) -> Callable[..., Tree]:
    """``theta -> x*(theta)``, the root of ``F(x, *theta) = 0`` the solver finds,
    differentiable by the implicit function theorem.

    Args:
        F: the optimality condition, ``F(x, *theta) -> tree shaped like x`` (torch.func
            must be able to differentiate it).
        solver: ``solver(*theta) -> x``; run without a graph on detached ``theta``.
        tol: the largest residual ``||F(x*, theta)||`` accepted as a root.
        solve: how ``(dF/dx)^T u = g`` is solved (``"cg"`` needs dF/dx symmetric positive
            definite; ``"normal-cg"`` or ``"neumann"`` otherwise).
        damping, max_iter, neumann_step: of the linear solve (`solve_transposed`).
        solve_tol: the linear solve's relative tolerance; not reaching it raises.

    Returns:
        ``x_star(*theta)``: theta's leaves (tensors, dicts or tuples of them) that are
        floating point get gradients; the others are constants.
    """
    return _implicit(Optimality(F=F), solver, tol, solve=solve, damping=damping,
                     max_iter=max_iter, tol=solve_tol, neumann_step=neumann_step)  # fmt: skip


def argmin(
    objective: Callable[..., Tensor],
    solver: Callable[..., Tree],
    *,
    tol: float = 1e-6,
    damping: float = 0.0,
    max_iter: int = 100,
    solve_tol: float = 1e-10,
    hvp_method: HVPMethod = DEFAULT_HVP_METHOD,
) -> Callable[..., Tree]:
    """``theta -> argmin_x objective(x, *theta)`` as the solver finds it, differentiable by
    the IFT on ``grad_x objective = 0`` (CG on HVPs of the objective, whose Hessian must be
    positive definite at the minimum).

    Args:
        objective: ``f(x, *theta) -> Tensor[]``.
        solver: ``solver(*theta) -> x``, run without a graph.
        tol: the largest gradient norm ``||grad_x f(x*, theta)||`` accepted as a minimum.
        damping, max_iter, solve_tol: of CG (see `root`).
        hvp_method: how HVPs are computed (`metalearn.second_order.hvp`).
    """
    condition = Optimality(objective=objective, hvp_method=hvp_method)
    return _implicit(condition, solver, tol, solve="cg", damping=damping, max_iter=max_iter,
                     tol=solve_tol)  # fmt: skip


class _Problem:
    """What `_ImplicitFunction` needs besides tensors; ``x_like`` (the solution's
    structure) is filled in by its forward."""

    def __init__(self, condition: Optimality, solver: Callable[..., Tree], theta: tuple,
                 settings: dict[str, Any]) -> None:  # fmt: skip
        self.condition, self.solver, self.settings = condition, solver, settings
        self.theta_like = list(theta)
        self.spans: list[tuple[int, int]] = []
        start = 0
        for argument in theta:
            count = len(tree_leaves(argument))
            self.spans.append((start, count))
            start += count
        self.x_like: Tree = None


def _implicit(condition: Optimality, solver: Callable[..., Tree], residual_tol: float,
              **settings: Any) -> Callable[..., Tree]:  # fmt: skip
    if settings["solve"] not in SOLVES:
        raise ValueError(f"unknown solve {settings['solve']!r}; choose one of {', '.join(SOLVES)}")
    if not residual_tol > 0 or not settings["tol"] > 0:
        raise ValueError(f"tol and solve_tol must be > 0, got {residual_tol} and {settings['tol']}")

    def x_star(*theta: Tree) -> Tree:
        problem = _Problem(condition, solver, theta, {**settings, "residual_tol": residual_tol})
        outputs = _ImplicitFunction.apply(problem, *tree_leaves(list(theta)))
        return tree_unflatten(problem.x_like, outputs)

    return x_star


def _shapes(tree: Tree) -> str:
    """``(3,)`` for a tensor, ``[(3,), (2, 2)]`` for a tree: how the messages name shapes."""
    if isinstance(tree, Tensor):
        return str(tuple(tree.shape))
    return str([tuple(t.shape) for t in tree_leaves(tree)])


def _checked_residual(condition: Optimality, x: Tree, theta: Sequence[Tree]) -> Tree:
    """``F(x, *theta)`` at the solver's output, or a one-line `ValueError` naming the shapes
    when ``x`` is not shaped as the condition takes it: F raises on it, or F's output (a tree
    shaped like x, so that ``dF/dx`` is square) has other shapes."""
    name = "F(x, *theta)" if condition.F is not None else "grad objective(x, *theta)"
    try:
        residual = condition.residual(x, theta)
    except RuntimeError as error:
        said = str(error).splitlines()[0][:120]
        raise ValueError(
            f"{name} failed on the solver's output x of shape {_shapes(x)} (theta shapes "
            f"{', '.join(_shapes(t) for t in theta)}; torch said: {said}); "
            "the solver must return x of the shape the condition takes"
        ) from None
    if _shapes(residual) != _shapes(x):
        raise ValueError(
            f"the solver returned x of shape {_shapes(x)} but {name} has shape "
            f"{_shapes(residual)}; the condition must be shaped like x, so return x of the "
            "shape F is defined on from the solver (or fix F)"
        )
    return residual


class _ImplicitFunction(torch.autograd.Function):
    """Forward: the solver and the residual check; backward: the IFT (`implicit_vjp`)."""

    @staticmethod
    def forward(problem: _Problem, *leaves: Tensor) -> tuple[Tensor, ...]:
        theta = tree_unflatten(problem.theta_like, [t.detach() for t in leaves])
        with torch.no_grad():
            x = problem.solver(*theta)
            residual = _norm(_checked_residual(problem.condition, x, theta))
        tol = problem.settings["residual_tol"]
        if not residual <= tol:  # NaN included
            raise ValueError(
                f"the inner solver did not converge: ||F(x*, theta)|| = {residual:.3e} > tol "
                f"= {tol:g}; run it longer or more precisely (more iterations, a tighter "
                "stopping rule), or pass a larger tol if this residual is acceptable"
            )
        problem.x_like = x
        return tuple(t.detach() for t in tree_leaves(x))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        problem, *leaves = inputs
        ctx.problem = problem
        ctx.save_for_backward(*output, *leaves)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph=True: a second derivative was asked for
            raise RuntimeError(
                "a derivative through metalearn.implicit's IFT was asked to be differentiated "
                "again (create_graph=True), which it does not support; differentiate it once"
            )
        problem: _Problem = ctx.problem
        saved = ctx.saved_tensors
        x_leaves, theta_leaves = saved[: len(grads)], saved[len(grads) :]
        x = tree_unflatten(problem.x_like, x_leaves)
        cotangent = tree_unflatten(
            problem.x_like,
            [torch.zeros_like(t) if g is None else g for g, t in zip(grads, x_leaves)],
        )
        # An argument of theta is differentiated when its leaves are floating point and one
        # of them needs a gradient; the others are constants of F.
        wrt = [p for p, (start, count) in enumerate(problem.spans)
               if all(t.is_floating_point() for t in theta_leaves[start : start + count])
               and any(ctx.needs_input_grad[1 + start : 1 + start + count])]  # fmt: skip
        theta = tree_unflatten(problem.theta_like, list(theta_leaves))
        settings = {k: v for k, v in problem.settings.items() if k != "residual_tol"}
        products, solved = implicit_vjp(problem.condition, x, theta, cotangent, wrt=wrt,
                                        **settings)  # fmt: skip
        if not solved.converged:
            raise ValueError(
                f"the implicit gradient's linear solve ((dF/dx)^T u = g by {settings['solve']}) "
                f"did not converge: residual {solved.residual_norm:.3e} after "
                f"{solved.iterations} iterations, above solve_tol = {settings['tol']:g} "
                "relative to ||g||; raise max_iter, add damping, or loosen solve_tol"
            )
        out: list[Tensor | None] = [None] * len(theta_leaves)
        for position, tree in zip(wrt, products):
            start = problem.spans[position][0]
            for k, leaf in enumerate(tree_leaves(tree)):
                out[start + k] = leaf
        return (None, *out)
