"""iMAML and Reptile against independent references, in float64.

iMAML: the closed-form implicit gradient of a linear-regression inner problem, the unrolled
second-order gradient through a converged proximal inner loop, and memory that does not grow
with the inner steps. Reptile: a plain torch.optim.SGD loop on a copy of the model, and the
reference code's inner loop (``openai/supervised-reptile``: TensorFlow's Adam with beta1 = 0
on mini-batches cut from a stream of shuffles) written out on a copy of the model.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.profiler import ProfilerActivity, profile

from metalearn.algorithms.base import StepMetrics
from metalearn.algorithms.imaml import IMAML, implicit_meta_gradient
from metalearn.algorithms.maml import FOMAML, MAML
from metalearn.algorithms.reptile import EVAL_SEED, Reptile
from metalearn.engine import InnerLoop, NonFiniteLossError, Task, TaskCall, task_loss
from metalearn.models import MLP
from metalearn.models.norm import MetaBatchNorm
from metalearn.second_order import HVP_METHODS
from tests.helpers.reptile_batches import mini_batches
from tests.helpers.written_out_cg import first_negative_curvature, written_out_cg

F64 = torch.float64


def _regression_tasks(gen: torch.Generator, n: int, d: int, shots: int = 12) -> list[Task]:
    def data(size: int) -> tuple[Tensor, Tensor]:
        x = torch.randn(size, d, generator=gen, dtype=F64)
        w = torch.randn(d, 1, generator=gen, dtype=F64)
        return x, x @ w + 0.1 * torch.randn(size, 1, generator=gen, dtype=F64)

    return [Task(data(shots), data(shots - 2)) for _ in range(n)]


def _classification_tasks(gen: torch.Generator, n: int, ways: int = 4, d: int = 3) -> list[Task]:
    def data(size: int) -> tuple[Tensor, Tensor]:
        return torch.randn(size, d, generator=gen, dtype=F64), torch.randint(
            0, ways, (size,), generator=gen
        )

    return [Task(data(8), data(6)) for _ in range(n)]


def _mse(out: Tensor, y: Tensor) -> Tensor:
    """F.mse_loss written out: torch 2.13's forward-mode AD breaks through F.mse_loss."""
    return ((out - y) ** 2).mean()


