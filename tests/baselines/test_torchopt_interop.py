"""metalearn against TorchOpt 0.7.3: inner Adam and RMSprop meta-gradients, implicit roots.

Inner optimizers. TorchOpt's Adam (``scale_by_adam``) computes
``m_hat / (sqrt(v_hat + eps_root) + eps)``: eps after the bias correction, as metalearn's
`metalearn.optim.Adam` and ``torch.optim.Adam`` (higher adds it before). Its RMSprop
(``scale_by_rms``) computes ``g / (sqrt(v) + eps)``, as `metalearn.optim.RMSprop`. So both
rules are metalearn's, up to ``eps_root``:

* at ``eps_root = 0`` they are identical, and so are the meta-gradients where no gradient
  entry is exactly zero (a tanh network on inputs without zero features);
* where one is (a feature that is zero in every support example zeroes its weights' inner
  gradient), ``sqrt(v)`` at ``v = 0`` has an infinite derivative, and TorchOpt's
  meta-gradient is NaN; metalearn's `metalearn.optim.safe_sqrt` takes the subgradient 0
  there. TorchOpt's Adam then needs ``eps_root > 0``: at the smallest normal float64
  (``2.2e-308``) it adds nothing to any ``v_hat`` above ``1e-292`` and ``sqrt(eps_root) =
  1.5e-154`` is nothing beside ``eps``, so the rule is still metalearn's and the
  meta-gradients agree; its RMSprop has no ``eps_root`` (its ``initial_scale`` would change
  the rule), so RMSprop is compared where no gradient entry is zero.

TorchOpt builds Adam's step count as an integer tensor and its bias correction
``1 - beta ** count`` in the default dtype, so the comparisons run with float64 as the
default dtype (with float32's, the Adam meta-gradient below differs from metalearn's by
4e-7). Both TorchOpt APIs are checked: ``MetaAdam`` / ``MetaRMSProp`` on the module
(TorchOpt's MAML example) and the functional ``torchopt.adam`` / ``rmsprop`` on a parameter
dict.

Implicit differentiation: `metalearn.implicit.root` against
``torchopt.diff.implicit.custom_root`` with the same optimality condition and solver, on ridge
regression (closed form, differentiated by autograd, as the reference) and on MetaOptNet's
logistic-regression head (a dense float64 IFT solve as the reference). The Crammer-Singer SVM
head is not compared here.

TorchOpt lives in the baselines environment: ``.venv-baselines/bin/python -m pytest -q -m
baselines``.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call

from metalearn.algorithms import MAML
from metalearn.algorithms.metaoptnet_lr import logistic_objective, newton_logistic
from metalearn.engine import Task
from metalearn.implicit import root
from tests.baselines.test_higher_interop import FEATURES, _grads, _mlp, _tasks

STEPS = 3
RTOL = 1e-12
TINY = torch.finfo(torch.float64).tiny
"""TorchOpt's Adam ``eps_root``: the smallest normal float64 (see the module docstring)."""

# name -> (metalearn's inner_optimizer and its arguments, TorchOpt's arguments)
CASES = {
    "adam": ("adam", dict(inner_beta1=0.85, inner_beta2=0.95, inner_eps=1e-3),
             dict(betas=(0.85, 0.95), eps=1e-3, eps_root=TINY)),
    "rmsprop": ("rmsprop", dict(inner_alpha=0.9, inner_eps=1e-3), dict(alpha=0.9, eps=1e-3)),
}  # fmt: skip
LR = {"adam": 0.05, "rmsprop": 0.02}


@pytest.fixture
def float64_default():
    """float64 as torch's default dtype for the test (TorchOpt's step count uses it)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def _zero_feature_tasks() -> list[Task]:
    """`_tasks` with feature 0 zero in every support example: the first layer's weights on
    it get an inner gradient of exactly zero (their query inputs keep it)."""
    tasks = []
    for task in _tasks():
        x = task.support[0].clone()
        x[:, 0] = 0.0
        tasks.append(Task(support=(x, task.support[1]), query=task.query))
    return tasks


def _torchopt_meta(kind: str, tasks: list[Task], **override) -> dict[str, Tensor]:
    """TorchOpt's MAML meta-gradient via ``MetaAdam`` / ``MetaRMSProp`` on the module."""
    import torchopt

    cls = {"adam": torchopt.MetaAdam, "rmsprop": torchopt.MetaRMSProp}[kind]
    model = _mlp()
    saved = torchopt.extract_state_dict(model, by="reference")
    for task in tasks:
        opt = cls(model, lr=LR[kind], **{**CASES[kind][2], **override})
        for _ in range(STEPS):
            opt.step(F.cross_entropy(model(task.support[0]), task.support[1]))
        (F.cross_entropy(model(task.query[0]), task.query[1]) / len(tasks)).backward()
        torchopt.recover_state_dict(model, saved)
    return _grads(model)


