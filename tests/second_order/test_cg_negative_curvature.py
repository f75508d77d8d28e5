"""`conjugate_gradient`'s ``on_negative_curvature`` policies against written-out float64 maths.

"continue": the plain Hestenes-Stiefel recurrence (aravindr93/imaml_dev's ``cg_solve``),
checked against the Krylov-subspace Galerkin solution it computes on an indefinite matrix
and against ``torch.linalg.solve`` after n steps; "stop": truncated CG (Nocedal & Wright,
Alg. 7.1), the iterate before the first direction of non-positive curvature (``b`` when it
is the first); on a positive-definite matrix the three agree with ``torch.linalg.solve``.
"""

from __future__ import annotations

import pytest
import torch

from metalearn.functional import flatten_tree, unflatten_like
from metalearn.second_order import conjugate_gradient
from tests.helpers.written_out_cg import first_negative_curvature, written_out_cg
from tests.second_order.second_order_problems import F64, gen

POLICIES = ("raise", "continue", "stop")


def _symmetric(eigenvalues: list[float], seed: int) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(len(eigenvalues), len(eigenvalues), generator=gen(seed),
                                       dtype=F64))  # fmt: skip
    return q @ torch.diag(torch.tensor(eigenvalues, dtype=F64)) @ q.T


def _galerkin(a: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    """The x in the Krylov space K_k(A, b) with b - Ax orthogonal to it: CG's k-th iterate."""
    basis = torch.stack([torch.linalg.matrix_power(a, i) @ b for i in range(k)], 1)
    v, _ = torch.linalg.qr(basis)
    return v @ torch.linalg.solve(v.T @ a @ v, v.T @ b)


INDEFINITE = _symmetric([-3.0, -1.0, 0.5, 2.0, 4.0, 7.0], seed=301)
B = torch.randn(6, generator=gen(302), dtype=F64)


def test_the_indefinite_example_meets_negative_curvature_after_the_first_step() -> None:
    curvatures = [c for _, c in written_out_cg(INDEFINITE, B, 6)[:-1]]
    assert curvatures[0] > 0 and min(curvatures) < 0
    assert torch.linalg.eigvalsh(INDEFINITE).min() < 0


@pytest.mark.parametrize("steps", [2, 3, 4, 5])
def test_continue_is_the_plain_recurrence(steps: int) -> None:
    result = conjugate_gradient(lambda x: INDEFINITE @ x, B, max_iter=steps, tol=1e-14,
                                on_negative_curvature="continue")  # fmt: skip
    written = written_out_cg(INDEFINITE, B, steps)
    torch.testing.assert_close(result.x, written[-1][0], rtol=0, atol=1e-10)
    torch.testing.assert_close(result.x, _galerkin(INDEFINITE, B, steps), rtol=0, atol=1e-10)
    first = first_negative_curvature(written)
    assert result.negative_curvature == first and result.iterations == steps
    true = float((B - INDEFINITE @ result.x).norm())
    assert abs(result.residual_norm - true) <= 1e-10 * float(B.norm())


def test_continue_solves_an_indefinite_system_in_n_steps() -> None:
    result = conjugate_gradient(lambda x: INDEFINITE @ x, B, max_iter=6, tol=1e-9,
                                on_negative_curvature="continue")  # fmt: skip
    assert result.converged and result.negative_curvature is not None
    torch.testing.assert_close(result.x, torch.linalg.solve(INDEFINITE, B), rtol=0, atol=1e-9)


def test_stop_returns_the_iterate_before_negative_curvature() -> None:
    written = written_out_cg(INDEFINITE, B, 6)
    first = first_negative_curvature(written)
    result = conjugate_gradient(lambda x: INDEFINITE @ x, B, max_iter=6, tol=1e-14,
                                on_negative_curvature="stop")  # fmt: skip
    assert first > 0 and result.negative_curvature == first
    torch.testing.assert_close(result.x, written[first][0], rtol=0, atol=1e-12)
    torch.testing.assert_close(result.x, _galerkin(INDEFINITE, B, first), rtol=0, atol=1e-10)
    assert result.iterations == first + 1  # the products, the one that found it included
    assert not result.converged
    true = float((B - INDEFINITE @ result.x).norm())
    assert abs(result.residual_norm - true) <= 1e-10 * float(B.norm())


def test_stop_at_the_first_iteration_returns_b() -> None:
    """b'Ab < 0: Alg. 7.1's ``j = 0`` case, the steepest-descent direction b itself."""
    a = torch.diag(torch.tensor([1.0, -5.0, 2.0], dtype=F64))
    b = torch.tensor([1.0, 1.0, 0.5], dtype=F64)
    assert float(b @ a @ b) < 0
    result = conjugate_gradient(lambda x: a @ x, b, on_negative_curvature="stop")
    assert torch.equal(result.x, b)
    assert (result.negative_curvature, result.iterations, result.converged) == (0, 1, False)
    assert result.residual_norm == pytest.approx(float((b - a @ b).norm()), rel=1e-14)


@pytest.mark.parametrize("policy", ["continue", "stop"])
def test_exactly_zero_curvature_stops_with_the_iterate_it_has(policy: str) -> None:
    """p'Ap = 0 leaves alpha undefined: "continue" keeps x0 = 0, "stop" takes b (j = 0)."""
    a = torch.diag(torch.tensor([1.0, -1.0], dtype=F64))
    b = torch.ones(2, dtype=F64)
    result = conjugate_gradient(lambda x: a @ x, b, on_negative_curvature=policy)
    expected = torch.zeros(2, dtype=F64) if policy == "continue" else b
    assert torch.equal(result.x, expected) and torch.isfinite(result.x).all()
    assert (result.negative_curvature, result.iterations, result.converged) == (0, 1, False)
    assert result.residual_norm == pytest.approx(float((b - a @ expected).norm()), rel=1e-14)


def test_raise_is_the_default_and_unchanged() -> None:
    written = written_out_cg(INDEFINITE, B, 6)
    first, curvature = next((k, c) for k, (_, c) in enumerate(written[:-1]) if c <= 0)
    message = (f"CG met non-positive curvature p'Ap = {curvature:.3e} at iteration {first}: "
               "the matrix is not positive definite; add damping")  # fmt: skip
    with pytest.raises(ValueError) as raised:
        conjugate_gradient(lambda x: INDEFINITE @ x, B, max_iter=6)
    assert str(raised.value) == message


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_solves_a_positive_definite_system(policy: str) -> None:
    a = _symmetric([0.5, 1.0, 2.0, 3.0, 8.0, 20.0], seed=303)
    like = {"w": torch.zeros(2, 2, dtype=F64), "b": torch.zeros(2, dtype=F64)}
    result = conjugate_gradient(lambda x: unflatten_like(a @ flatten_tree(x), like),
                                unflatten_like(B, like), max_iter=50, tol=1e-12,
                                on_negative_curvature=policy)  # fmt: skip
    assert result.converged and result.negative_curvature is None
    torch.testing.assert_close(flatten_tree(result.x), torch.linalg.solve(a, B), rtol=0,
                               atol=1e-10)  # fmt: skip


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown on_negative_curvature 'skip'; choose one of "
                                         "raise, continue, stop"):  # fmt: skip
        conjugate_gradient(lambda x: x, B, on_negative_curvature="skip")
