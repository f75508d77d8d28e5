"""The inner loop (`metalearn.engine.inner.adapt`) against slow, obvious references.

References: central finite differences of the whole meta-objective, FOMAML's closed form
(the query gradient at weights adapted by plain SGD), hand-written update loops for every
learning-rate form, and the un-checkpointed loop for checkpointing. All in float64 with
fixed seeds and fixed tolerances.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from metalearn.algorithms.maml import ANIL
from metalearn.engine import (
    InnerLoop,
    NonFiniteLossError,
    Task,
    adapt,
    meta_batch,
    run_inner_loop,
)
from metalearn.models import MLP, Conv4

F64 = torch.float64
Params = dict[str, Tensor]


def _mlp(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    # tanh: smooth everywhere, so finite differences never straddle a kink.
    return MLP(4, [5], 3, activation=nn.Tanh).to(F64)


def _data(seed: int, n: int, d: int = 4, ways: int = 3) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=F64), torch.arange(n) % ways


def _theta(model: nn.Module) -> Params:
    """Leaf copies of the model's parameters, so each test owns its gradients."""
    return {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}


def _query_loss(model: nn.Module, theta: Params, support, query, **kwargs) -> Tensor:
    fast = adapt(model, theta, support, **kwargs)
    return F.cross_entropy(functional_call(model, fast, (query[0],)), query[1])


def _fd_grad(f: Callable[[Params], Tensor], theta: Params, eps: float = 1e-5) -> Params:
    """Central differences, one coordinate at a time."""
    base = {k: v.detach() for k, v in theta.items()}
    out = {}
    with torch.no_grad():
        for k, v in base.items():
            g = torch.zeros_like(v).reshape(-1)
            for j in range(v.numel()):
                e = torch.zeros_like(v).reshape(-1)
                e[j] = eps
                plus = f({**base, k: v + e.reshape(v.shape)})
                minus = f({**base, k: v - e.reshape(v.shape)})
                g[j] = (plus - minus) / (2 * eps)
            out[k] = g.reshape(v.shape)
    return out


def _max_err(a: Params, b: Params) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in b)


# --------------------------------------------------------------------------- MAML, FOMAML, ANIL


def test_maml_second_order_meta_gradient_matches_finite_differences() -> None:
    model = _mlp()
    theta = _theta(model)
    support, query = _data(1, 6), _data(2, 9)
    kwargs = dict(steps=2, lr=0.5)
    loss = _query_loss(model, theta, support, query, **kwargs)
    grads = dict(zip(theta, torch.autograd.grad(loss, list(theta.values()))))
    fd = _fd_grad(lambda p: _query_loss(model, p, support, query, **kwargs), theta)
    assert _max_err(grads, fd) < 1e-9
    # Not vacuous: the second-order terms matter here.
    fo = _query_loss(model, theta, support, query, first_order=True, **kwargs)
    fo_grads = dict(zip(theta, torch.autograd.grad(fo, list(theta.values()))))
    assert _max_err(grads, fo_grads) > 1e-3


def test_fomaml_gradient_is_the_query_gradient_at_the_adapted_weights() -> None:
    model = _mlp()
    theta = _theta(model)
    support, query = _data(1, 6), _data(2, 9)
    loss = _query_loss(model, theta, support, query, steps=3, lr=0.5, first_order=True)
    grads = torch.autograd.grad(loss, list(theta.values()))
    # Closed form (Finn et al., 2017, Sec. 5.2): dL_q/dphi at phi from plain, graph-free SGD.
    phi = {k: v.detach() for k, v in theta.items()}
    for _ in range(3):
        phi = {k: v.requires_grad_() for k, v in phi.items()}
        support_loss = F.cross_entropy(functional_call(model, phi, (support[0],)), support[1])
        g = torch.autograd.grad(support_loss, list(phi.values()))
        phi = {k: (v - 0.5 * gk).detach() for (k, v), gk in zip(phi.items(), g)}
    phi = {k: v.requires_grad_() for k, v in phi.items()}
    query_loss = F.cross_entropy(functional_call(model, phi, (query[0],)), query[1])
    expected = torch.autograd.grad(query_loss, list(phi.values()))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_anil_adapts_only_the_head_and_the_meta_gradient_reaches_the_body() -> None:
    model = _mlp()
    theta = _theta(model)
    support, query = _data(1, 6), _data(2, 9)
    head = ["head.weight", "head.bias"]
    fast = adapt(model, theta, support, steps=2, lr=0.5, adapt_keys=head)
    assert [k for k in theta if not torch.equal(fast[k], theta[k])] == head
    assert all(fast[k] is theta[k] for k in theta if k not in head)

    kwargs = dict(steps=2, lr=0.5, adapt_keys=head)
    loss = _query_loss(model, theta, support, query, **kwargs)
    grads = dict(zip(theta, torch.autograd.grad(loss, list(theta.values()))))
    assert all(grads[k].abs().max() > 1e-4 for k in theta)  # body included
    fd = _fd_grad(lambda p: _query_loss(model, p, support, query, **kwargs), theta)
    assert _max_err(grads, fd) < 1e-9

    # The ANIL learner fills the same gradient into the body's .grad.
    learner = ANIL(model, inner_lr=0.5, inner_steps=2, vectorize="loop")
    learner.backward([Task(support, query)])
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[k], rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- learning rates


