"""BOIL (Oh et al., 2021): the body adapts in the inner loop, the head stays theta's.

The reference is the update written out in float64: a Conv4 forward by hand (``F.conv2d``,
batch norm from its formula), inner steps on the body by ``torch.autograd.grad`` with
``create_graph=True``, the head held at theta, the query loss's gradient w.r.t. all of theta.
The body includes batch norm's weight and bias, as in HJ-Yoo/BOIL (cba95c1), whose
``update_parameters`` (``maml/utils.py`` lines 175-184) steps every parameter of
``model.meta_named_parameters()`` but the ``classifier``'s, its ``MetaBatchNorm2d``'s
affine ones included.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metalearn.algorithms.boil import BOIL
from metalearn.engine import Task
from metalearn.models import MLP, Conv4

F64 = torch.float64
HEAD = ("head.weight", "head.bias")


def _conv4(seed: int = 0) -> Conv4:
    torch.manual_seed(seed)
    return Conv4(in_channels=1, ways=3, hidden=4).to(F64)


def _tasks(n: int, seed: int = 1) -> list[Task]:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(3).repeat(2)
    tasks = []
    for _ in range(n):
        x = torch.randn(12, 1, 28, 28, generator=g, dtype=F64)
        tasks.append(Task((x[:6], y), (x[6:], y)))
    return tasks


def _forward(p: dict, x: torch.Tensor, model: Conv4) -> torch.Tensor:
    """`Conv4` written out: conv, batch norm over (N, H, W), ReLU, pooling; then the head."""
    h = x
    for i, block in enumerate(model.features):
        pre = f"features.{i}"
        h = F.conv2d(h, p[f"{pre}.conv.weight"], p[f"{pre}.conv.bias"],
                     stride=block.conv.stride, padding=1)  # fmt: skip
        mean = h.mean((0, 2, 3), keepdim=True)
        var = ((h - mean) ** 2).mean((0, 2, 3), keepdim=True)
        h = (h - mean) / torch.sqrt(var + 1e-5)
        h = h * p[f"{pre}.norm.weight"][:, None, None] + p[f"{pre}.norm.bias"][:, None, None]
        h = torch.relu(h)
        if isinstance(block.pool, torch.nn.MaxPool2d):
            h = F.max_pool2d(h, 2)
    h = h.flatten(1) if model.head_kind == "flatten" else h.mean((2, 3))
    return h @ p["head.weight"].T + p["head.bias"]


NORMS = {f"features.{i}.norm.{w}" for i in range(4) for w in ("weight", "bias")}


def _reference(model: Conv4, tasks: list[Task], lr: float, steps: int, norms: bool = True) -> dict:
    """Mean query loss after ``steps`` body-only SGD steps (the norm layers' weights among
    the body's unless ``norms`` is False), differentiated w.r.t. theta."""
    theta = {k: v.detach().clone().requires_grad_() for k, v in model.named_parameters()}
    total = 0.0
    for task in tasks:
        phi = dict(theta)
        body = [k for k in theta if k not in HEAD and (norms or k not in NORMS)]
        for _ in range(steps):
            loss = F.cross_entropy(_forward(phi, task.support[0], model), task.support[1])
            grads = torch.autograd.grad(loss, [phi[k] for k in body], create_graph=True)
            phi = {**phi, **{k: phi[k] - lr * g for k, g in zip(body, grads)}}
        total = total + F.cross_entropy(_forward(phi, task.query[0], model), task.query[1])
    grads = torch.autograd.grad(total / len(tasks), list(theta.values()))
    return dict(zip(theta, grads))


@pytest.mark.parametrize("vectorize", ["loop", "vmap"])
def test_meta_gradient_equals_the_body_only_inner_loop_written_out(vectorize):
    model, tasks = _conv4(), _tasks(3)
    learner = BOIL(model, inner_lr=0.3, inner_steps=2, vectorize=vectorize)
    learner.backward(tasks)
    expected = _reference(model, tasks, 0.3, 2)
    for name, p in learner.named_parameters():
        key = name.removeprefix("model.")
        torch.testing.assert_close(p.grad, expected[key], rtol=1e-9, atol=1e-12, msg=name)
    # The head is meta-learned: the outer loop reaches it through the query loss.
    assert float(learner.model.head.weight.grad.abs().max()) > 1e-6


def test_norm_weights_adapt_by_default_as_the_reference_and_adapt_norm_false_holds_them():
    model, tasks = _conv4(), _tasks(2)
    assert BOIL(model).adapt_norm and NORMS <= set(BOIL(model).adapt_keys)
    held = BOIL(model, inner_lr=0.3, inner_steps=2, adapt_norm=False, vectorize="loop")
    fast = held.fast_weight_names(tasks)  # the body, less what the forward feeds to its norms
    assert NORMS.isdisjoint(fast) and "features.0.conv.weight" in fast
    held.backward(tasks)
    expected = _reference(model, tasks, 0.3, 2, norms=False)
    for name, p in held.named_parameters():
        key = name.removeprefix("model.")
        torch.testing.assert_close(p.grad, expected[key], rtol=1e-9, atol=1e-12, msg=name)
    adapted = _reference(model, tasks, 0.3, 2)
    assert max(float((adapted[k] - expected[k]).abs().max()) for k in expected) > 1e-4


def test_adaptation_moves_the_body_and_keeps_the_head():
    model, (task,) = _conv4(), _tasks(1)
    fast = BOIL(model, inner_lr=0.3, inner_steps=3).adapt(task)
    theta = {k: v.detach() for k, v in model.named_parameters()}
    for k in HEAD:
        assert torch.equal(fast[k], theta[k])
    # Every body weight moves (a conv bias before batch norm has a zero support gradient:
    # the mean removes it).
    for k in theta:
        if k not in HEAD and "conv.bias" not in k:
            assert float((fast[k] - theta[k]).abs().max()) > 1e-6, k


def test_a_model_without_the_named_head_or_with_no_body_is_refused():
    with pytest.raises(ValueError, match="no parameter of the model is named 'classifier'"):
        BOIL(_conv4(), head="classifier")
    with pytest.raises(ValueError, match="BOIL has no body to adapt"):
        BOIL(MLP(4, [], 3))
    with pytest.raises(ValueError, match="^inner_beta1=1.0 is out of range"):
        BOIL(_conv4(), inner_optimizer="adam", inner_beta1=1.0)
