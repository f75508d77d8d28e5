"""Differentiable inner optimizers (`metalearn.optim`) against slow, obvious references.

References: an unrolled inner loop written out by hand (momentum, Nesterov, Adam as Kingma &
Ba's Algorithm 1, RMSprop), its gradients by ``torch.autograd.grad(create_graph=True)``;
torch.optim's own SGD, Adam and RMSprop for the update values; the Python loop for vmap; the
un-checkpointed loop for checkpointing. All in float64, tanh networks (no exactly-zero
gradients), fixed seeds and tolerances.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from metalearn.algorithms import MAML
from metalearn.algorithms.inner_optimizer import InnerOptimizerLearner
from metalearn.engine import InnerLoop, Task, adapt, meta_batch
from metalearn.models import MLP
from metalearn.optim import SGD, Adam, RMSprop, adam_update

F64 = torch.float64
Params = dict[str, Tensor]
TOL = 1e-12


def _mlp(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP(4, [6], 3, activation=nn.Tanh).to(F64)


def _task(seed: int, n_s: int = 6, n_q: int = 9) -> Task:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_s + n_q, 4, generator=g, dtype=F64)
    y = torch.arange(n_s + n_q) % 3
    return Task((x[:n_s], y[:n_s]), (x[n_s:], y[n_s:]))


def _theta(model: nn.Module) -> Params:
    return {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}


def _loss(model: nn.Module, params: Params, data: tuple[Tensor, Tensor]) -> Tensor:
    return F.cross_entropy(functional_call(model, params, (data[0],)), data[1])


def _at(value, name: str, step: int):
    """A hyperparameter's value the slow way: per step, then per tensor, then fixed."""
    if isinstance(value, list):
        value = value[min(step, len(value) - 1)]
    return value[name] if isinstance(value, dict) else value


def _reference(model, theta, task, steps, kind, lr, **h) -> Tensor:
    """The query loss after ``steps`` hand-written updates of kind ``kind``."""
    p = dict(theta)
    state = {k: (torch.zeros_like(v), torch.zeros_like(v)) for k, v in p.items()}
    for s in range(steps):
        grads = torch.autograd.grad(_loss(model, p, task.support), list(p.values()),
                                    create_graph=True)  # fmt: skip
        new = {}
        for (k, v), g in zip(p.items(), grads):
            a, b = state[k]
            rate = _at(lr, k, s)
            if kind in ("momentum", "nesterov"):
                mu = _at(h["momentum"], k, s)
                a = mu * a + g  # b_t = mu b_{t-1} + g_t
                d = g + mu * a if kind == "nesterov" else a
                new[k] = v - rate * d
            elif kind == "adam":  # Kingma & Ba (2015), Algorithm 1
                b1, b2, t = _at(h["beta1"], k, s), _at(h["beta2"], k, s), s + 1
                a = b1 * a + (1 - b1) * g
                b = b2 * b + (1 - b2) * g**2
                m_hat, v_hat = a / (1 - b1**t), b / (1 - b2**t)
                new[k] = v - rate * m_hat / (torch.sqrt(v_hat) + h["eps"])
            elif kind == "rmsprop":  # Tieleman & Hinton (2012)
                al = _at(h["alpha"], k, s)
                a = al * a + (1 - al) * g**2
                new[k] = v - rate * g / (torch.sqrt(a) + h["eps"])
            else:
                new[k] = v - rate * g
            state[k] = (a, b)
        p = new
    return _loss(model, p, task.query)


def _optimizer(kind: str, **h):
    if kind in ("momentum", "nesterov"):
        return SGD(momentum=h["momentum"], nesterov=kind == "nesterov")
    if kind == "adam":
        return Adam(h["beta1"], h["beta2"], h["eps"])
    if kind == "rmsprop":
        return RMSprop(h["alpha"], h["eps"])
    return SGD()


HYPERS = {
    "sgd": {}, "momentum": {"momentum": 0.8}, "nesterov": {"momentum": 0.7},
    "adam": {"beta1": 0.85, "beta2": 0.95, "eps": 1e-3}, "rmsprop": {"alpha": 0.9, "eps": 1e-3},
}  # fmt: skip
RATES = {"sgd": 0.5, "momentum": 0.3, "nesterov": 0.3, "adam": 0.05, "rmsprop": 0.05}