def _torchopt_functional(kind: str, tasks: list[Task], **override) -> dict[str, Tensor]:
    """TorchOpt's MAML meta-gradient via the functional ``torchopt.adam`` / ``rmsprop``."""
    import torchopt

    make = {"adam": torchopt.adam, "rmsprop": torchopt.rmsprop}[kind]
    optimizer = make(lr=LR[kind], **{**CASES[kind][2], **override})
    model = _mlp()
    theta = dict(model.named_parameters())
    for task in tasks:
        params, state = theta, optimizer.init(theta)
        for _ in range(STEPS):
            loss = F.cross_entropy(functional_call(model, params, task.support[0]),
                                   task.support[1])  # fmt: skip
            grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
            updates, state = optimizer.update(dict(zip(params, grads)), state, inplace=False)
            params = torchopt.apply_updates(params, updates, inplace=False)
        loss = F.cross_entropy(functional_call(model, params, task.query[0]), task.query[1])
        (loss / len(tasks)).backward()
    return _grads(model)


TORCHOPT = {"meta": _torchopt_meta, "functional": _torchopt_functional}


def _ours(kind: str, tasks: list[Task], vectorize: str) -> dict[str, Tensor]:
    name, kwargs, _ = CASES[kind]
    model = _mlp()
    learner = MAML(model, inner_lr=LR[kind], inner_steps=STEPS, vectorize=vectorize,
                   inner_optimizer=name, **kwargs)  # fmt: skip
    learner.meta_loss(tasks).loss.backward()
    return _grads(model)


def _relative(ours: dict[str, Tensor], theirs: dict[str, Tensor]) -> float:
    """``max|a - b| / max|b|`` over all parameters together."""
    error = max(float((ours[n] - t).abs().max()) for n, t in theirs.items())
    return error / max(float(t.abs().max()) for t in theirs.values())


@pytest.mark.baselines("torchopt")
@pytest.mark.parametrize("api", list(TORCHOPT))
@pytest.mark.parametrize("vectorize", ["loop", "vmap"])
@pytest.mark.parametrize("kind", list(CASES))
def test_meta_gradient_equals_torchopts(kind, vectorize, api, float64_default):
    tasks = _tasks()
    theirs = TORCHOPT[api](kind, tasks)
    ours = _ours(kind, tasks, vectorize)
    assert _relative(ours, theirs) < RTOL
    # The optimizer matters: plain SGD's meta-gradient is far from this one.
    sgd = MAML(_mlp(), inner_lr=LR[kind], inner_steps=STEPS, vectorize=vectorize)
    sgd.meta_loss(tasks).loss.backward()
    assert _relative(_grads(sgd.model), theirs) > 1e-2
    # So does eps: at 1e-3 it is not negligible beside sqrt(v_hat).
    other_eps = TORCHOPT[api](kind, tasks, eps=1e-4)
    assert _relative(ours, other_eps) > 1e-6


@pytest.mark.baselines("torchopt")
@pytest.mark.parametrize("api", list(TORCHOPT))
@pytest.mark.parametrize("vectorize", ["loop", "vmap"])
def test_adam_at_a_zero_gradient_needs_eps_root_and_then_equals_metalearns(
    vectorize, api, float64_default
):
    tasks = _zero_feature_tasks()
    ours = _ours("adam", tasks, vectorize)
    assert ours["features.0.weight"].shape[1] == FEATURES
    assert all(torch.isfinite(g).all() for g in ours.values())
    assert _relative(ours, TORCHOPT[api]("adam", tasks)) < RTOL
    # eps_root = 0: sqrt's infinite derivative at v = 0 times zero makes NaN.
    without = TORCHOPT[api]("adam", tasks, eps_root=0.0)
    assert any(torch.isnan(g).any() for g in without.values())


# ---------------------------------------------------------------------------- implicit

# TorchOpt 0.7.3's custom_root calls functorch.vjp, which torch 2.14 warns is deprecated.
FUNCTORCH_DEPRECATED = pytest.mark.filterwarnings("ignore:We've integrated functorch into PyTorch")