def _flat_grad(model: nn.Module) -> Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _flat(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# --------------------------------------------------------------------------- iMAML


def _quadratic(model: nn.Linear, data: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """MSE of a 1-output linear model as 0.5 w'Aw - b'w + c over w = [weight, bias]."""
    x, y = data
    z = torch.cat([x, torch.ones(len(x), 1, dtype=F64)], 1)
    return 2 * z.T @ z / len(x), 2 * z.T @ y[:, 0] / len(x)


@pytest.mark.parametrize(
    ("hvp_method", "damping"), [(m, 0.0) for m in HVP_METHODS] + [("forward-over-reverse", 0.5)]
)
def test_imaml_equals_the_closed_form_implicit_gradient(hvp_method: str, damping: float) -> None:
    gen = torch.Generator().manual_seed(0)
    d, lam = 4, 1.5
    model = nn.Linear(d, 1).double()
    tasks = _regression_tasks(gen, 3, d)
    theta, eye = _flat(model), torch.eye(d + 1, dtype=F64)
    lr, steps = _converging_gd(model, tasks, lam)
    expected, optima = [], []
    for task in tasks:
        a, b = _quadratic(model, task.support)
        phi = torch.linalg.solve(a + lam * eye, b + lam * theta)  # Eq. 4's minimiser
        a_q, b_q = _quadratic(model, task.query)
        # Eq. 6 times Eq. 5, with cg_damping's extra damping * I
        expected.append(torch.linalg.solve((1 + damping) * eye + a / lam, a_q @ phi - b_q))
        optima.append(phi)
    learner = IMAML(
        model, lam=lam, inner_lr=lr, inner_steps=steps, cg_steps=d + 1, cg_tol=1e-14,
        loss_fn=_mse, hvp_method=hvp_method, cg_damping=damping, eval_lam=None,
    )  # fmt: skip
    metrics = learner.backward(tasks)
    torch.testing.assert_close(_flat_grad(model), torch.stack(expected).mean(0), rtol=0, atol=1e-12)
    fast = learner.adapt(tasks[0])
    phi = torch.cat([fast["weight"][0], fast["bias"]])
    torch.testing.assert_close(phi, optima[0], rtol=0, atol=1e-12)
    assert metrics.cg_converged == 1.0 and metrics.cg_residual <= 1e-14
    assert metrics.cg_iterations <= d + 1


def _converging_gd(model: nn.Linear, tasks: list[Task], lam: float) -> tuple[float, int]:
    """A step size and step count that bring GD on every task's Eq. 4 to 1e-17 of phi*."""
    curvatures = [torch.linalg.eigvalsh(_quadratic(model, t.support)[0]) + lam for t in tasks]
    low, high = min(float(c.min()) for c in curvatures), max(float(c.max()) for c in curvatures)
    # GD with lr = 2 / (mu + L) contracts the error by (L - mu) / (L + mu) per step.
    lr, rate = 2 / (low + high), (high - low) / (high + low)
    steps = math.ceil(math.log(1e-17) / math.log(rate))
    assert steps <= 80
    return lr, steps


def test_imaml_first_order_is_the_query_gradient_at_the_optimum() -> None:
    gen = torch.Generator().manual_seed(1)
    d, lam = 3, 2.0
    model = nn.Linear(d, 1).double()
    tasks = _regression_tasks(gen, 2, d)
    theta, eye = _flat(model), torch.eye(d + 1, dtype=F64)
    expected = []
    for task in tasks:
        a, b = _quadratic(model, task.support)
        phi = torch.linalg.solve(a + lam * eye, b + lam * theta)
        a_q, b_q = _quadratic(model, task.query)
        expected.append(a_q @ phi - b_q)
    lr, steps = _converging_gd(model, tasks, lam)
    learner = IMAML(model, lam=lam, inner_lr=lr, inner_steps=steps, first_order=True,
                    loss_fn=F.mse_loss)  # fmt: skip
    metrics = learner.backward(tasks)
    torch.testing.assert_close(_flat_grad(model), torch.stack(expected).mean(0), rtol=0, atol=1e-12)
    assert metrics.cg_iterations == 0 and math.isnan(metrics.cg_residual)


def test_imaml_equals_unrolled_second_order_through_a_converged_inner_loop() -> None:
    """A tanh MLP (non-quadratic): differentiating through 80 proximal GD steps converges to
    the implicit gradient, since the unrolled Jacobian converges to (I + H/lam)^{-1}."""
    torch.manual_seed(2)
    gen = torch.Generator().manual_seed(2)
    model = MLP(2, [6], 1, activation=nn.Tanh).double()
    tasks = _regression_tasks(gen, 2, 2, shots=10)
    lam, lr, steps = 4.0, 0.2, 80
    n = sum(p.numel() for p in model.parameters())
    theta = dict(model.named_parameters())

    def proximal(fast: dict[str, Tensor]) -> Tensor:  # depends on theta: unrolled through
        return 0.5 * lam * sum(((fast[k] - theta[k]) ** 2).sum() for k in theta)

    inner = InnerLoop(steps=steps, lr=lr, loss_fn=F.mse_loss)
    losses = [task_loss(model, theta, TaskCall.of(t, inner, regularizer=proximal)).loss
              for t in tasks]  # fmt: skip
    unrolled = torch.autograd.grad(torch.stack(losses).mean(), list(theta.values()))
    learner = IMAML(model, lam=lam, inner_lr=lr, inner_steps=steps, cg_steps=n, cg_tol=1e-14,
                    cg_damping=0.0, loss_fn=_mse)  # fmt: skip
    metrics = learner.backward(tasks)
    torch.testing.assert_close(
        _flat_grad(model), torch.cat([g.reshape(-1) for g in unrolled]), rtol=0, atol=1e-10
    )
    assert metrics.cg_converged == 1.0
    torch.testing.assert_close(torch.tensor(metrics.loss, dtype=F64),
                               torch.stack(losses).mean().detach(), rtol=0, atol=1e-12)  # fmt: skip


def _peak_bytes(fn) -> int:
    """Peak of live CPU bytes allocated while ``fn`` runs (allocator events, deterministic)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def _backward_peak(make, steps: int) -> int:
    torch.manual_seed(3)
    model = MLP(8, [32], 4, activation=nn.Tanh).double()
    task = _classification_tasks(torch.Generator().manual_seed(3), 1, ways=4, d=8)[0]
    task = Task((task.support[0].repeat(4, 1), task.support[1].repeat(4)), task.query)
    learner = make(model, steps)
    return _peak_bytes(lambda: learner.backward([task]))


def test_imaml_memory_does_not_grow_with_inner_steps() -> None:
    make_imaml = lambda m, k: IMAML(m, inner_lr=0.1, inner_steps=k, cg_steps=2)  # noqa: E731
    make_maml = lambda m, k: MAML(m, inner_lr=0.1, inner_steps=k, vectorize="loop")  # noqa: E731
    imaml = [_backward_peak(make_imaml, k) for k in (2, 12)]
    maml = [_backward_peak(make_maml, k) for k in (2, 12)]
    # The meter sees growth where there is some: MAML keeps each step's [32 x 32] activations.
    assert maml[1] > maml[0] + 10 * 32 * 32 * 8, maml
    # iMAML's peak (measured: equal to the byte) does not depend on the inner steps.
    assert imaml[1] == imaml[0], imaml
    # Structurally: no graph reaches theta from phi or from the meta-gradient.
    model = MLP(8, [64], 4).double()
    task = _classification_tasks(torch.Generator().manual_seed(4), 1, d=8)[0]
    result = implicit_meta_gradient(model, dict(model.named_parameters()), task.support,
                                    task.query, inner_steps=50)  # fmt: skip
    tensors = [*result.fast.values(), *result.grad.values(), result.loss]
    assert all(t.grad_fn is None and not t.requires_grad for t in tensors)


def test_imaml_metrics_report_cg_and_evaluate_uses_the_proximal_loop() -> None:
    """With ``eval_lam=None`` evaluation solves the training problem: its query numbers are
    the meta-step's."""
    torch.manual_seed(5)
    model = MLP(3, [5], 4, activation=nn.Tanh).double()
    tasks = _classification_tasks(torch.Generator().manual_seed(5), 3)
    learner = IMAML(model, lam=2.0, inner_lr=0.3, inner_steps=10, cg_steps=1, eval_lam=None)
    metrics = learner.backward(tasks)
    assert isinstance(metrics, StepMetrics)
    assert metrics.cg_iterations == 1 and metrics.cg_converged == 0.0
    assert 0 < metrics.cg_residual < 1
    losses, accs = learner.evaluate(tasks)
    assert losses.shape == accs.shape == (3,)
    assert metrics.loss == pytest.approx(float(losses.mean()), abs=1e-12)
    assert metrics.accuracy == pytest.approx(float(accs.mean()), abs=1e-12)


def _measure_accuracy(model: nn.Module, task: Task, steps: int, lr: float, lam: float,
                      prox: float = 0.0) -> tuple[Tensor, Tensor]:  # fmt: skip
    """aravindr93/imaml_dev's test (``examples/measure_accuracy.py`` lines 72-82) written out:
    ``learn_task`` (``Learner.learn_on_data``: torch.optim.SGD at the inner rate, ``steps``
    steps on the support loss plus, here, ``prox/2 ||w - w_0||^2``; the script passes
    ``add_regularization=False``: ``prox`` 0), then ``zero_grad``, ``regularization_loss(
    meta_params, lam)`` (``0.5 lam ||w - w_0||^2``) backward and one more SGD step; the
    query loss and accuracy after."""
    clone = copy.deepcopy(model)
    w_0 = {n: p.detach().clone() for n, p in clone.named_parameters()}
    opt = torch.optim.SGD(clone.parameters(), lr=lr)

    def regularization(strength: float) -> Tensor:
        return 0.5 * strength * sum(((p - w_0[n]) ** 2).sum() for n, p in clone.named_parameters())

    for _ in range(steps):
        opt.zero_grad()
        (F.cross_entropy(clone(task.support[0]), task.support[1]) + regularization(prox)).backward()
        opt.step()
    opt.zero_grad()
    regularization(lam).backward()
    opt.step()
    with torch.no_grad():
        out = clone(task.query[0])
        return F.cross_entropy(out, task.query[1]), (out.argmax(1) == task.query[1]).double().mean()


def test_imaml_evaluates_as_the_reference_tests() -> None:
    """The default ``eval_lam`` 0 is the reference's test (``measure_accuracy.py --lam 0.0``:
    gradient descent on the support loss alone, the pull-back step at lambda 0 a zero step);
    ``eval_lam=None`` descends the training problem (the support loss plus the proximal term
    at ``lam``), which is another number."""
    torch.manual_seed(16)
    model = MLP(3, [5], 4, activation=nn.Tanh).double()
    tasks = _classification_tasks(torch.Generator().manual_seed(16), 3)
    steps, lr, lam = 16, 0.1, 2.0
    learner = IMAML(model, lam=lam, inner_lr=lr, inner_steps=steps)
    assert learner.eval_lam == 0.0
    expected = [_measure_accuracy(model, t, steps, lr, 0.0) for t in tasks]
    losses, accs = learner.evaluate(tasks)
    torch.testing.assert_close(losses, torch.stack([e[0] for e in expected]), rtol=0, atol=1e-13)
    torch.testing.assert_close(accs, torch.stack([e[1] for e in expected]).to(accs.dtype),
                               rtol=0, atol=0)  # fmt: skip
    fast = learner.adapt(tasks[0])
    clone = copy.deepcopy(model)
    clone.load_state_dict(fast)
    loss = F.cross_entropy(clone(tasks[0].query[0]), tasks[0].query[1]).detach()
    assert float(loss) == pytest.approx(float(expected[0][0]), abs=1e-13)
    training = IMAML(model, lam=lam, inner_lr=lr, inner_steps=steps, eval_lam=None)
    proximal = [_measure_accuracy(model, t, steps, lr, 0.0, prox=lam) for t in tasks]
    losses_at_lam, _ = training.evaluate(tasks)
    torch.testing.assert_close(losses_at_lam, torch.stack([e[0] for e in proximal]), rtol=0,
                               atol=1e-13)  # fmt: skip
    assert (losses_at_lam - losses).abs().max() > 1e-3  # the two tests differ


def test_imaml_rejects_bad_settings() -> None:
    model = nn.Linear(2, 1).double()
    with pytest.raises(ValueError, match=r"eval_lam must be >= 0 \(0: plain gradient descent"):
        IMAML(model, eval_lam=-1.0)
    with pytest.raises(ValueError, match="lower eval_lam below 2 / inner_lr"):
        IMAML(model, inner_lr=0.1, eval_lam=20.0)
    with pytest.raises(ValueError, match="lam must be > 0"):
        IMAML(model, lam=0.0)
    with pytest.raises(ValueError, match="lower inner_lr below 2 / lam"):
        IMAML(model, lam=10.0, inner_lr=0.4)
    with pytest.raises(ValueError, match="cg_steps must be >= 1"):
        IMAML(model, cg_steps=0)
    with pytest.raises(ValueError, match="drop adapt_keys"):
        IMAML(model, adapt_keys=["bias"])
    with pytest.raises(ValueError, match="vectorize='loop' or 'auto'"):
        IMAML(model, vectorize="vmap")
    assert not hasattr(IMAML(model), "meta_loss")  # its meta-gradient is no loss's gradient
    with pytest.raises(ValueError, match="meta-batch is empty"):
        IMAML(model).backward([])


def test_imaml_forward_mode_through_mse_loss_equals_reverse_mode() -> None:
    # torch 2.13 has no forward-mode formula for mse_loss's backward: hvp falls back, warned.
    model = nn.Linear(3, 1).double()
    tasks = _regression_tasks(torch.Generator().manual_seed(12), 2, 3)
    import metalearn.second_order as so

    so._warned_fallback = False
    with pytest.warns(RuntimeWarning, match="reverse-over-reverse"):
        IMAML(model, inner_steps=2, loss_fn=F.mse_loss, hvp_method="forward-over-reverse").backward(
            tasks
        )
    forward = _flat_grad(model).clone()
    model.zero_grad()
    IMAML(model, inner_steps=2, loss_fn=F.mse_loss).backward(tasks)
    torch.testing.assert_close(
        _flat_grad(model), forward, rtol=0, atol=1e-13
    )  # reverse-over-reverse
    reverse = _flat_grad(model).clone()
    model.zero_grad()
    IMAML(model, inner_steps=2, loss_fn=_mse, hvp_method="forward-over-reverse").backward(tasks)
    torch.testing.assert_close(_flat_grad(model), reverse, rtol=0, atol=1e-13)


def test_imaml_names_the_task_when_cg_meets_negative_curvature() -> None:
    """Maximising the MSE makes H negative definite; with lam small, I + H/lam is too.
    Under cg_negative_curvature="raise" (what every run did before the argument) the run
    stops with the message it had then."""
    model = nn.Linear(3, 1).double()
    tasks = _regression_tasks(torch.Generator().manual_seed(6), 2, 3)
    learner = IMAML(model, lam=1e-3, inner_steps=0, loss_fn=lambda o, y: -_mse(o, y),
                    cg_negative_curvature="raise")  # fmt: skip
    with pytest.raises(ValueError, match="task 0.*indefinite.*Pass cg_damping > 0"):
        learner.backward(tasks)


def _flat_support_hessian_and_query_grad(model: nn.Module, fast: dict[str, Tensor],
                                         task: Task) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Dense float64 Hessian of the support MSE at phi, and the query gradient there."""
    names = [n for n, _ in model.named_parameters()]
    flat = torch.cat([fast[n].reshape(-1) for n in names])

    def loss(v: Tensor, data: tuple[Tensor, Tensor]) -> Tensor:
        params, start = {}, 0
        for name, p in model.named_parameters():
            params[name] = v[start : start + p.numel()].reshape(p.shape)
            start += p.numel()
        return _mse(functional_call(model, params, (data[0],)), data[1])

    hessian = torch.func.hessian(loss)(flat, task.support)
    return hessian, torch.func.grad(loss)(flat, task.query)


def test_imaml_default_runs_cg_through_negative_curvature_as_the_reference() -> None:
    """A tanh MLP, small lam and large steps: at the default cg_damping (11), the first
    task's (1 + cg_damping) I + H/lam is indefinite, the second's positive definite (dense
    eigenvalues). By default iMAML's CG runs on through p'Ap <= 0 as the reference's cg_solve
    does (written out, tests.helpers.written_out_cg), so the meta-gradient is its 3-step
    iterate; the one task whose CG met non-positive curvature is reported (1/2)."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1)).double()
    gen = torch.Generator().manual_seed(4)

    def data(n: int) -> tuple[Tensor, Tensor]:
        x = torch.randn(n, 2, generator=gen, dtype=F64)
        return x, torch.sin(3 * x[:, :1]) + x[:, 1:] ** 2

    tasks = [Task(data(6), data(5)) for _ in range(2)]
    lam, steps = 0.2, 3
    learner = IMAML(model, lam=lam, inner_lr=1.0, inner_steps=3, cg_steps=steps, loss_fn=_mse,
                    eval_lam=None)  # adapt: the training problem's phi  # fmt: skip
    assert (learner.cg_negative_curvature, learner.cg_damping) == ("continue", 11.0)
    expected, met, indefinite = [], [], []
    for task in tasks:
        hessian, g = _flat_support_hessian_and_query_grad(model, learner.adapt(task), task)
        system = (1 + learner.cg_damping) * torch.eye(len(g), dtype=F64) + hessian / lam
        eigenvalues = torch.linalg.eigvalsh(system)
        indefinite.append(bool(eigenvalues.min() < 0 < eigenvalues.max()))
        iterates = written_out_cg(system, g, steps)
        expected.append(iterates[-1][0])
        met.append(first_negative_curvature(iterates) is not None)
    metrics = learner.backward(tasks)
    torch.testing.assert_close(_flat_grad(model), torch.stack(expected).mean(0), rtol=1e-9,
                               atol=1e-12)  # fmt: skip
    assert indefinite == met == [True, False]
    assert metrics.cg_negative_curvature == 0.5 and metrics.cg_converged == 0.0


def test_imaml_stop_truncates_cg_before_negative_curvature() -> None:
    """cg_negative_curvature="stop": the meta-gradient is the iterate before the first
    p'Ap <= 0 (g_query itself when it is the first direction), from the written-out CG."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1)).double()
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(11, 2, generator=gen, dtype=F64)
    y = torch.sin(3 * x[:, :1]) + x[:, 1:] ** 2
    task = Task((x[:6], y[:6]), (x[6:], y[6:]))
    lam = 0.2
    learner = IMAML(model, lam=lam, inner_lr=1.0, inner_steps=3, cg_steps=3, cg_damping=0.0,
                    loss_fn=_mse, cg_negative_curvature="stop", eval_lam=None)  # fmt: skip
    hessian, g = _flat_support_hessian_and_query_grad(model, learner.adapt(task), task)
    iterates = written_out_cg(torch.eye(len(g), dtype=F64) + hessian / lam, g, 3)
    first = first_negative_curvature(iterates)
    assert first is not None
    metrics = learner.backward([task])
    expected = g if first == 0 else iterates[first][0]
    torch.testing.assert_close(_flat_grad(model), expected, rtol=1e-9, atol=1e-12)
    assert metrics.cg_negative_curvature == 1.0


def test_an_unknown_cg_negative_curvature_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown cg_negative_curvature 'skip'; choose one of"):
        IMAML(nn.Linear(2, 1), cg_negative_curvature="skip")


# --------------------------------------------------------------------------- Reptile

# Reptile as plain full-batch gradient descent (the inner loop before Adam and mini-batches).
PLAIN = {
    "inner_optimizer": "sgd",
    "inner_loss": "mean",
    "inner_batch": None,
    "eval_inner_batch": None,
    "transductive": True,
}


def _sgd_reference(
    model: nn.Module, data: tuple[Tensor, Tensor], steps: int, lr: float, names: list[str] | None
) -> dict[str, Tensor]:
    """Plain PyTorch: a copy of the model, torch.optim.SGD, a manual loop."""
    clone = copy.deepcopy(model)
    params = [p for n, p in clone.named_parameters() if names is None or n in names]
    opt = torch.optim.SGD(params, lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(clone(data[0]), data[1]).backward()
        opt.step()
    return {n: p.detach() for n, p in clone.named_parameters()}


@pytest.mark.parametrize("train_on_query", [False, True])
def test_reptile_grad_is_theta_minus_sgd_weights(train_on_query: bool) -> None:
    torch.manual_seed(7)
    model = MLP(3, [6], 4, activation=nn.Tanh).double()
    tasks = _classification_tasks(torch.Generator().manual_seed(7), 3)
    tasks[1].steps, tasks[2].steps = 2, 7  # per-task step counts
    lr, k = 0.3, 5
    theta = {n: p.detach().clone() for n, p in model.named_parameters()}
    directions, query_losses = [], []
    for t in tasks:
        data = t.support
        if train_on_query:
            data = (torch.cat([t.support[0], t.query[0]]), torch.cat([t.support[1], t.query[1]]))
        phi = _sgd_reference(model, data, k if t.steps is None else t.steps, lr, None)
        directions.append({n: theta[n] - phi[n] for n in theta})
        clone = copy.deepcopy(model)
        clone.load_state_dict(phi)
        query_losses.append(F.cross_entropy(clone(t.query[0]), t.query[1]).detach())
    learner = Reptile(model, inner_lr=lr, inner_steps=k, train_on_query=train_on_query, **PLAIN)
    metrics = learner.backward(tasks)
    for n, p in model.named_parameters():
        expected = torch.stack([d[n] for d in directions]).mean(0)
        torch.testing.assert_close(p.grad, expected, rtol=0, atol=1e-12)
    assert metrics.loss == pytest.approx(float(torch.stack(query_losses).mean()), abs=1e-12)


def test_reptile_sgd_step_is_the_batched_update_and_grads_accumulate() -> None:
    torch.manual_seed(8)
    model = MLP(3, [6], 4, activation=nn.Tanh).double()
    tasks = _classification_tasks(torch.Generator().manual_seed(8), 2)
    learner = Reptile(model, inner_lr=0.3, inner_steps=4, **PLAIN)
    theta = _flat(model)
    phis = [torch.cat([v.reshape(-1) for v in learner.adapt(t).values()]) for t in tasks]
    eps = 0.25
    opt = torch.optim.SGD(learner.parameters(), lr=eps)
    opt.zero_grad()
    learner.backward(tasks)
    once = _flat_grad(model).clone()
    learner.backward(tasks)  # accumulates, like loss.backward()
    torch.testing.assert_close(_flat_grad(model), 2 * once, rtol=0, atol=1e-15)
    opt.zero_grad()
    learner.backward(tasks)
    opt.step()
    expected = theta + eps * (torch.stack(phis).mean(0) - theta)  # Nichol et al., Alg. 2
    torch.testing.assert_close(_flat(model), expected, rtol=0, atol=1e-14)


def test_reptile_one_step_is_joint_training() -> None:
    """With k = 1 on the support set, theta - phi = alpha * grad L_support(theta) (joint
    training): alpha times FOMAML with no inner step on tasks whose query is their support.
    It is not FOMAML with one inner step, whose gradient is taken at phi on the query set."""
    torch.manual_seed(9)
    model = MLP(3, [6], 4, activation=nn.Tanh).double()
    tasks = _classification_tasks(torch.Generator().manual_seed(9), 3)
    alpha = 0.3
    Reptile(model, inner_lr=alpha, inner_steps=1, **PLAIN).backward(tasks)
    reptile = _flat_grad(model).clone()
    model.zero_grad()
    joint = [Task(t.support, t.support) for t in tasks]
    FOMAML(model, inner_steps=0, vectorize="loop").backward(joint)
    torch.testing.assert_close(reptile, alpha * _flat_grad(model), rtol=0, atol=1e-14)


def test_reptile_adapt_keys_move_only_those_parameters() -> None:
    torch.manual_seed(10)
    model = MLP(3, [6], 4, activation=nn.Tanh).double()
    task = _classification_tasks(torch.Generator().manual_seed(10), 1)[0]
    head = ["head.weight", "head.bias"]
    Reptile(model, inner_lr=0.3, inner_steps=3, adapt_keys=head, **PLAIN).backward([task])
    phi = _sgd_reference(model, task.support, 3, 0.3, head)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, p.detach() - phi[n], rtol=0, atol=1e-12)
        if n not in head:
            assert not p.grad.any()


def test_reptile_metrics_match_evaluate_and_nonfinite_tasks_skip() -> None:
    torch.manual_seed(11)
    model = MLP(3, [6], 4, activation=nn.Tanh).double()
    tasks = _classification_tasks(torch.Generator().manual_seed(11), 3)
    learner = Reptile(model, inner_lr=0.3, inner_steps=4, on_nonfinite="skip", **PLAIN)
    metrics = learner.backward(tasks)
    losses, accs = learner.evaluate(tasks)
    assert metrics.loss == pytest.approx(float(losses.mean()), abs=1e-12)
    assert metrics.accuracy == pytest.approx(float(accs.mean()), abs=1e-12)
    model.zero_grad()
    bad = Task((torch.full_like(tasks[0].support[0], math.nan), tasks[0].support[1]),
               tasks[0].query)  # fmt: skip
    skipped = learner.backward([bad, *tasks[1:]])
    assert skipped.skipped == 1 and torch.isfinite(_flat_grad(model)).all()
    with pytest.raises(NonFiniteLossError, match="task 0 at inner step 0"):
        Reptile(model).backward([bad])


def test_reptile_rejects_bad_settings() -> None:
    model = nn.Linear(2, 3).double()
    with pytest.raises(ValueError, match="first order by definition"):
        Reptile(model, first_order=False)
    with pytest.raises(ValueError, match="vectorize='loop' or 'auto'"):
        Reptile(model, vectorize="vmap")
    assert not hasattr(Reptile(model), "meta_loss")  # its meta-gradient is no loss's gradient
    with pytest.raises(ValueError, match="meta-batch is empty"):
        Reptile(model).backward([])
    with pytest.raises(ValueError, match="Reptile's inner_optimizer 'rmsprop'; choose one of"):
        Reptile(model, inner_optimizer="rmsprop")
    with pytest.raises(
        ValueError, match=r"inner_beta1=1.0 is out of range: it must be in \[0, 1\)"
    ):
        Reptile(model, inner_beta1=1.0)
    with pytest.raises(ValueError, match="inner_batch must be >= 1"):
        Reptile(model, inner_batch=0)
    with pytest.raises(ValueError, match="Reptile's inner_loss 'max'; choose one of sum, mean"):
        Reptile(model, inner_loss="max")


def _adam_reference(model: nn.Module, data: tuple[Tensor, Tensor], steps: int, batch: int,
                    lr: float, beta1: float, beta2: float, eps: float,
                    slots: dict | None = None, reduction: str = "sum",
                    ) -> tuple[dict[str, Tensor], dict]:  # fmt: skip
    """TensorFlow's AdamOptimizer (its documented update: ``lr_t = lr sqrt(1 - beta2^t) /
    (1 - beta1^t)``, ``p -= lr_t m_t / (sqrt(v_t) + eps)``) on a copy of the model, one step
    per mini-batch of `tests.helpers.reptile_batches.mini_batches`, from the slots ``slots``
    (None: zero, t = 0), on the mini-batch's cross-entropies reduced by ``reduction``
    (``"sum"``: the reference's ``minimize`` of the loss vector).
    Returns the weights and the slots after."""
    clone = copy.deepcopy(model)
    params = dict(clone.named_parameters())
    if slots is None:
        slots = {"t": 0, "m": {n: torch.zeros_like(p) for n, p in params.items()},
                 "v": {n: torch.zeros_like(p) for n, p in params.items()}}  # fmt: skip
    t, m, v = slots["t"], dict(slots["m"]), dict(slots["v"])
    for rows in mini_batches(len(data[0]), batch, steps):
        t += 1
        clone.zero_grad()
        F.cross_entropy(clone(data[0][rows]), data[1][rows], reduction=reduction).backward()
        lr_t = lr * math.sqrt(1 - beta2**t) / (1 - beta1**t)
        with torch.no_grad():
            for n, p in params.items():
                m[n] = beta1 * m[n] + (1 - beta1) * p.grad
                v[n] = beta2 * v[n] + (1 - beta2) * p.grad**2
                p -= lr_t * m[n] / (v[n].sqrt() + eps)
    weights = {n: p.detach() for n, p in clone.named_parameters()}
    return weights, {"t": t, "m": m, "v": v}


@pytest.mark.parametrize(("batch", "train_on_query", "state", "loss"),
                         [(3, False, "carried", "sum"), (5, True, "carried", "sum"),
                          (11, False, "carried", "sum"), (3, False, "task", "sum"),
                          (3, False, "carried", "mean")])  # fmt: skip
def test_reptile_inner_loop_is_the_reference_adam_on_minibatches(batch, train_on_query, state,
                                                                 loss):  # fmt: skip
    """The defaults' inner loop (Adam, beta1 = 0, the summed loss; mini-batches) equals the
    reference's written out over two meta-steps, task after task from one random stream:
    Adam's slots carried from task to task and step to step as the reference's TensorFlow
    variables are (``inner_state="task"``: reset per task; ``inner_loss="mean"``: Adam on the
    mean). A mini-batch larger than the data (11 of 8) spans two shuffles, as the
    reference's does."""
    torch.manual_seed(12)
    model = MLP(3, [6], 4, activation=nn.Tanh).double()
    gen = torch.Generator().manual_seed(12)
    batches = [_classification_tasks(gen, 3), _classification_tasks(gen, 2)]
    options = {} if loss == "sum" else {"inner_loss": loss}  # the default is the sum
    learner = Reptile(model, inner_lr=0.05, inner_steps=6, inner_batch=batch,
                      train_on_query=train_on_query, inner_state=state, **options)  # fmt: skip
    assert (learner.inner_optimizer, learner.adam) == ("adam", (0.0, 0.999, 1e-8))
    slots, expected = None, []
    torch.manual_seed(99)
    theta = {n: p.detach().clone() for n, p in model.named_parameters()}
    for tasks in batches:
        directions = []
        for t in tasks:
            data = t.support
            if train_on_query:
                data = (torch.cat([t.support[0], t.query[0]]),
                        torch.cat([t.support[1], t.query[1]]))  # fmt: skip
            phi, after = _adam_reference(model, data, 6, batch, 0.05, 0.0, 0.999, 1e-8, slots,
                                         reduction=loss)  # fmt: skip
            slots = after if state == "carried" else None
            directions.append({n: theta[n] - phi[n] for n in theta})
        expected.append({n: torch.stack([d[n] for d in directions]).mean(0) for n in theta})
    torch.manual_seed(99)
    for tasks, grads in zip(batches, expected, strict=True):
        model.zero_grad()
        learner.backward(tasks)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, grads[n], rtol=0, atol=1e-13, msg=n)
    if state == "carried":
        assert int(learner.adam_slots.steps) == slots["t"] == 5 * 6
        assert "adam_slots.steps" in learner.state_dict()  # a checkpoint holds it
    else:
        assert not hasattr(learner, "adam_slots")


def test_reptile_evaluation_uses_its_own_batch_and_seed_from_the_carried_state() -> None:
    """evaluate and adapt draw their mini-batches (``eval_inner_batch``) from a fixed seed
    and start Adam from the carried state, which they leave as it was: the same numbers
    twice, whatever the global stream; adapt's weights score as evaluate does."""
    torch.manual_seed(13)
    model = MLP(3, [6], 4, activation=nn.Tanh).double()
    tasks = _classification_tasks(torch.Generator().manual_seed(13), 2)
    learner = Reptile(model, inner_lr=0.05, eval_inner_batch=3)
    learner.backward(tasks)  # carries a state
    model.zero_grad()
    carried = {k: b.clone() for k, b in learner.adam_slots.named_buffers()}
    first = learner.evaluate(tasks, steps=7)
    torch.manual_seed(1)
    second = learner.evaluate(tasks, steps=7)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
    for k, b in learner.adam_slots.named_buffers():
        assert torch.equal(b, carried[k]), k
    fast = learner.adapt(tasks[0], steps=7)
    torch.manual_seed(EVAL_SEED)  # the reference from the carried slots, same batch order
    steps, m, v = learner.adam_slots.read()
    slots = {"t": steps, "m": {k.removeprefix("model."): x for k, x in m.items()},
             "v": {k.removeprefix("model."): x for k, x in v.items()}}  # fmt: skip
    phi, _ = _adam_reference(model, tasks[0].support, 7, 3, 0.05, 0.0, 0.999, 1e-8, slots)
    for n in phi:
        torch.testing.assert_close(fast[n], phi[n], rtol=0, atol=1e-13, msg=n)
    clone = copy.deepcopy(model)
    clone.load_state_dict(fast)
    loss = F.cross_entropy(clone(tasks[0].query[0]), tasks[0].query[1])
    assert float(loss.detach()) == pytest.approx(float(first[0][0]), abs=1e-12)


def test_reptile_scores_each_query_beside_the_support_set_unless_transductive() -> None:
    """With batch norm, a query example's logits depend on its batch: non-transductive
    scoring (the reference's default) gives each example the logits of the support set plus
    that example, last row; transductive scoring the query batch's."""
    torch.manual_seed(14)
    model = nn.Sequential(nn.Linear(3, 5), MetaBatchNorm(5), nn.Tanh(), nn.Linear(5, 4)).double()
    task = _classification_tasks(torch.Generator().manual_seed(14), 1)[0]
    xs, (xq, yq) = task.support[0], task.query
    per_example = torch.stack([model(torch.cat([xs, x[None]]))[-1] for x in xq]).detach()
    for transductive, expected in ((False, per_example), (True, model(xq).detach())):
        learner = Reptile(model, inner_steps=0, transductive=transductive)
        losses, accs = learner.evaluate([task])
        torch.testing.assert_close(losses[0], F.cross_entropy(expected, yq), rtol=0, atol=1e-12)
        assert accs[0] == (expected.argmax(1) == yq).double().mean()
    assert (per_example - model(xq)).abs().max() > 1e-3  # the two differ here


def _separable_tasks(gen: torch.Generator, n: int, ways: int, shots: int, d: int) -> list[Task]:
    """Tasks of ``ways`` classes around random means (``shots`` examples a class to train
    on, one query a class), float64."""
    tasks = []
    for _ in range(n):
        means = 2 * torch.randn(ways, d, generator=gen, dtype=F64)

        def draw(k: int, means: Tensor = means) -> tuple[Tensor, Tensor]:
            y = torch.arange(ways).repeat_interleave(k)
            return means[y] + torch.randn(len(y), d, generator=gen, dtype=F64), y

        tasks.append(Task(draw(shots), draw(1)))
    return tasks


def _supervised_reptile(model: nn.Module, meta_batches: list[list[Task]], *, reduction: str
                        ) -> list[Tensor]:  # fmt: skip
    """``openai/supervised-reptile`` (8f2b71c) written out in float64, theta flattened after
    each outer update: ``train.py`` lines 53-60 (``frac_done = i / meta_iters``, the meta
    step ``frac_done * 0 + (1 - frac_done) * 1``); ``reptile.py`` lines 62-74 (per task the
    inner loop from the old variables, the new ones averaged, ``old + step (average -
    old)``); ``models.py`` lines 10 and 27-30 (``AdamOptimizer(beta1=0).minimize`` of the
    per-example cross-entropies, a vector: ``tf.gradients`` differentiates its sum), Adam's
    slots never restored (``VariableState`` holds the trainable variables); mini-batches of
    10 from ``_mini_batches`` (`mini_batches`), 5 of them."""
    lr, beta2, eps, batch, iters = 1e-3, 0.999, 1e-8, 10, 5
    theta = {n: p.detach().clone() for n, p in model.named_parameters()}
    t = 0
    m = {n: torch.zeros_like(p) for n, p in theta.items()}
    v = {n: torch.zeros_like(p) for n, p in theta.items()}
    history = []
    for i, tasks in enumerate(meta_batches):
        step = (1 - i / len(meta_batches)) * 1.0 + (i / len(meta_batches)) * 0.0
        new = []
        for task in tasks:
            w = dict(theta)
            x, y = task.support
            for rows in mini_batches(len(y), batch, iters):
                leaves = {n: p.clone().requires_grad_() for n, p in w.items()}
                logits = functional_call(model, leaves, (x[rows],))
                losses = -logits.log_softmax(1).gather(1, y[rows, None]).squeeze(1)  # [batch]
                loss = losses.sum() if reduction == "sum" else losses.mean()
                g = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
                t += 1
                rate = lr * math.sqrt(1 - beta2**t) / (1 - 0.0**t)
                for n in w:  # beta1 = 0: m is the gradient
                    m[n] = 0.0 * m[n] + (1 - 0.0) * g[n]
                    v[n] = beta2 * v[n] + (1 - beta2) * g[n] ** 2
                    w[n] = w[n] - rate * m[n] / (v[n].sqrt() + eps)
            new.append(w)
        average = {n: torch.stack([w[n] for w in new]).mean(0) for n in theta}
        theta = {n: theta[n] + step * (average[n] - theta[n]) for n in theta}
        history.append(torch.cat([theta[n].reshape(-1) for n in theta]))
    return history


def _library_reptile(model: nn.Module, meta_batches: list[list[Task]], **options: Any
                     ) -> list[Tensor]:  # fmt: skip
    """The learner's path of a run: `Reptile.backward`, its outer optimizer at
    ``outer_lr_factor`` times its step (as the experiments' ``meta_step``), theta flattened
    after each update."""
    learner = Reptile(copy.deepcopy(model), **options)
    opt = learner.outer_optimizer()
    history = []
    for i, tasks in enumerate(meta_batches):
        for group in opt.param_groups:
            group["lr"] = learner.default_outer_lr * learner.outer_lr_factor(i, len(meta_batches))
        opt.zero_grad()
        learner.backward(tasks)
        opt.step()
        history.append(_flat(learner.model))
    return history


def test_reptile_default_is_the_reference_rule_on_the_summed_loss() -> None:
    """The default learner (Adam 1e-3, beta1 0, 5 iterations on mini-batches of 10, meta-batch
    5, outer step 1 annealed to 0) against openai/supervised-reptile's rule written out on
    5-way 10-shot tasks, after one outer update and after 20: the reference's step on the
    sum of the per-example losses; ``inner_loss="mean"`` equals the same rule on their mean,
    which is a different run (10 times Adam's epsilon, relatively)."""
    torch.manual_seed(15)
    model = MLP(4, [16], 5, activation=nn.Tanh).double()
    gen = torch.Generator().manual_seed(15)
    meta_batches = [_separable_tasks(gen, 5, ways=5, shots=10, d=4) for _ in range(20)]
    runs = {}
    for loss in ("sum", "mean"):
        torch.manual_seed(100)
        reference = _supervised_reptile(model, meta_batches, reduction=loss)
        torch.manual_seed(100)
        options = {} if loss == "sum" else {"inner_loss": "mean"}
        library = _library_reptile(model, meta_batches, **options)
        for update in (0, 19):  # after one outer update, and after 20
            torch.testing.assert_close(library[update], reference[update], rtol=0, atol=1e-13)
        runs[loss] = reference
    for update in (0, 19):
        # the two losses' runs differ 10^4 times beyond the tolerance above (1.7e-7 here):
        # the comparison tells them apart
        assert (runs["mean"][update] - runs["sum"][update]).abs().max() > 1e4 * 1e-13
