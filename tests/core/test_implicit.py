"""metalearn.implicit against independent references, in float64.

References: ridge regression's gradients written out by hand (matrix calculus, no autograd
through the solver); autograd through a solver's iterations, unrolled until they converged
(for a non-quadratic objective and for a non-symmetric fixed point); iMAML's meta-gradient
as the package computed it before `metalearn.implicit` (CG on ``I + H/lam`` from
`metalearn.second_order`). And the refusals: a solver that did not converge, a linear solve
that did not, CG on a non-symmetric Jacobian, a second derivative, vmap.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from metalearn.algorithms.imaml import IMAML, proximal_adapt
from metalearn.engine import Task
from metalearn.implicit import NotPositiveDefiniteError, Optimality, argmin, implicit_vjp, root
from metalearn.models import MLP
from metalearn.second_order import HVP_METHODS, conjugate_gradient, hvp
from tests.conftest import ROOT

F64 = torch.float64
EXACT = 1e-10


def ridge_data(seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, 4, generator=g, dtype=F64)
    return x, torch.randn(12, generator=g, dtype=F64), torch.tensor(0.7, dtype=F64)


def ridge_condition(w: Tensor, x: Tensor, y: Tensor, lam: Tensor) -> Tensor:
    """grad_w [1/2 ||x w - y||^2 + lam/2 ||w||^2] = x^T (x w - y) + lam w."""
    return x.T @ (x @ w - y) + lam * w


def ridge_objective(w: Tensor, x: Tensor, y: Tensor, lam: Tensor) -> Tensor:
    return 0.5 * ((x @ w - y) ** 2).sum() + 0.5 * lam * (w**2).sum()


def ridge_solver(x: Tensor, y: Tensor, lam: Tensor) -> Tensor:
    return torch.linalg.solve(x.T @ x + lam * torch.eye(x.shape[1], dtype=x.dtype), x.T @ y)


def ridge_reference(x: Tensor, y: Tensor, lam: Tensor, c: Tensor) -> tuple[Tensor, ...]:
    """d(c . w*)/d(x, y, lam) by hand: with A = x^T x + lam I, w = A^{-1} x^T y, u = A^{-1} c,
    dL/dx = (y - x w) u^T - x u w^T, dL/dy = x u, dL/dlam = -u . w."""
    a = x.T @ x + lam * torch.eye(x.shape[1], dtype=F64)
    w, u = torch.linalg.solve(a, x.T @ y), torch.linalg.solve(a, c)
    return torch.outer(y - x @ w, u) - torch.outer(x @ u, w), x @ u, -(u @ w)


def leaves(*tensors: Tensor) -> list[Tensor]:
    return [t.clone().requires_grad_(True) for t in tensors]


@pytest.mark.parametrize(
    ("solve", "options"),
    [("cg", {}), ("normal-cg", {}), ("neumann", {"neumann_step": 0.02, "max_iter": 20_000})],
)
def test_root_equals_the_closed_form_ridge_gradient(solve: str, options: dict) -> None:
    x, y, lam = leaves(*ridge_data())
    c = torch.linspace(-1, 1, 4, dtype=F64)
    w = root(ridge_condition, ridge_solver, solve=solve, solve_tol=1e-14, **options)(x, y, lam)
    torch.testing.assert_close(w, ridge_solver(x, y, lam).detach(), rtol=0, atol=1e-14)
    grads = torch.autograd.grad(c @ w, (x, y, lam))
    for got, expected in zip(grads, ridge_reference(x.detach(), y.detach(), lam.detach(), c)):
        torch.testing.assert_close(got, expected, rtol=0, atol=EXACT)


def test_argmin_on_hvps_equals_the_closed_form_ridge_gradient() -> None:
    x, y, lam = leaves(*ridge_data(1))
    c = torch.linspace(1, 2, 4, dtype=F64)
    for method in HVP_METHODS:
        w = argmin(ridge_objective, ridge_solver, hvp_method=method, solve_tol=1e-14)(x, y, lam)
        grads = torch.autograd.grad(c @ w, (x, y, lam))
        for got, expected in zip(grads, ridge_reference(x.detach(), y.detach(), lam.detach(), c)):
            torch.testing.assert_close(got, expected, rtol=0, atol=EXACT)


def test_trees_and_constant_arguments() -> None:
    """theta as a dict and an integer tensor: the dict's leaves get gradients, the integer
    argument is a constant of F."""
    x, y, lam = ridge_data(2)
    params = {"x": x.clone().requires_grad_(True), "lam": lam.clone().requires_grad_(True)}
    shift = torch.tensor(3)

    def condition(w: dict, p: dict, k: Tensor) -> dict:
        return {"w": ridge_condition(w["w"], p["x"], y + k, p["lam"])}

    def solver(p: dict, k: Tensor) -> dict:
        return {"w": ridge_solver(p["x"], y + k, p["lam"])}

    w = root(condition, solver)(params, shift)
    assert set(w) == {"w"}
    c = torch.ones(4, dtype=F64)
    gx, glam = torch.autograd.grad(c @ w["w"], (params["x"], params["lam"]))
    ex, _, elam = ridge_reference(x, y + shift, lam, c)
    torch.testing.assert_close(gx, ex, rtol=0, atol=EXACT)
    torch.testing.assert_close(glam, elam, rtol=0, atol=EXACT)


def logistic_objective(w: Tensor, x: Tensor) -> Tensor:
    """An L2-regularised binary logistic regression on features x: not quadratic."""
    labels = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 0.0], dtype=F64)
    return F.binary_cross_entropy_with_logits(x @ w, labels) + 0.5 * (w**2).sum()


def gradient_descent(x: Tensor, steps: int) -> Tensor:
    """Plain GD on `logistic_objective`, differentiable through every step (the unrolled
    reference; create_graph keeps each step's dependence on x)."""
    w = torch.zeros(x.shape[1], dtype=F64, requires_grad=True)
    for _ in range(steps):
        (g,) = torch.autograd.grad(logistic_objective(w, x), w, create_graph=True)
        w = w - 0.5 * g
    return w


def test_argmin_equals_unrolling_a_converged_solver() -> None:
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(3), dtype=F64)
    x.requires_grad_(True)
    c = torch.tensor([1.0, -2.0, 0.5], dtype=F64)
    unrolled = torch.autograd.grad(c @ gradient_descent(x, 200), x)[0]

    def solver(x: Tensor) -> Tensor:
        with torch.enable_grad():
            return gradient_descent(x, 200).detach()

    implicit = torch.autograd.grad(c @ argmin(logistic_objective, solver, tol=1e-13)(x), x)[0]
    torch.testing.assert_close(implicit, unrolled, rtol=0, atol=EXACT)