def _grads(loss: Tensor, tensors: list[Tensor]) -> list[Tensor]:
    return list(torch.autograd.grad(loss, tensors))


def _close(a: list[Tensor], b: list[Tensor], tol: float = TOL) -> None:
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=tol)


@pytest.mark.parametrize("kind", list(HYPERS))
@pytest.mark.parametrize("first_order", [False, True])
def test_inner_loop_and_meta_gradient_equal_the_hand_written_update(kind, first_order):
    model, task = _mlp(), _task(1)
    theta = _theta(model)
    opt = _optimizer(kind, **HYPERS[kind])
    fast = adapt(model, theta, task.support, steps=3, lr=RATES[kind], optimizer=opt,
                 first_order=first_order)  # fmt: skip
    loss = _loss(model, fast, task.query)
    if first_order:  # FOMAML: the reference's inner gradients at detached weights
        ref_fast = adapt(model, {k: v.detach() for k, v in theta.items()}, task.support, steps=3,
                         lr=RATES[kind], optimizer=opt)  # fmt: skip
        ref = _loss(model, {k: v.detach().requires_grad_() for k, v in ref_fast.items()},
                    task.query)  # fmt: skip
        torch.testing.assert_close(loss, ref, rtol=0, atol=TOL)
        return
    ref = _reference(model, theta, task, 3, kind, RATES[kind], **HYPERS[kind])
    torch.testing.assert_close(loss, ref, rtol=0, atol=TOL)
    _close(_grads(loss, list(theta.values())), _grads(ref, list(theta.values())))


def test_first_order_meta_gradient_is_the_query_gradient_at_the_adapted_weights():
    model, task = _mlp(), _task(2)
    theta = _theta(model)
    opt = Adam(0.9, 0.99, 1e-3)
    fast = adapt(model, theta, task.support, steps=2, lr=0.05, optimizer=opt, first_order=True)
    got = _grads(_loss(model, fast, task.query), list(theta.values()))
    at = {k: v.detach().requires_grad_() for k, v in fast.items()}
    _close(got, _grads(_loss(model, at, task.query), list(at.values())))


@pytest.mark.parametrize("learn", ["tensor", "step"])
@pytest.mark.parametrize("kind", ["momentum", "adam", "rmsprop"])
def test_learnable_hyperparameters_get_the_unrolled_meta_gradient(kind, learn):
    model, task = _mlp(3), _task(4)
    theta = _theta(model)
    names, steps = list(theta), 3
    learned = {"momentum": ("momentum",), "adam": ("beta1", "beta2"), "rmsprop": ("alpha",)}[kind]
    fixed = HYPERS[kind]

    def leaf(value: float, i: int, s: int) -> Tensor:  # distinct values per tensor and step
        return torch.tensor(value * (1 - 0.02 * i - 0.01 * s), dtype=F64, requires_grad=True)

    if learn == "tensor":
        lr = {n: leaf(RATES[kind], i, 0) for i, n in enumerate(names)}
        hyp = {h: {n: leaf(fixed[h], i, 0) for i, n in enumerate(names)} for h in learned}
        leaves = [*lr.values(), *(t for d in hyp.values() for t in d.values())]
    else:
        lr = [{n: leaf(RATES[kind], i, s) for i, n in enumerate(names)} for s in range(steps)]
        hyp = {h: [{n: leaf(fixed[h], i, s) for i, n in enumerate(names)} for s in range(steps)]
               for h in learned}  # fmt: skip
        leaves = [t for d in lr for t in d.values()]
        leaves += [t for per_step in hyp.values() for d in per_step for t in d.values()]
    h = {**fixed, **hyp}
    fast = adapt(model, theta, task.support, steps=steps, lr=lr, optimizer=_optimizer(kind, **h))
    loss = _loss(model, fast, task.query)
    ref = _reference(model, theta, task, steps, kind, lr, **h)
    torch.testing.assert_close(loss, ref, rtol=0, atol=TOL)
    got, want = (
        _grads(loss, leaves + list(theta.values())),
        _grads(ref, leaves + list(theta.values())),
    )
    # Every rate matters; each learned decay rate matters somewhere (not everywhere: the
    # first step's momentum multiplies a zero buffer, and Adam's bias correction cancels
    # beta1 at t = 1).
    magnitude = {id(t): float(g.abs()) for t, g in zip(leaves, got)}
    rates = list(lr.values()) if isinstance(lr, dict) else [t for d in lr for t in d.values()]
    assert all(magnitude[id(t)] > 1e-8 for t in rates)
    for name in learned:
        values = hyp[name] if isinstance(hyp[name], list) else [hyp[name]]
        assert max(magnitude[id(t)] for d in values for t in d.values()) > 1e-6, name
    _close(got, want)