def _ridge_condition(w: Tensor, x: Tensor, y: Tensor, lam: Tensor) -> Tensor:
    """Ridge regression's optimality: ``grad_w (||x w - y||^2 / 2 + lam ||w||^2 / 2)``."""
    return x.T @ (x @ w - y) + lam * w


def _ridge_solve(x: Tensor, y: Tensor, lam: Tensor) -> Tensor:
    eye = torch.eye(x.shape[1], dtype=x.dtype)
    return torch.linalg.solve(x.T @ x + lam * eye, x.T @ y)


def _ridge_data() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(12, 5, generator=gen, dtype=torch.float64)
    y = torch.randn(12, 3, generator=gen, dtype=torch.float64)
    probe = torch.randn(5, 3, generator=gen, dtype=torch.float64)  # the loss's cotangent
    return x, y, torch.tensor(0.7, dtype=torch.float64), probe


def _input_grads(fn, *inputs: Tensor, probe: Tensor) -> list[Tensor]:
    leaves = [t.clone().requires_grad_() for t in inputs]
    return list(torch.autograd.grad((fn(*leaves) * probe).sum(), leaves))


@FUNCTORCH_DEPRECATED
@pytest.mark.baselines("torchopt")
def test_root_equals_torchopts_custom_root_on_ridge_regression(float64_default):
    import torchopt
    from torchopt.diff.implicit import custom_root

    x, y, lam, probe = _ridge_data()
    ours = _input_grads(root(_ridge_condition, _ridge_solve), x, y, lam, probe=probe)

    @custom_root(_ridge_condition, argnums=(1, 2, 3),
                 solve=torchopt.linear_solve.solve_cg(rtol=1e-14, maxiter=100))  # fmt: skip
    def theirs_solver(w0: Tensor, x: Tensor, y: Tensor, lam: Tensor) -> Tensor:
        return _ridge_solve(x, y, lam)

    w0 = torch.zeros(5, 3)
    theirs = _input_grads(lambda *a: theirs_solver(w0, *a), x, y, lam, probe=probe)
    exact = _input_grads(_ridge_solve, x, y, lam, probe=probe)  # the closed form, by autograd
    for a, b, c in zip(ours, theirs, exact):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _logistic_setting() -> tuple[Tensor, Tensor, Tensor, dict]:
    gen = torch.Generator().manual_seed(2)
    support = torch.randn(10, 6, generator=gen, dtype=torch.float64)
    labels = torch.arange(5).repeat(2)
    probe = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    present = torch.ones(5, dtype=torch.bool)
    kwargs = dict(labels=labels, present=present, weight_decay=0.3)
    return support, labels, probe, kwargs


@FUNCTORCH_DEPRECATED
@pytest.mark.baselines("torchopt")
def test_root_equals_torchopts_custom_root_on_metaoptnets_logistic_head(float64_default):
    import torchopt
    from torchopt.diff.implicit import custom_root

    support, labels, probe, kwargs = _logistic_setting()
    objective = partial(logistic_objective, **kwargs)

    def condition(w: Tensor, x: Tensor) -> Tensor:  # grad_W f(W, X), the head's optimality
        return torch.func.grad(objective)(w, x)

    solver = partial(newton_logistic, labels=labels, columns=5, weight_decay=0.3, tol=1e-13)
    ours = _input_grads(root(condition, solver, tol=1e-10, solve_tol=1e-14), support,
                        probe=probe)[0]  # fmt: skip

    @custom_root(condition, argnums=1,
                 solve=torchopt.linear_solve.solve_cg(rtol=1e-14, maxiter=200))  # fmt: skip
    def theirs_solver(w0: Tensor, x: Tensor) -> Tensor:
        return solver(x)

    w0 = torch.zeros(5, 6)
    theirs = _input_grads(lambda x: theirs_solver(w0, x), support, probe=probe)[0]

    # The reference: the IFT with dense Jacobians, dW*/dX = -(dF/dW)^{-1} dF/dX.
    w = solver(support)
    jac_w = torch.autograd.functional.jacobian(lambda v: condition(v, support), w).reshape(30, 30)
    jac_x = torch.autograd.functional.jacobian(lambda x: condition(w, x), support).reshape(30, 60)
    dense = -(torch.linalg.solve(jac_w.T, probe.reshape(30)) @ jac_x).reshape(10, 6)
    assert float((ours - dense).abs().max() / dense.abs().max()) < 1e-11
    assert float((ours - theirs).abs().max() / theirs.abs().max()) < 1e-11
    assert dense.abs().max() > 1e-3  # the gradient is not trivially zero