def _hand_adapt(model: nn.Module, theta: Params, support, rate: Callable, steps: int) -> Params:
    """phi_{s+1} = phi_s - rate(name, s) * grad (Finn et al., 2017, Eq. 1), spelled out."""
    phi = dict(theta)
    for s in range(steps):
        names = [k for k in phi if rate(k, s) is not None]
        loss = F.cross_entropy(functional_call(model, phi, (support[0],)), support[1])
        grads = torch.autograd.grad(loss, [phi[k] for k in names], create_graph=True)
        phi = {**phi, **{k: phi[k] - rate(k, s) * g for k, g in zip(names, grads)}}
    return phi


def _lr_cases(theta: Params) -> dict[str, tuple[object, Callable]]:
    """Each learning-rate form and an independent rate(name, step) to check it against."""
    g = torch.Generator().manual_seed(5)
    per_param = {k: 0.1 * (i + 1) for i, k in enumerate(theta)}
    elementwise = {k: torch.rand(v.shape, generator=g, dtype=F64) for k, v in theta.items()}
    return {
        "float": (0.3, lambda k, s: 0.3),
        "tensor": (torch.tensor(0.3, dtype=F64), lambda k, s: 0.3),
        "per_param": (per_param, lambda k, s: per_param[k]),
        "subset": ({"head.weight": 0.2}, lambda k, s: 0.2 if k == "head.weight" else None),
        "per_step": ([0.3, 0.1, 0.05], lambda k, s: [0.3, 0.1, 0.05][s]),
        "short_list": ([0.3, 0.1], lambda k, s: 0.3 if s == 0 else 0.1),
        "elementwise": (elementwise, lambda k, s: elementwise[k]),
        "per_step_dicts": (
            [per_param, {"head.bias": 0.7}],
            lambda k, s: per_param[k] if s == 0 else (0.7 if k == "head.bias" else None),
        ),
    }


@pytest.mark.parametrize(
    "form",
    ["float", "tensor", "per_param", "subset", "per_step", "short_list", "elementwise",
     "per_step_dicts"],
)  # fmt: skip
def test_learning_rate_forms_match_a_hand_written_update(form: str) -> None:
    model = _mlp()
    theta = _theta(model)
    support = _data(1, 6)
    lr, rate = _lr_cases(theta)[form]
    fast = adapt(model, theta, support, steps=3, lr=lr)
    expected = _hand_adapt(model, theta, support, rate, steps=3)
    assert list(fast) == list(theta)
    for k in theta:
        torch.testing.assert_close(fast[k], expected[k], rtol=0, atol=1e-12)