@pytest.mark.parametrize("learn", ["tensor", "step"])
def test_the_learner_meta_learns_adam_hyperparameters(learn):
    model, tasks = _mlp(5), [_task(s) for s in range(3)]
    learner = MAML(model, inner_lr=0.05, inner_steps=2, inner_optimizer="adam", inner_beta2=0.95,
                   inner_eps=1e-3, learn_inner_hyperparameters=learn)  # fmt: skip
    hyper = learner.inner_hyperparameters
    assert sorted(hyper) == ["beta1", "beta2", "lr"]
    with torch.no_grad():  # distinct values, so a mix-up of tensors or steps would show
        for i, p in enumerate(learner.inner_hyperparameters.parameters()):
            p.mul_(1 - 0.01 * (i % 7) - 0.003 * torch.arange(p.numel(), dtype=F64).view(p.shape))
    loss = learner.meta_loss(tasks).loss
    leaves = list(hyper.parameters())
    got = _grads(loss, leaves)
    lr = {n: hyper["lr"][n.replace(".", "__")] for n in learner.theta()}
    b1 = {n: hyper["beta1"][n.replace(".", "__")] for n in learner.theta()}
    b2 = {n: hyper["beta2"][n.replace(".", "__")] for n in learner.theta()}
    if learn == "step":
        lr, b1, b2 = ([{n: v[s] for n, v in d.items()} for s in range(2)] for d in (lr, b1, b2))
    theta = learner.theta()
    ref = torch.stack([_reference(model, theta, t, 2, "adam", lr, beta1=b1, beta2=b2, eps=1e-3)
                       for t in tasks]).mean()  # fmt: skip
    torch.testing.assert_close(loss, ref, rtol=0, atol=TOL)
    _close(got, _grads(ref, leaves))


@pytest.mark.parametrize("kind", ["nesterov", "adam", "rmsprop"])
def test_vmap_equals_the_loop(kind):
    model = _mlp(6)
    tasks = [_task(10 + s) for s in range(4)]
    inner = InnerLoop(steps=3, lr=RATES[kind], optimizer=_optimizer(kind, **HYPERS[kind]))
    results = {}
    for mode in ("vmap", "loop"):
        theta = _theta(model)
        batch = meta_batch(model, theta, tasks, inner, vectorize=mode)
        results[mode] = [batch.loss, *_grads(batch.loss, list(theta.values()))]
    assert meta_batch(model, _theta(model), tasks, inner, vectorize="vmap").vectorized == 4
    _close(results["vmap"], results["loop"], 1e-10)


@pytest.mark.parametrize("kind", ["momentum", "adam"])
def test_checkpointing_and_per_task_steps_carry_the_state(kind):
    model = _mlp(7)
    other = _task(21)
    tasks = [_task(20), Task(other.support, other.query, steps=4)]
    lr, opt = RATES[kind], _optimizer(kind, **HYPERS[kind])
    theta = _theta(model)
    plain = meta_batch(model, theta, tasks, InnerLoop(steps=2, lr=lr, optimizer=opt),
                       vectorize="loop")  # fmt: skip
    want = [plain.loss, *_grads(plain.loss, list(theta.values()))]
    ref = torch.stack([_reference(model, theta, t, n, kind, lr, **HYPERS[kind])
                       for t, n in zip(tasks, (2, 4))]).mean()  # fmt: skip
    _close(want, [ref, *_grads(ref, list(theta.values()))])
    theta = _theta(model)
    ck = meta_batch(model, theta, tasks, InnerLoop(steps=2, lr=lr, optimizer=opt, checkpoint=True),
                    vectorize="loop")  # fmt: skip
    _close([ck.loss, *_grads(ck.loss, list(theta.values()))], want)


def _torch_steps(opt_cls, kwargs, grads):
    p = torch.zeros_like(grads[0]).requires_grad_()
    opt = opt_cls([p], **kwargs)
    out = []
    for g in grads:
        p.grad = g.clone()
        opt.step()
        out.append(p.detach().clone())
    return out


