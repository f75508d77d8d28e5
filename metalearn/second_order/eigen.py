"""The extreme eigenvalues of a Hessian from Hessian-vector products: Lanczos and power.

Both only call `hvp` (through a flat ``x -> H x``), never form H, so they scale to
networks whose Hessian does not fit in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from metalearn.functional import Tree, flatten_tree, tree_leaves, unflatten_like
from metalearn.second_order._checks import check_params
from metalearn.second_order._random import generator_device
from metalearn.second_order.hessian_vector import DEFAULT_HVP_METHOD, HVPMethod, hvp

__all__ = ["EigenResult", "top_eigenvalues"]


class EigenResult(NamedTuple):
    """Extreme eigenpairs of the Hessian."""

    eigenvalues: Tensor
    """Shape ``[k]``, sorted from the most extreme (per ``which``) down."""
    eigenvectors: list[Tree]
    """k unit-norm trees shaped like params, matching ``eigenvalues``."""
    iterations: int
    """HVPs used."""


def top_eigenvalues(
    f: Callable[[Tree], Tensor],
    params: Tree,
    k: int = 1,
    *,
    method: Literal["lanczos", "power"] = "lanczos",
    which: Literal["LA", "LM"] = "LA",
    max_iter: int = 100,
    tol: float = 1e-6,
    generator: torch.Generator | None = None,
    hvp_method: HVPMethod = DEFAULT_HVP_METHOD,
) -> EigenResult:
    """The k extreme eigenvalues of the Hessian of ``f`` at ``params``, from HVPs only.

    Args:
        f: ``f(params) -> Tensor[]``.
        params: parameter tree (n scalars in all).
        k: how many eigenpairs, ``1 <= k <= n``.
        method: ``"lanczos"`` (Lanczos with full reorthogonalisation: few HVPs, both ends of
            the spectrum) or ``"power"`` (power iteration with deflation, as in PyHessian;
            finds largest-magnitude eigenvalues only).
        which: ``"LA"`` largest algebraic (the sharpest ascent directions, default) or
            ``"LM"`` largest magnitude.
        max_iter: HVP budget (Lanczos: Krylov dimension; power: per eigenvalue).
        tol: relative convergence tolerance on each eigenvalue.
        generator: seeds the random start vector(s).
        hvp_method: which `hvp` method computes each H v (default
            `DEFAULT_HVP_METHOD`, double backward).

    Returns:
        An `EigenResult` with ``eigenvalues`` of shape ``[k]`` and k eigenvector trees.
    """
    check_params(params, uniform=True)
    n = sum(t.numel() for t in tree_leaves(params))
    if not 1 <= k <= n:
        raise ValueError(f"k must be between 1 and the number of parameters ({n}), got {k}")
    if which not in ("LA", "LM"):
        raise ValueError(f"which must be 'LA' or 'LM', got {which!r}")
    flat0 = flatten_tree(params).detach()

    def matvec(x: Tensor) -> Tensor:
        return flatten_tree(hvp(f, params, unflatten_like(x, params), method=hvp_method))

    start = torch.randn(
        n, generator=generator, dtype=flat0.dtype, device=generator_device(generator)
    )
    start = start.to(flat0.device)
    if method == "lanczos":
        values, vectors, used = _lanczos(matvec, start, k, which, max_iter, tol, generator)
    elif method == "power":
        if which != "LM":
            raise ValueError(
                "power iteration converges to the largest-magnitude eigenvalues only; "
                "use which='LM' or method='lanczos'"
            )
        values, vectors, used = _power(matvec, start, k, max_iter, tol, generator)
    else:
        raise ValueError(f"unknown method {method!r}; choose 'lanczos' or 'power'")
    return EigenResult(values, [unflatten_like(vec, params) for vec in vectors], used)


def _select(theta: Tensor, k: int, which: str) -> Tensor:
    key = theta if which == "LA" else theta.abs()
    return torch.argsort(key, descending=True)[:k]


def _lanczos(
    matvec: Callable[[Tensor], Tensor],
    start: Tensor,
    k: int,
    which: str,
    max_iter: int,
    tol: float,
    generator: torch.Generator | None,
) -> tuple[Tensor, list[Tensor], int]:
    """Lanczos (1950) with full reorthogonalisation; Ritz pairs of the tridiagonal T_m."""
    n = start.numel()
    steps = min(n, max(max_iter, k))
    basis = [start / start.norm()]
    alphas: list[Tensor] = []
    betas: list[Tensor] = []
    scale = 0.0  # running lower bound on ||A||, so the breakdown test is scale-free
    for j in range(steps):
        w = matvec(basis[j])
        scale = max(scale, float(w.norm()))
        alphas.append(torch.dot(w, basis[j]))
        Q = torch.stack(basis)
        # Twice is enough (Parlett's "twice is enough") to keep Q orthonormal in floating point.
        w = w - Q.T @ (Q @ w)
        w = w - Q.T @ (Q @ w)
        beta = w.norm()
        done = j + 1 == steps
        # Breakdown: the Krylov space is invariant. Its Ritz pairs are exact, but eigenvalues
        # outside it (a second copy of a repeated eigenvalue, say) are not seen, so do not stop:
        # restart from a random direction orthogonal to the basis, with beta = 0 in T.
        breakdown = float(beta) <= 1e-10 * scale
        if j + 1 >= k and (done or ((j + 1) % 5 == 0 and not breakdown)):
            theta, S = _ritz(alphas, betas)
            idx = _select(theta, k, which)
            # Residual of Ritz pair i is |beta_j * S[last, i]| (Golub & Van Loan, Thm 10.1.3).
            resid = (beta * S[-1, idx]).abs()
            if done or bool((resid <= tol * theta[idx].abs().clamp_min(1e-30)).all()):
                vectors = torch.stack(basis).T @ S[:, idx]
                return theta[idx], list(vectors.T), j + 1
        betas.append(torch.zeros_like(beta) if breakdown else beta)
        if breakdown:
            w = torch.randn(
                n, generator=generator, dtype=w.dtype, device=generator_device(generator)
            )
            w = w.to(start.device)
            w = w - Q.T @ (Q @ w)
            w = w - Q.T @ (Q @ w)
        basis.append(w / w.norm())
    raise AssertionError("unreachable: the loop returns on its last step")


def _ritz(alphas: list[Tensor], betas: list[Tensor]) -> tuple[Tensor, Tensor]:
    T = torch.diag(torch.stack(alphas))
    if betas:
        off = torch.stack(betas)
        T = T + torch.diag(off, 1) + torch.diag(off, -1)
    return torch.linalg.eigh(T)


def _power(
    matvec: Callable[[Tensor], Tensor],
    start: Tensor,
    k: int,
    max_iter: int,
    tol: float,
    generator: torch.Generator | None,
) -> tuple[Tensor, list[Tensor], int]:
    """Power iteration, deflating found eigenvectors out of each new start vector."""
    values: list[Tensor] = []
    vectors: list[Tensor] = []
    used = 0
    for i in range(k):
        x = (
            start
            if i == 0
            else torch.randn(
                start.numel(),
                generator=generator,
                dtype=start.dtype,
                device=generator_device(generator),
            ).to(start.device)
        )
        x = _deflate(x, vectors)
        x = x / x.norm()
        value = torch.zeros((), dtype=x.dtype, device=x.device)
        for _ in range(max_iter):
            y = _deflate(matvec(x), vectors)
            used += 1
            new_value = torch.dot(x, y)  # Rayleigh quotient
            x = y / y.norm()
            converged = (new_value - value).abs() <= tol * new_value.abs().clamp_min(1e-30)
            value = new_value
            if converged:
                break
        values.append(value)
        vectors.append(x)
    return torch.stack(values), vectors, used


def _deflate(x: Tensor, vectors: list[Tensor]) -> Tensor:
    for u in vectors:
        x = x - torch.dot(u, x) * u
    return x