def test_learnable_learning_rates_receive_the_finite_difference_gradient() -> None:
    model = _mlp()
    theta = {k: v.detach() for k, v in _theta(model).items()}
    support, query = _data(1, 6), _data(2, 9)
    g = torch.Generator().manual_seed(7)
    rates = {  # a scalar, one scalar per step (MAML++), elementwise (Meta-SGD)
        "scalar": torch.tensor(0.4, dtype=F64),
        "step0": torch.tensor(0.5, dtype=F64),
        "step1": torch.tensor(0.2, dtype=F64),
        **{f"meta_sgd.{k}": 0.3 * torch.rand(v.shape, generator=g, dtype=F64)
           for k, v in theta.items()},
    }  # fmt: skip

    def objective(r: Params) -> Tensor:
        scalar = _query_loss(model, theta, support, query, steps=2, lr=r["scalar"])
        per_step = _query_loss(model, theta, support, query, steps=2, lr=[r["step0"], r["step1"]])
        meta_sgd = {k: r[f"meta_sgd.{k}"] for k in theta}
        elementwise = _query_loss(model, theta, support, query, steps=2, lr=meta_sgd)
        return scalar + 2 * per_step + 3 * elementwise

    leaves = {k: v.clone().requires_grad_() for k, v in rates.items()}
    grads = dict(zip(leaves, torch.autograd.grad(objective(leaves), list(leaves.values()))))
    fd = _fd_grad(objective, rates)
    assert all(grads[k].abs().max() > 1e-4 for k in ("scalar", "step0", "step1"))
    assert _max_err(grads, fd) < 1e-9


# ------------------------------------------------------------------------ two inner gradients


@pytest.mark.parametrize("first_order", [False, True])
def test_inner_step_equals_a_hand_written_autograd_step(first_order: bool) -> None:
    """The inner step (torch.func.grad_and_value, in the loop and under vmap alike) against
    an independent reference written with torch.autograd.grad: same losses, fast weights and
    meta-gradients, learnable rates included (Meta-SGD's elementwise ones), with batch norm,
    an ANIL-style subset and a parameter the support loss never reaches."""
    torch.manual_seed(0)
    model = Conv4(ways=3, hidden=3).to(F64)
    theta = _theta(model)
    theta["unused"] = torch.randn(2, dtype=F64, requires_grad=True)
    g = torch.Generator().manual_seed(3)
    lr = {k: (0.2 * torch.rand(v.shape, generator=g, dtype=F64)).requires_grad_()
          for k, v in theta.items() if not k.startswith("features.0")}  # fmt: skip
    support, query = _conv_task(1, n=6)
    leaves = [*theta.values(), *lr.values()]

    def query_grads(fast: Params) -> tuple[Tensor | None, ...]:
        params = {k: v for k, v in fast.items() if k != "unused"}
        loss = F.cross_entropy(functional_call(model, params, (query[0],)), query[1])
        return torch.autograd.grad(loss, leaves, allow_unused=True)

    fast, losses = run_inner_loop(model, theta, support, InnerLoop(2, lr, first_order))
    ref, ref_losses = dict(theta), []
    for _ in range(2):
        inputs = {k: ref[k].detach().requires_grad_() if first_order else ref[k] for k in lr}
        params = {k: v for k, v in {**ref, **inputs}.items() if k != "unused"}
        loss = F.cross_entropy(functional_call(model, params, (support[0],)), support[1])
        grads = torch.autograd.grad(
            loss, list(inputs.values()), create_graph=not first_order, allow_unused=True
        )
        for k, grad in zip(inputs, grads):
            grad = torch.zeros_like(ref[k]) if grad is None else grad
            ref[k] = ref[k] - lr[k] * (grad.detach() if first_order else grad)
        ref_losses.append(loss)
    torch.testing.assert_close(losses, torch.stack(ref_losses), rtol=0, atol=1e-12)
    for k in theta:
        torch.testing.assert_close(fast[k], ref[k], rtol=0, atol=1e-12)
    assert fast["unused"] is not theta["unused"]  # adapted by a zero gradient, as vmap does
    got, want = query_grads(fast), query_grads(ref)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # Not vacuous: the first layer (not adapted) and the head's rate get real gradients.
    named = dict(zip([*theta, *(f"lr.{k}" for k in lr)], got))
    assert all(named[k].abs().max() > 1e-6 for k in ("features.0.conv.weight", "lr.head.weight"))


def test_inner_step_under_no_grad_builds_no_graph() -> None:
    """evaluate() adapts under no_grad: the inner gradient still flows, nothing else does."""
    torch.manual_seed(0)
    model = Conv4(ways=3, hidden=3).to(F64)
    theta = _theta(model)
    support, _ = _conv_task(1, n=6)
    with torch.no_grad():
        fast = adapt(model, theta, support, steps=2, lr=0.3)
    expected = adapt(model, {k: v.detach() for k, v in theta.items()}, support, steps=2, lr=0.3,
                     first_order=True)  # fmt: skip
    for k in theta:
        assert fast[k].grad_fn is None and not fast[k].requires_grad
        torch.testing.assert_close(fast[k], expected[k], rtol=0, atol=1e-12)
        assert not torch.equal(fast[k], theta[k])


