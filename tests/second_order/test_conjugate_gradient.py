"""`metalearn.conjugate_gradient` against `torch.linalg.solve` (float64, fixed tolerances)."""

from __future__ import annotations

import pytest
import torch

from metalearn.functional import flatten_tree, tree_map, unflatten_like
from metalearn.second_order import conjugate_gradient, hvp
from tests.second_order.second_order_problems import (
    F64,
    assert_same_structure,
    dense_hessian,
    gen,
    make_problem,
    random_tree,
    rel_err,
)


def _spd(n: int, seed: int, cond_spread: float = 1.0) -> torch.Tensor:
    g = gen(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64))
    eigs = torch.logspace(0, cond_spread, n, dtype=F64)
    return Q @ torch.diag(eigs) @ Q.T


def _check_residual(result, A_flat, b_flat):
    true = float((b_flat - A_flat @ flatten_tree(result.x)).norm())
    assert abs(result.residual_norm - true) <= 1e-12 * float(b_flat.norm())


def test_cg_solves_spd_system():
    A = _spd(30, seed=70, cond_spread=2.0)
    b = torch.randn(30, generator=gen(71), dtype=F64)
    result = conjugate_gradient(lambda x: A @ x, b, tol=1e-11, max_iter=200)
    assert result.converged
    assert 1 <= result.iterations <= 200
    assert result.residual_norm <= 1e-11 * float(b.norm())
    _check_residual(result, A, b)
    assert rel_err(result.x, torch.linalg.solve(A, b)) < 1e-9


def test_cg_on_a_tree():
    A = _spd(11, seed=72, cond_spread=1.5)
    like = {"a": torch.zeros(3, dtype=F64), "b": torch.zeros(2, 4, dtype=F64)}
    b_flat = torch.randn(11, generator=gen(73), dtype=F64)
    b = unflatten_like(b_flat, like)

    def matvec(tree):
        return unflatten_like(A @ flatten_tree(tree), like)

    result = conjugate_gradient(matvec, b, tol=1e-12, max_iter=100)
    assert result.converged
    assert_same_structure(result.x, like)
    _check_residual(result, A, b_flat)
    assert rel_err(flatten_tree(result.x), torch.linalg.solve(A, b_flat)) < 1e-10


def test_cg_damping():
    # A indefinite, A + 3 I positive definite
    g = gen(74)
    Q, _ = torch.linalg.qr(torch.randn(12, 12, generator=g, dtype=F64))
    A = Q @ torch.diag(torch.linspace(-2.0, 5.0, 12, dtype=F64)) @ Q.T
    b = torch.randn(12, generator=g, dtype=F64)
    result = conjugate_gradient(lambda x: A @ x, b, damping=3.0, tol=1e-12)
    damped = A + 3.0 * torch.eye(12, dtype=F64)
    assert result.converged
    _check_residual(result, damped, b)
    assert rel_err(result.x, torch.linalg.solve(damped, b)) < 1e-10


def test_cg_with_hvp_matvec_imaml_style():
    # (I + H / lam) x = b with H the Hessian of an MLP loss, as in iMAML
    f, params = make_problem("mlp")
    lam = 4.0  # the Hessian's smallest eigenvalue is -2.18: I + H / 4 is SPD
    b = random_tree(params, seed=75)

    def matvec(t):
        return tree_map(lambda h: h / lam, hvp(f, params, t))

    result = conjugate_gradient(matvec, b, damping=1.0, tol=1e-12, max_iter=200)
    system = torch.eye(38, dtype=F64) + dense_hessian("mlp") / lam
    assert result.converged
    assert_same_structure(result.x, params)
    assert rel_err(flatten_tree(result.x), torch.linalg.solve(system, flatten_tree(b))) < 1e-9


def test_cg_non_positive_curvature_raises():
    A = torch.diag(torch.tensor([1.0, -1.0, 2.0], dtype=F64))
    b = torch.ones(3, dtype=F64)
    with pytest.raises(ValueError, match="not positive definite; add damping"):
        conjugate_gradient(lambda x: A @ x, b)


def test_cg_max_iter_reached():
    A = _spd(30, seed=76, cond_spread=4.0)
    b = torch.randn(30, generator=gen(77), dtype=F64)
    result = conjugate_gradient(lambda x: A @ x, b, max_iter=3, tol=1e-12)
    assert not result.converged
    assert result.iterations == 3
    assert result.residual_norm > 1e-12 * float(b.norm())
    _check_residual(result, A, b)


def test_cg_warm_start_and_atol():
    A = _spd(10, seed=78)
    b = torch.randn(10, generator=gen(79), dtype=F64)
    exact = torch.linalg.solve(A, b)
    result = conjugate_gradient(lambda x: A @ x, b, x0=exact, tol=1e-10)
    assert result.converged and result.iterations == 0
    assert torch.equal(result.x, exact)
    loose = conjugate_gradient(lambda x: A @ x, b, tol=0.0, atol=1e-3, max_iter=100)
    assert loose.converged and loose.residual_norm <= 1e-3
    _check_residual(loose, A, b)


def test_cg_bad_arguments():
    b = torch.ones(3, dtype=F64)
    with pytest.raises(ValueError, match="max_iter"):
        conjugate_gradient(lambda x: x, b, max_iter=0)
    with pytest.raises(ValueError, match="damping"):
        conjugate_gradient(lambda x: x, b, damping=-1.0)
