"""`metalearn.top_eigenvalues` (Lanczos, power) against `eigvalsh` of the dense Hessian."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from metalearn.functional import flatten_tree
from metalearn.second_order import HVP_METHODS, top_eigenvalues
from tests.second_order.second_order_problems import F64, dense_hessian, gen, make_problem


def _quadratic_with_spectrum(eigs, seed):
    n = len(eigs)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen(seed), dtype=F64))
    A = Q @ torch.diag(torch.tensor(eigs, dtype=F64)) @ Q.T
    A = (A + A.T) / 2
    x = torch.randn(n, generator=gen(seed + 1), dtype=F64)
    return (lambda z: 0.5 * z @ A @ z), x, A


def _check_eigenpairs(result, H, k):
    assert result.eigenvalues.shape == (k,)
    assert len(result.eigenvectors) == k
    for lam, vec in zip(result.eigenvalues, result.eigenvectors):
        u = flatten_tree(vec)
        assert abs(float(u.norm()) - 1) < 1e-10
        assert float((H @ u - lam * u).norm()) <= 1e-5 * abs(float(lam))


@pytest.mark.parametrize("name", ["mlp", "conv_bn"])
def test_lanczos_top_eigenvalues_match_eigvalsh(name):
    f, params = make_problem(name)
    H = dense_hessian(name)
    expected = torch.linalg.eigvalsh(H).flip(0)[:3]  # largest algebraic first
    result = top_eigenvalues(f, params, k=3, method="lanczos", which="LA", generator=gen(80))
    torch.testing.assert_close(result.eigenvalues, expected, rtol=1e-6, atol=0)
    _check_eigenpairs(result, H, 3)


@pytest.mark.parametrize("method", ["lanczos", "power"])
def test_largest_magnitude_eigenvalues_match_eigvalsh(method):
    f, params = make_problem("mlp")
    H = dense_hessian("mlp")
    evals = torch.linalg.eigvalsh(H)
    expected = evals[evals.abs().argsort(descending=True)][:2]
    result = top_eigenvalues(
        f, params, k=2, method=method, which="LM", max_iter=1000, tol=1e-12, generator=gen(81)
    )
    torch.testing.assert_close(result.eigenvalues, expected, rtol=1e-6, atol=0)
    _check_eigenpairs(result, H, 2)


@pytest.mark.parametrize("hvp_method", HVP_METHODS)
def test_top_eigenvalue_with_each_hvp_method(hvp_method):
    f, params = make_problem("transposed")
    expected = torch.linalg.eigvalsh(dense_hessian("transposed"))[-1]
    result = top_eigenvalues(f, params, generator=gen(82), hvp_method=hvp_method)
    torch.testing.assert_close(result.eigenvalues[0], expected, rtol=1e-6, atol=0)


def test_lanczos_repeated_eigenvalues():
    # A single Krylov space sees one copy of a repeated eigenvalue; Lanczos must restart
    # after the breakdown instead of returning [3, 1] (or NaN when k exceeds its dimension).
    f, x, A = _quadratic_with_spectrum([3.0, 3.0, 1.0, 1.0, 0.5, 0.2], seed=83)
    result = top_eigenvalues(f, x, k=3, generator=gen(84))
    torch.testing.assert_close(result.eigenvalues, torch.tensor([3.0, 3.0, 1.0], dtype=F64))
    _check_eigenpairs(result, A, 3)
    identity = top_eigenvalues(lambda z: 0.5 * z @ z, x, k=2, generator=gen(85))
    torch.testing.assert_close(identity.eigenvalues, torch.ones(2, dtype=F64))


def test_lanczos_is_scale_free():
    eigs = [5.0, 4.0, 2.0, 1.0, -1.0, 0.5, 0.1]
    f, x, A = _quadratic_with_spectrum([1e-12 * e for e in eigs], seed=86)
    result = top_eigenvalues(f, x, k=2, generator=gen(87))
    torch.testing.assert_close(result.eigenvalues, torch.tensor([5e-12, 4e-12], dtype=F64))
    _check_eigenpairs(result, A, 2)


def test_top_eigenvalues_reproducible_and_ordered_dict():
    f, params = make_problem("mlp")
    a = top_eigenvalues(f, params, k=2, generator=gen(88))
    b = top_eigenvalues(f, OrderedDict(params), k=2, generator=gen(88))
    assert torch.equal(a.eigenvalues, b.eigenvalues)
    assert a.iterations == b.iterations
    assert type(b.eigenvectors[0]) is OrderedDict


def test_top_eigenvalues_bad_arguments():
    f, params = make_problem("mlp")
    with pytest.raises(ValueError, match="k must be between 1"):
        top_eigenvalues(f, params, k=0)
    with pytest.raises(ValueError, match=r"number of parameters \(38\)"):
        top_eigenvalues(f, params, k=39)
    with pytest.raises(ValueError, match="use which='LM' or method='lanczos'"):
        top_eigenvalues(f, params, method="power", which="LA")
    with pytest.raises(ValueError, match="which must be"):
        top_eigenvalues(f, params, which="SA")
    with pytest.raises(ValueError, match="unknown method"):
        top_eigenvalues(f, params, method="arnoldi")