@pytest.mark.parametrize(
    ("ours", "theirs", "kwargs"),
    [
        (SGD(momentum=0.9), torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
        (SGD(momentum=0.9, nesterov=True), torch.optim.SGD, dict(lr=0.1, momentum=0.9,
                                                                  nesterov=True)),
        (Adam(0.9, 0.999, 1e-8), torch.optim.Adam, dict(lr=0.01, betas=(0.9, 0.999), eps=1e-8)),
        (RMSprop(0.99, 1e-8), torch.optim.RMSprop, dict(lr=0.01, alpha=0.99, eps=1e-8)),
    ],
)  # fmt: skip
def test_updates_equal_torch_optim(ours, theirs, kwargs):
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=g, dtype=F64) * 10.0**-k for k in range(4)]
    grads[1][0, 0] = 0.0  # an exact zero once: Adam's and RMSprop's eps guard
    want = _torch_steps(theirs, kwargs, grads)
    params = {"w": torch.zeros(5, 3, dtype=F64)}
    state = ours.init(params)
    for step, g in enumerate(grads):
        params, state = ours.update(params, {"w": g}, state, lr=kwargs["lr"], step=step)
        torch.testing.assert_close(params["w"], want[step], rtol=1e-14, atol=1e-15)


def test_sgd_default_is_maml_update_bit_for_bit():
    model, task = _mlp(8), _task(30)
    theta = _theta(model)
    assert InnerLoop().optimizer == SGD() and SGD().slots() == 0
    fast = adapt(model, theta, task.support, steps=2, lr=0.4)
    p = dict(theta)
    for _ in range(2):
        grads = torch.autograd.grad(_loss(model, p, task.support), list(p.values()),
                                    create_graph=True)  # fmt: skip
        p = {k: v - 0.4 * g for (k, v), g in zip(p.items(), grads)}
    for k in p:
        assert torch.equal(fast[k], p[k]), k


def test_an_exact_zero_gradient_keeps_the_meta_gradient_finite():
    # A parameter the support loss does not touch: its gradient is exactly 0 at every step.
    model, task = _mlp(9), _task(31)
    theta = _theta(model)
    theta["unused"] = torch.ones(3, dtype=F64, requires_grad=True)
    fast = adapt(model, theta, task.support, steps=2, lr=0.05, optimizer=Adam())
    grads = _grads(_loss(model, {k: v for k, v in fast.items() if k != "unused"}, task.query)
                   + fast["unused"].sum(), list(theta.values()))  # fmt: skip
    assert all(torch.isfinite(g).all() for g in grads)
    torch.testing.assert_close(grads[-1], torch.ones(3, dtype=F64), rtol=0, atol=0)


def test_learner_refuses_bad_settings():
    with pytest.raises(ValueError, match="inner_optimizer 'adagrad'"):
        MAML(_mlp(), inner_optimizer="adagrad")
    with pytest.raises(ValueError, match="learn_inner_hyperparameters 'layer'"):
        MAML(_mlp(), learn_inner_hyperparameters="layer")
    with pytest.raises(ValueError, match="Nesterov momentum needs a momentum"):
        SGD(nesterov=True)
    assert issubclass(MAML, InnerOptimizerLearner)
    assert not list(MAML(_mlp(), inner_optimizer="adam").inner_update().init({}).values())
    assert math.isclose(MAML(_mlp()).inner_update().slots(), 0)


# Settings an inner optimizer's update is not defined for, each with the learner argument it
# is given by and the range it must be in.
OUT_OF_RANGE = [
    ("adam", "inner_beta1", 1.0, r"in \[0, 1\)"),  # bias correction 1 - beta1^t = 0
    ("adam", "inner_beta1", 1.5, r"in \[0, 1\)"),
    ("adam", "inner_beta2", 1.5, r"in \[0, 1\)"),  # sqrt(1 - beta2^t) of a negative number
    ("adam", "inner_beta2", -0.1, r"in \[0, 1\)"),
    ("adam", "inner_eps", -1e-8, "finite and >= 0"),
    ("adam", "inner_eps", math.inf, "finite and >= 0"),
    ("rmsprop", "inner_eps", math.nan, "finite and >= 0"),
    ("rmsprop", "inner_alpha", 1.0, r"in \[0, 1\)"),
    ("momentum", "inner_momentum", 1.5, r"in \[0, 1\)"),
    ("nesterov", "inner_momentum", 1.0, r"in \[0, 1\)"),
    ("sgd", "inner_lr", math.inf, "a finite number"),
    ("adam", "inner_lr", math.nan, "a finite number"),
]


