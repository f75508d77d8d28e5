"""Per-task branches (`metalearn.models.dynamic`) and LoRA fast weights
(`metalearn.models.lora`) on the engine: their definitions written out by hand, their
meta-gradients against finite differences, and mixed meta-batches against running each task
alone. Float64, fixed seeds, fixed tolerances.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from metalearn.algorithms.maml import MAML
from metalearn.engine import InnerLoop, Task, adapt, meta_batch
from metalearn.models import MLP, Conv4
from metalearn.models.dynamic import DynamicBlock, DynamicNet, dynamic_conv, dynamic_mlp
from metalearn.models.lora import LoRALinear, add_lora, lora_keys

F64 = torch.float64
Params = dict[str, Tensor]


def _theta(model: nn.Module) -> Params:
    return {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}


def _grads(loss: Tensor, theta: Params) -> Params:
    return dict(zip(theta, torch.autograd.grad(loss, list(theta.values()), allow_unused=True)))


def _assert_close(a: Params, b: Params, atol: float) -> None:
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol)


def _vector_task(seed: int, n: int = 6, d: int = 4, ways: int = 3, **kwargs) -> Task:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * n, d, generator=g, dtype=F64)
    y = torch.arange(2 * n) % ways
    return Task((x[:n], y[:n]), (x[n:], y[n:]), **kwargs)


def _image_task(seed: int, n: int = 6, **kwargs) -> Task:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * n, 1, 8, 8, generator=g, dtype=F64)
    y = torch.arange(2 * n) % 3
    return Task((x[:n], y[:n]), (x[n:], y[n:]), **kwargs)


def _one_by_one(model: nn.Module, theta: Params, tasks: list[Task], inner: InnerLoop) -> Tensor:
    """The meta-batch loss written out: each task adapted on its own, then the mean."""
    losses = []
    for t in tasks:
        kwargs = dict(t.model_kwargs)
        fast = adapt(
            model, theta, t.support, steps=inner.steps, lr=inner.lr,
            adapt_keys=inner.adapt_keys, model_kwargs=kwargs,
        )  # fmt: skip
        losses.append(
            F.cross_entropy(functional_call(model, fast, (t.query[0],), kwargs), t.query[1])
        )
    return torch.stack(losses).mean()


def _directional_fd_error(objective: Callable[[Params], Tensor], theta: Params, seed: int) -> float:
    """max over 3 random directions v of |grad . v - central difference| / max(1, |fd|)."""
    grads = _grads(objective(theta), theta)
    g = torch.Generator().manual_seed(seed)
    eps, worst = 1e-6, 0.0
    for _ in range(3):
        v = {k: torch.randn(t.shape, generator=g, dtype=F64) for k, t in theta.items()}
        with torch.no_grad():
            plus = objective({k: theta[k] + eps * v[k] for k in theta})
            minus = objective({k: theta[k] - eps * v[k] for k in theta})
        fd = float((plus - minus) / (2 * eps))
        analytic = float(sum((grads[k] * v[k]).sum() for k in theta))
        worst = max(worst, abs(analytic - fd) / max(1.0, abs(fd)))
    return worst


# --------------------------------------------------------------------------- DynamicBlock


def test_dynamic_block_is_residual_or_its_shortcut() -> None:
    torch.manual_seed(0)
    body, projection = nn.Linear(4, 4).to(F64), nn.Linear(4, 4, bias=False).to(F64)
    x = torch.randn(5, 4, dtype=F64)
    block = DynamicBlock(body)
    torch.testing.assert_close(block(x), body(x) + x, rtol=0, atol=0)
    torch.testing.assert_close(block(x, skip=True), x, rtol=0, atol=0)
    projected = DynamicBlock(body, shortcut=projection)
    torch.testing.assert_close(projected(x), body(x) + projection(x), rtol=0, atol=0)
    torch.testing.assert_close(projected(x, skip=True), projection(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="model_kwargs"):
        block(x, skip=torch.tensor(True))  # type: ignore[arg-type]

    net = dynamic_mlp(4, 6, 2, 3).to(F64)
    h = net.stem(x)
    second = net.blocks[1].body(h) + h  # first block skipped, second taken
    torch.testing.assert_close(net(x, skip=(True, False)), net.head(second), rtol=0, atol=0)
    torch.testing.assert_close(net(x, skip=True), net.head(h), rtol=0, atol=0)
    with pytest.raises(ValueError, match="one bool per block"):
        net(x, skip=(True,))
    with pytest.raises(ValueError, match="DynamicBlock"):
        DynamicNet(nn.Identity(), [nn.Linear(4, 4)], nn.Identity())  # type: ignore[list-item]


def test_a_skipped_block_is_not_adapted_and_gets_no_meta_gradient() -> None:
    torch.manual_seed(0)
    model = dynamic_mlp(4, 6, 2, 3).to(F64)
    theta = _theta(model)
    task = _vector_task(0, model_kwargs={"skip": (True, False)})
    fast = adapt(model, theta, task.support, steps=2, lr=0.5, model_kwargs=task.model_kwargs)
    changed = [k for k in theta if not torch.equal(fast[k], theta[k])]
    assert changed and not any(k.startswith("blocks.0.") for k in changed)
    assert any(k.startswith("blocks.1.") for k in changed)
    result = meta_batch(model, theta, [task], InnerLoop(steps=2, lr=0.5))
    grads = _grads(result.loss, theta)
    assert all(grads[k] is None for k in theta if k.startswith("blocks.0."))


@pytest.mark.parametrize("vectorize", ["vmap", "loop"])
def test_mixed_branches_give_the_meta_gradient_of_the_tasks_one_by_one(vectorize: str) -> None:
    torch.manual_seed(0)
    model = dynamic_conv(in_channels=1, ways=3, hidden=3, depth=2).to(F64)
    theta = _theta(model)
    branches = [False, True, (True, False), False, True, (True, False)]
    tasks = [_image_task(i, model_kwargs={"skip": b}) for i, b in enumerate(branches)]
    inner = InnerLoop(steps=2, lr=0.3)
    result = meta_batch(model, theta, tasks, inner, vectorize=vectorize)
    # One vmap bucket per branch: model_kwargs is part of the bucket key.
    assert result.vectorized == (6 if vectorize == "vmap" else 0)
    expected = _one_by_one(model, theta, tasks, inner)
    torch.testing.assert_close(result.loss, expected, rtol=0, atol=1e-12)
    _assert_close(_grads(result.loss, theta), _grads(expected, theta), atol=1e-10)


def test_mixed_branches_meta_gradient_matches_finite_differences() -> None:
    torch.manual_seed(0)
    model = dynamic_mlp(4, 6, 2, 3).to(F64)
    theta = _theta(model)
    tasks = [
        _vector_task(i, model_kwargs={"skip": b})
        for i, b in enumerate([True, False, True, (False, True)])
    ]
    inner = InnerLoop(steps=2, lr=0.5)

    def objective(p: Params) -> Tensor:
        return meta_batch(model, p, tasks, inner, vectorize="vmap").loss

    assert _directional_fd_error(objective, theta, seed=3) < 1e-9


# --------------------------------------------------------------------------- LoRA


def test_lora_linear_is_w_plus_scaled_ba() -> None:
    torch.manual_seed(0)
    base = nn.Linear(4, 3).to(F64)
    layer = LoRALinear(base, rank=2, alpha=6.0)
    assert layer.weight is base.weight and layer.bias is base.bias
    assert [k for k, _ in layer.named_parameters()] == ["weight", "bias", "lora_A", "lora_B"]
    x = torch.randn(5, 4, dtype=F64)
    torch.testing.assert_close(layer(x), base(x), rtol=0, atol=0)  # B = 0 at the start
    b = torch.randn(3, 2, dtype=F64)
    params = {**dict(layer.named_parameters()), "lora_B": b}
    # Hu et al. (2021), Eq. 3 with the alpha / r scaling of Sec. 4.1.
    weight = base.weight + (6.0 / 2) * b @ layer.lora_A
    torch.testing.assert_close(
        functional_call(layer, params, (x,)), x @ weight.T + base.bias, rtol=0, atol=1e-12
    )
    with pytest.raises(ValueError, match="rank"):
        LoRALinear(base, rank=0)
    with pytest.raises(ValueError, match="nn.Linear"):
        LoRALinear(nn.Conv2d(1, 1, 3), rank=1)  # type: ignore[arg-type]


def test_add_lora_leaves_the_original_alone_and_selects_targets() -> None:
    torch.manual_seed(0)
    model = MLP(4, [5, 5], 3).to(F64)
    names = [k for k, _ in model.named_parameters()]
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    adapted = add_lora(model, rank=2, alpha=2.0)

    assert [k for k, _ in model.named_parameters()] == names  # the original is untouched
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    layers = ("features.0", "features.2", "head")
    assert lora_keys(adapted) == [f"{n}.{p}" for n in layers for p in ("lora_A", "lora_B")]
    assert [k for k, _ in adapted.named_parameters() if "lora" not in k] == names
    x = torch.randn(7, 4, dtype=F64)
    torch.testing.assert_close(adapted(x), model(x), rtol=0, atol=0)
    with torch.no_grad():
        adapted.head.weight.add_(1.0)  # a copy: the original's weights do not move
    assert all(torch.equal(v, before[k]) for k, v in model.named_parameters())

    only_head = add_lora(model, 1, target=["head"])
    assert lora_keys(only_head) == ["head.lora_A", "head.lora_B"]
    by_rule = add_lora(model, 1, target=lambda name, layer: layer.in_features == 5)
    assert lora_keys(by_rule) == [
        f"{n}.{p}" for n in ("features.2", "head") for p in ("lora_A", "lora_B")
    ]
    assert lora_keys(add_lora(Conv4(hidden=3), 1)) == ["head.lora_A", "head.lora_B"]
    assert isinstance(add_lora(nn.Linear(3, 2), 1), LoRALinear)  # a bare linear layer
    with pytest.raises(ValueError, match="not nn.Linear"):
        add_lora(model, 1, target=["features.1"])  # a ReLU
    with pytest.raises(ValueError, match=r"\['head'\]"):
        add_lora(model, 1, target="head")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="selects no"):
        add_lora(model, 1, target=lambda name, layer: False)
    with pytest.raises(ValueError, match="add_lora"):
        lora_keys(model)


def _lora_mlp() -> nn.Module:
    torch.manual_seed(0)
    return add_lora(MLP(4, [5], 3, activation=nn.Tanh).to(F64), rank=2, alpha=4.0)


def test_lora_fast_weights_move_only_the_adapters() -> None:
    model = _lora_mlp()
    theta = _theta(model)
    support = _vector_task(0).support
    keys = lora_keys(model)
    one = adapt(model, theta, support, steps=1, lr=0.5, adapt_keys=keys)
    # From B = 0 the gradient of A is zero: the first step moves only B.
    assert [k for k in theta if not torch.equal(one[k], theta[k])] == [
        k for k in keys if k.endswith("lora_B")
    ]
    two = adapt(model, theta, support, steps=2, lr=0.5, adapt_keys=keys)
    assert [k for k in theta if not torch.equal(two[k], theta[k])] == keys


def test_lora_meta_gradient_matches_finite_differences() -> None:
    """The base weights are meta-learned through the adapters' inner loop (second order)."""
    model = _lora_mlp()
    theta = _theta(model)
    tasks = [_vector_task(i) for i in range(3)]
    inner = InnerLoop(steps=2, lr=0.5, adapt_keys=lora_keys(model))

    def objective(p: Params) -> Tensor:
        return meta_batch(model, p, tasks, inner, vectorize="vmap").loss

    grads = _grads(objective(theta), theta)
    assert all(grads[k].abs().max() > 1e-4 for k in theta)
    assert _directional_fd_error(objective, theta, seed=5) < 1e-9


def test_lora_vmap_matches_loop_and_trains_with_maml() -> None:
    model = _lora_mlp()
    theta = _theta(model)
    tasks = [_vector_task(i) for i in range(4)]
    inner = InnerLoop(steps=2, lr=0.5, adapt_keys=lora_keys(model))
    vmapped = meta_batch(model, theta, tasks, inner, vectorize="vmap")
    looped = meta_batch(model, theta, tasks, inner, vectorize="loop")
    assert vmapped.vectorized == 4
    expected = _grads(looped.loss, theta)
    _assert_close(_grads(vmapped.loss, theta), expected, atol=1e-10)

    learner = MAML(model, inner_lr=0.5, inner_steps=2, adapt_keys=lora_keys(model))
    learner.backward(tasks)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[k], rtol=0, atol=1e-10)