# --------------------------------------------------------------------------- checkpointing


def _conv_task(seed: int, n: int = 20) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * n, 1, 8, 8, generator=g, dtype=F64)
    y = torch.arange(2 * n) % 3
    return (x[:n], y[:n]), (x[n:], y[n:])


@pytest.mark.parametrize("first_order", [False, True])
def test_checkpointing_gives_the_same_values_and_meta_gradients(first_order: bool) -> None:
    torch.manual_seed(0)
    model = Conv4(ways=3, hidden=3).to(F64)
    theta = _theta(model)
    lr = torch.tensor(0.3, dtype=F64, requires_grad=True)  # learnable: must get its gradient
    support, query = _conv_task(1, n=6)
    leaves = [*theta.values(), lr]
    results = []
    for checkpoint in (False, True):
        fast, losses = run_inner_loop(
            model, theta, support,
            InnerLoop(steps=3, lr=lr, first_order=first_order, checkpoint=checkpoint),
        )  # fmt: skip
        loss = F.cross_entropy(functional_call(model, fast, (query[0],)), query[1])
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        results.append((fast, losses, loss, grads))
    (fast0, losses0, loss0, grads0), (fast1, losses1, loss1, grads1) = results
    for k in theta:
        torch.testing.assert_close(fast1[k], fast0[k], rtol=0, atol=1e-12)
    torch.testing.assert_close(losses1, losses0, rtol=0, atol=1e-12)
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=1e-12)
    for g1, g0 in zip(grads1, grads0):
        if g0 is None:  # the first-order lr gradient is still defined: phi = theta - lr * g
            assert g1 is None
        else:
            torch.testing.assert_close(g1, g0, rtol=0, atol=1e-12)