@pytest.mark.parametrize(("optimizer", "argument", "value", "rule"), OUT_OF_RANGE)
def test_the_learner_refuses_an_inner_optimizer_setting_out_of_range(
    optimizer, argument, value, rule
):
    with pytest.raises(ValueError) as refused:
        MAML(_mlp(), inner_optimizer=optimizer, **{argument: value})
    message = str(refused.value)
    assert re.fullmatch(f"{argument}={value!r} is out of range: it must be {rule}", message)


@pytest.mark.parametrize(
    ("make", "name"),
    [
        (lambda: Adam(beta1=1.0), "beta1"),
        (lambda: Adam(beta2={"w": 0.9, "b": 1.5}), "beta2"),  # per tensor: every entry
        (lambda: Adam(eps=[1e-8, -1.0]), "eps"),  # per step: every entry
        (lambda: RMSprop(alpha=-0.5), "alpha"),
        (lambda: SGD(momentum=1.0), "momentum"),
    ],
)
def test_the_optimizers_refuse_a_fixed_hyperparameter_out_of_range(make, name):
    with pytest.raises(ValueError, match=f"^{name}=.* is out of range: it must be "):
        make()


def test_the_edges_of_the_ranges_and_learned_values_are_accepted():
    for optimizer, setting in [("adam", dict(inner_beta1=0.0, inner_beta2=0.0, inner_eps=0.0)),
                               ("rmsprop", dict(inner_alpha=0.0)),
                               ("momentum", dict(inner_momentum=0.0))]:  # fmt: skip
        MAML(_mlp(), inner_optimizer=optimizer, **setting).inner_update()
    MAML(_mlp(), inner_lr=-0.1)  # finite: a negative rate is allowed, as Meta-SGD learns them
    # Learned values are tensors: they move in training and are not checked.
    learner = MAML(_mlp(), inner_optimizer="adam", learn_inner_hyperparameters="tensor")
    with torch.no_grad():
        for value in learner.inner_hyperparameters["beta1"].values():
            value.fill_(1.0)
    learner.inner_update()


def test_without_the_check_adam_at_beta1_1_divides_by_zero():
    """What the refusal prevents: the update itself is undefined there."""
    p = torch.ones(2, dtype=F64)
    with pytest.raises(ZeroDivisionError):
        adam_update(p, p, 0 * p, 0 * p, t=1, lr=0.1, beta1=1.0)
    new, _, _ = adam_update(p, p, 0 * p, 0 * p, t=1, lr=0.1, beta2=1.5)
    assert torch.is_complex(new) or not torch.isfinite(new).all()


def test_the_run_records_the_inner_optimizer_and_refuses_what_makes_no_sense():
    from metalearn.runs.recipe import learner_recipe, resolve_learner_args

    flags = dict(algorithm="anil", inner_optimizer="adam", inner_beta2=0.99, inner_lr=0.01,
                 learn_inner_hyperparameters="step")  # fmt: skip
    recorded = learner_recipe(resolve_learner_args(flags)).arguments
    assert (recorded["inner_optimizer"], recorded["inner_beta2"]) == ("adam", 0.99)
    assert recorded["learn_inner_hyperparameters"] == "step"
    assert learner_recipe(resolve_learner_args({"algorithm": "maml"})).arguments[
        "inner_optimizer"
    ] == "sgd"  # fmt: skip
    with pytest.raises(ValueError, match="--inner-optimizer is a setting .* drop it for imaml"):
        resolve_learner_args({"algorithm": "imaml", "inner_optimizer": "adam"})
    # Reptile chooses between its reference's two (Adam, SGD); it learns none of them
    assert resolve_learner_args({"algorithm": "reptile", "inner_optimizer": "sgd"})
    with pytest.raises(ValueError, match="--learn-inner-hyperparameters is not a setting of "
                                         "reptile"):  # fmt: skip
        resolve_learner_args({"algorithm": "reptile", "learn_inner_hyperparameters": "step"})
    with pytest.raises(ValueError, match="--inner-alpha is not a hyperparameter of .* adam"):
        resolve_learner_args({"algorithm": "maml", "inner_optimizer": "adam", "inner_alpha": 0.9})