def fixed_point_condition(z: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """z = tanh(a z + b): a non-symmetric Jacobian I - diag(1 - z^2) a."""
    return z - torch.tanh(a @ z + b)


def iterate(a: Tensor, b: Tensor, steps: int) -> Tensor:
    z = torch.zeros_like(b)
    for _ in range(steps):
        z = torch.tanh(a @ z + b)
    return z


@pytest.mark.parametrize("solve", ["normal-cg", "neumann"])
def test_a_non_symmetric_condition_equals_unrolling(solve: str) -> None:
    g = torch.Generator().manual_seed(4)
    a = (0.4 * torch.randn(5, 5, generator=g, dtype=F64)).requires_grad_(True)
    b = torch.randn(5, generator=g, dtype=F64, requires_grad=True)
    c = torch.randn(5, generator=g, dtype=F64)
    unrolled = torch.autograd.grad(c @ iterate(a, b, 300), (a, b))
    z = root(fixed_point_condition, lambda a, b: iterate(a, b, 300), solve=solve, tol=1e-13,
             max_iter=500, solve_tol=1e-13)(a, b)  # fmt: skip
    for got, expected in zip(torch.autograd.grad(c @ z, (a, b)), unrolled):
        torch.testing.assert_close(got, expected, rtol=0, atol=EXACT)


def test_cg_on_a_non_symmetric_jacobian_names_the_other_solves() -> None:
    a = torch.tensor([[0.0, 3.0], [-3.0, 0.0]], dtype=F64, requires_grad=True)
    b = torch.tensor([0.1, -0.2], dtype=F64, requires_grad=True)

    def condition(z: Tensor, a: Tensor, b: Tensor) -> Tensor:  # Jacobian a: indefinite
        return a @ z - b

    z = root(condition, lambda a, b: torch.linalg.solve(a, b))(a, b)
    with pytest.raises(NotPositiveDefiniteError, match="solve='normal-cg' or 'neumann'"):
        z.sum().backward()


@pytest.mark.parametrize("policy", ["continue", "stop"])
def test_cg_through_negative_curvature_is_recorded(policy: str) -> None:
    """A symmetric indefinite Jacobian: "continue" runs CG through p'Ap < 0 to (dF/dx)^-1 g
    in n steps; "stop" returns the iterate before it, b itself when it is the first
    direction (conjugate_gradient's own tests check the iterates); "raise", the default,
    raises."""
    q, _ = torch.linalg.qr(torch.randn(4, 4, generator=torch.Generator().manual_seed(5),
                                       dtype=F64))  # fmt: skip
    a = q @ torch.diag(torch.tensor([-2.0, 0.5, 1.0, 3.0], dtype=F64)) @ q.T
    g = torch.tensor([1.0, -0.5, 0.25, 2.0], dtype=F64)
    condition = Optimality(F=lambda z, b: a @ z - b)  # dF/db = -I: dL/db = u = a^-1 g
    z, b = torch.linalg.solve(a, torch.ones(4, dtype=F64)), torch.ones(4, dtype=F64)
    with pytest.raises(NotPositiveDefiniteError, match="non-positive curvature"):
        implicit_vjp(condition, z, [b], g, max_iter=4)
    (grad,), solved = implicit_vjp(condition, z, [b], g, max_iter=4,
                                   on_negative_curvature=policy)  # fmt: skip
    first = conjugate_gradient(lambda u: a @ u, g, max_iter=4, on_negative_curvature=policy)
    assert solved.negative_curvature is not None
    assert solved.negative_curvature == first.negative_curvature
    if policy == "continue":
        assert solved.converged and solved.iterations == 4
        torch.testing.assert_close(grad, torch.linalg.solve(a, g), rtol=0, atol=1e-10)
    else:
        assert not solved.converged
        torch.testing.assert_close(grad, first.x, rtol=0, atol=0)


def test_a_solver_that_did_not_converge_is_named_with_its_residual() -> None:
    x, y, lam = leaves(*ridge_data())

    def three_steps(x: Tensor, y: Tensor, lam: Tensor) -> Tensor:
        w = torch.zeros(4, dtype=F64)
        for _ in range(3):
            w = w - 0.01 * ridge_condition(w, x, y, lam)
        return w

    with torch.no_grad():
        residual = float(ridge_condition(three_steps(x, y, lam), x, y, lam).norm())
    message = f"did not converge: ||F(x*, theta)|| = {residual:.3e} > tol = 1e-06; run it longer"
    with pytest.raises(ValueError, match=re.escape(message)):
        root(ridge_condition, three_steps)(x, y, lam)


WRONG_SHAPES = {
    # a column instead of a vector: F broadcasts it to a (4, 12) residual, not a large one
    "column": (lambda w: w[:, None], root, ridge_condition,
               r"^the solver returned x of shape \(4, 1\) but F\(x, \*theta\) has shape "
               r"\(4, 12\); the condition must be shaped like x"),
    # one entry too many: F cannot multiply it, named with torch's message
    "longer": (lambda w: torch.cat([w, w[:1]]), root, ridge_condition,
               r"^F\(x, \*theta\) failed on the solver's output x of shape \(5,\) \(theta "
               r"shapes \(12, 4\), \(12,\), \(\); torch said: .*\); the solver must return x "
               r"of the shape the condition takes$"),
    "argmin": (lambda w: w[:3], argmin, ridge_objective,
               r"^grad objective\(x, \*theta\) failed on the solver's output x of shape "
               r"\(3,\)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(WRONG_SHAPES))
def test_a_solver_of_the_wrong_shape_is_named_with_the_shapes(case: str) -> None:
    reshape, make, condition, message = WRONG_SHAPES[case]
    x, y, lam = leaves(*ridge_data())
    with pytest.raises(ValueError, match=message) as caught:
        make(condition, lambda *theta: reshape(ridge_solver(*theta)))(x, y, lam)
    assert "\n" not in str(caught.value)
    # the same condition with the solver's own output is accepted (the shape was the fault)
    assert make(condition, ridge_solver)(x, y, lam).shape == (4,)


def test_a_linear_solve_that_did_not_converge_raises() -> None:
    x, y, lam = leaves(*ridge_data())
    w = root(ridge_condition, ridge_solver, max_iter=1)(x, y, lam)
    with pytest.raises(ValueError, match="linear solve .* did not converge: residual .* after 1 "
                                         "iterations.*raise max_iter"):  # fmt: skip
        w.sum().backward()


def test_second_derivatives_and_vmap_are_refused() -> None:
    x, y, lam = leaves(*ridge_data())
    w = root(ridge_condition, ridge_solver)(x, y, lam)
    with pytest.raises(RuntimeError, match="differentiated again"):
        torch.autograd.grad(w.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="vmap"):
        torch.func.vmap(lambda x: root(ridge_condition, ridge_solver)(x, y, lam))(
            x.detach()[None].repeat(2, 1, 1)
        )


# --------------------------------------------------------------------------- iMAML


def imaml_before(model: nn.Module, task: Task, *, lam: float, lr: float, steps: int,
                 cg_steps: int, damping: float, method: str) -> tuple[Tensor, object]:  # fmt: skip
    """iMAML's task meta-gradient as the package computed it before metalearn.implicit: CG on
    (1 + damping) I + H/lam with H the unregularised support loss's Hessian (Eq. 7)."""
    theta = {k: v.detach() for k, v in model.named_parameters()}
    phi = proximal_adapt(model, theta, task.support, lam=lam, steps=steps, lr=lr,
                         loss_fn=F.cross_entropy)  # fmt: skip

    def loss(p: dict, data: tuple[Tensor, Tensor]) -> Tensor:
        return F.cross_entropy(functional_call(model, p, (data[0],)), data[1])

    g_query = torch.func.grad(loss)(phi, task.query)
    cg = conjugate_gradient(
        lambda u: {k: v / lam for k, v in hvp(lambda p: loss(p, task.support), phi, u,
                                               method=method).items()},
        g_query, damping=1.0 + damping, max_iter=cg_steps, tol=1e-10,
    )  # fmt: skip
    return torch.cat([v.reshape(-1) for v in cg.x.values()]), cg


@pytest.mark.parametrize("method", HVP_METHODS)
def test_imaml_on_metalearn_implicit_equals_its_meta_gradient_before(method: str) -> None:
    """Not converged (5 inner steps, 5 CG steps, damping 0.5): the same numbers, step for step."""
    torch.manual_seed(5)
    model = MLP(3, [6], 4, activation=nn.Tanh).double()
    g = torch.Generator().manual_seed(5)

    def data(n: int) -> tuple[Tensor, Tensor]:
        return torch.randn(n, 3, generator=g, dtype=F64), torch.randint(0, 4, (n,), generator=g)

    tasks = [Task(data(8), data(6)) for _ in range(3)]
    settings = dict(lam=2.0, lr=0.1, steps=5, cg_steps=5, damping=0.5, method=method)
    before = [imaml_before(model, t, **settings) for t in tasks]
    learner = IMAML(model, lam=2.0, inner_lr=0.1, inner_steps=5, cg_steps=5, cg_damping=0.5,
                    hvp_method=method)  # fmt: skip
    metrics = learner.backward(tasks)
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(got, torch.stack([b[0] for b in before]).mean(0), rtol=0, atol=EXACT)
    assert metrics.cg_iterations == sum(b[1].iterations for b in before) / 3
    assert metrics.cg_converged == sum(b[1].converged for b in before) / 3


def test_the_readme_example_runs_and_equals_the_closed_form() -> None:
    text = (ROOT / "README.md").read_text()
    (code,) = [block.split("```", 1)[0] for block in text.split("```python\n")[1:]
               if "from metalearn.implicit import root" in block]  # fmt: skip
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)  # as a user pastes it
    x, y = scope["x"].detach().double(), scope["y"].double()
    expected = ridge_reference(x, y, torch.tensor(0.1, dtype=F64), torch.ones(3, dtype=F64))[0]
    torch.testing.assert_close(scope["x"].grad.double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("solve", ["cg", "normal-cg", "neumann"])
def test_a_loss_independent_of_the_solution_gets_zero_gradients(solve: str) -> None:
    x, y, lam = leaves(*ridge_data())
    w = root(ridge_condition, ridge_solver, solve=solve, neumann_step=0.02)(x, y, lam)
    (0 * w).sum().backward()
    assert all(float(t.grad.abs().max()) == 0 for t in (x, y, lam))