class _LiveStorages(TorchDispatchMode):
    """Records every storage an op creates; `live_bytes` counts those still alive.

    Run over a forward pass, what stays alive afterwards is what the autograd graph keeps for
    the backward (and the outputs): a deterministic measure of the graph's memory on CPU,
    unlike RSS. Saved-tensor hooks cannot measure it: torch.func.grad refuses them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                s = t.untyped_storage()
                self.storages[s.data_ptr()] = (StorageWeakRef(s), s.nbytes())
        return out

    def live_bytes(self) -> int:
        gc.collect()
        return sum(n for ref, n in self.storages.values() if not ref.expired())


def _graph_bytes(model: nn.Module, theta: Params, steps: int, **kwargs) -> int:
    support, query = _conv_task(3)
    tracker = _LiveStorages()
    with tracker:
        fast = adapt(model, theta, support, steps=steps, lr=0.1, **kwargs)
        loss = F.cross_entropy(functional_call(model, fast, (query[0],)), query[1])
    del fast
    held = tracker.live_bytes()
    del loss
    return held


def test_checkpointing_keeps_only_the_fast_weights_per_step() -> None:
    """Memory kept for the backward, 2 vs 8 inner steps, 20 support images.

    Measured (torch 2.13 CPU, this Conv4 of 318 parameters = 2544 bytes): second order
    without checkpointing 137,608 -> 482,776 bytes (+57,528 per step, activations and the
    double-backward graph); with checkpointing 29,584 -> 44,848 (+2,544 per step: exactly
    one copy of the fast weights phi_s, which the recomputation needs). So checkpointing
    makes the activation memory flat in steps, not the whole: phi_s per step remains.
    First order keeps 27,160 bytes at any step count, with or without checkpointing: its
    inner gradients are constants, so phi = theta - sum(alpha g_s) keeps nothing per step.
    """
    torch.manual_seed(0)
    model = Conv4(ways=3, hidden=3).to(F64)
    theta = _theta(model)
    param_bytes = sum(v.numel() * v.element_size() for v in theta.values())

    def growth(**kwargs) -> float:
        return (
            _graph_bytes(model, theta, 8, **kwargs) - _graph_bytes(model, theta, 2, **kwargs)
        ) / 6

    plain, checkpointed = growth(), growth(checkpoint=True)
    assert plain > 10 * param_bytes
    assert checkpointed <= param_bytes
    assert growth(first_order=True) == 0


# --------------------------------------------------------------------------- control flow


def test_nonfinite_support_loss_names_the_task_and_the_inner_step() -> None:
    model = _mlp()
    theta = _theta(model)
    x, y = _data(1, 6)
    # An infinite rate: the loss at theta (step 0) is finite, the loss at phi_1 is not.
    with pytest.raises(NonFiniteLossError, match="task 7 at inner step 1") as info:
        adapt(model, theta, (x, y), steps=3, lr=math.inf, check_finite=True, task_index=7)
    assert (info.value.task_index, info.value.step) == (7, 1)
    bad = x.clone()
    bad[2, 1] = math.nan
    with pytest.raises(NonFiniteLossError, match="task 0 at inner step 0"):
        adapt(model, theta, (bad, y), steps=3, check_finite=True, task_index=0)


def _mlp_tasks(count: int, nan_task: int | None = None) -> list[Task]:
    tasks = [Task(_data(10 + i, 6), _data(20 + i, 6)) for i in range(count)]
    if nan_task is not None:
        tasks[nan_task].support[0][0, 0] = math.nan
    return tasks


@pytest.mark.parametrize("vectorize", ["loop", "vmap"])
def test_meta_batch_raises_or_skips_a_nonfinite_task(vectorize: str) -> None:
    model = _mlp()
    theta = _theta(model)
    inner = InnerLoop(steps=2, lr=0.5)
    tasks = _mlp_tasks(4, nan_task=2)
    with pytest.raises(NonFiniteLossError, match="task 2 at inner step 0"):
        meta_batch(model, theta, tasks, inner, vectorize=vectorize)

    result = meta_batch(model, theta, tasks, inner, vectorize=vectorize, on_nonfinite="skip")
    assert result.skipped == [2]
    assert math.isnan(result.task_losses[2])
    good = [t for i, t in enumerate(tasks) if i != 2]
    reference = meta_batch(model, theta, good, inner, vectorize="loop")
    torch.testing.assert_close(result.loss, reference.loss, rtol=0, atol=1e-12)
    # The dropped task must not leak into the others' meta-gradient (under vmap a shared
    # backward would give 0 * NaN = NaN).
    grads = torch.autograd.grad(result.loss, list(theta.values()))
    expected = torch.autograd.grad(reference.loss, list(theta.values()))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_learner_counts_skipped_tasks() -> None:
    model = _mlp()
    learner = ANIL(model, inner_lr=0.5, on_nonfinite="skip")
    metrics = learner.backward(_mlp_tasks(3, nan_task=0))
    assert metrics.skipped == 1
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_stop_rule_ends_the_inner_loop_early() -> None:
    model = _mlp()
    theta = _theta(model)
    support = _data(1, 6)
    seen: list[tuple[int, float]] = []

    def stop(step: int, loss: float) -> bool:
        seen.append((step, loss))
        return step == 2

    fast, losses = run_inner_loop(model, theta, support, InnerLoop(5, 0.5), stop=stop)
    two, two_losses = run_inner_loop(model, theta, support, InnerLoop(2, 0.5))
    assert len(losses) == 2
    assert [s for s, _ in seen] == [0, 1, 2]
    torch.testing.assert_close(losses, two_losses, rtol=0, atol=0)
    assert [loss for _, loss in seen[:2]] == losses.tolist()
    for k in theta:
        torch.testing.assert_close(fast[k], two[k], rtol=0, atol=0)
    # A loss threshold: it stops as soon as the support loss is low enough.
    fast, losses = run_inner_loop(
        model, theta, support, InnerLoop(50, 0.5), stop=lambda s, loss: loss < 0.5
    )
    assert 0 < len(losses) < 50 and bool((losses >= 0.5).all())


def test_zero_steps_and_bad_arguments() -> None:
    model = _mlp()
    theta = _theta(model)
    fast, losses = run_inner_loop(model, theta, _data(1, 6), InnerLoop(steps=0))
    assert all(fast[k] is theta[k] for k in theta) and losses.numel() == 0
    with pytest.raises(ValueError, match="steps"):
        adapt(model, theta, _data(1, 6), steps=-1)
    with pytest.raises(ValueError, match="adapt_keys"):
        adapt(model, theta, _data(1, 6), adapt_keys=["head.nope"])
    with pytest.raises(ValueError, match="empty"):
        adapt(model, theta, _data(1, 6), lr=[])
