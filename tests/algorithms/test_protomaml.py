"""Proto-MAML against independent references, in float64.

References: prototypes and nearest-prototype distances computed from Conv4's own feature
stack (not the identity-head trick); the meta-gradient of a hand-written second-order
Proto-MAML step with ``torch.autograd.grad``; the loop path for vmap; a build round trip.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from metalearn.algorithms import ProtoMAML, make_learner, prototype_head
from metalearn.engine import Task
from metalearn.models import Conv4

WAYS, SHOTS, QUERIES = 3, 2, 2
EXACT = 1e-12


def conv(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Conv4(in_channels=1, ways=WAYS, hidden=4).double()


def tasks(n: int = 3, seed: int = 1) -> list[Task]:
    g = torch.Generator().manual_seed(seed)
    ys = torch.arange(WAYS).repeat_interleave(SHOTS), torch.arange(WAYS).repeat(QUERIES)

    def x(y: Tensor) -> Tensor:
        return torch.randn(len(y), 1, 8, 8, generator=g, dtype=torch.float64)

    return [Task((x(ys[0]), ys[0]), (x(ys[1]), ys[1])) for _ in range(n)]


def features(model: Conv4, params: dict[str, Tensor], x: Tensor) -> Tensor:
    """Conv4's features before the head, from its feature stack alone: ``[B, D]``."""
    body = {k[len("features.") :]: v for k, v in params.items() if k.startswith("features.")}
    return functional_call(model.features, body, (x,)).mean((-2, -1))


def test_prototype_head_classifies_by_nearest_prototype():
    model, task = conv(), tasks(1)[0]
    theta = dict(model.named_parameters())
    with torch.no_grad():
        head = prototype_head(model, theta, task.support)
        f_support = features(model, theta, task.support[0])
        protos = torch.stack([f_support[task.support[1] == k].mean(0) for k in range(WAYS)])
        f_query = features(model, theta, task.query[0])
        logits = functional_call(model, {**theta, **head}, (task.query[0],))
    torch.testing.assert_close(head["head.weight"], 2 * protos, atol=EXACT, rtol=0)
    # 2 c.f - |c|^2 = |f|^2 - |f - c|^2: the prototypical network's logits up to a shift.
    distance = torch.cdist(f_query, protos) ** 2
    shift = (f_query**2).sum(1, keepdim=True)
    torch.testing.assert_close(logits, shift - distance, atol=1e-10, rtol=0)


def reference_meta_gradient(model: Conv4, tasks_: list[Task], lr: float) -> dict[str, Tensor]:
    """Second-order Proto-MAML with one inner step, written out with autograd.grad."""
    theta = dict(model.named_parameters())
    body = {k: v for k, v in theta.items() if not k.startswith("head.")}
    total = 0.0
    for task in tasks_:
        (xs, ys), (xq, yq) = task.support, task.query
        f = features(model, theta, xs)
        protos = torch.stack([f[ys == k].mean(0) for k in range(WAYS)])
        # The inner loop's variables: copies of theta's body (so that the inner gradient is
        # the partial one, the head held fixed) and the prototype head.
        start = {k: v * 1.0 for k, v in body.items()}
        start.update({"head.weight": 2 * protos, "head.bias": -(protos**2).sum(1)})
        support_loss = F.cross_entropy(functional_call(model, start, (xs,)), ys)
        steps = torch.autograd.grad(support_loss, list(start.values()), create_graph=True)
        fast = {k: v - lr * g for (k, v), g in zip(start.items(), steps)}
        total = total + F.cross_entropy(functional_call(model, fast, (xq,)), yq)
    names = list(body)
    grads = torch.autograd.grad(total / len(tasks_), [theta[n] for n in names])
    return dict(zip(names, grads))


@pytest.mark.parametrize("vectorize", ["loop", "vmap"])
def test_meta_gradient_matches_hand_written_second_order(vectorize):
    model, batch = conv(), tasks()
    reference = reference_meta_gradient(model, batch, lr=0.3)
    learner = ProtoMAML(model, inner_lr=0.3, inner_steps=1, vectorize=vectorize)
    learner.zero_grad(set_to_none=True)
    learner.backward(batch)
    for name, p in learner.model.named_parameters():
        if name.startswith("head."):
            assert p.grad is None, f"{name}: the prototype head replaces it, so no gradient"
        else:
            torch.testing.assert_close(p.grad, reference[name], atol=1e-10, rtol=1e-9)


def test_zero_steps_is_a_prototypical_network():
    model, batch = conv(), tasks(4, seed=5)
    learner = ProtoMAML(model)
    _, accuracy = learner.evaluate(batch, steps=0)
    theta = dict(model.named_parameters())
    with torch.no_grad():
        for task, acc in zip(batch, accuracy):
            f = features(model, theta, task.support[0])
            protos = torch.stack([f[task.support[1] == k].mean(0) for k in range(WAYS)])
            nearest = torch.cdist(features(model, theta, task.query[0]), protos).argmin(1)
            assert float(acc) == pytest.approx(float((nearest == task.query[1]).double().mean()))


def test_adapt_equals_evaluate_path():
    model, task = conv(), tasks(1, seed=7)[0]
    learner = ProtoMAML(model, inner_lr=0.2, inner_steps=2)
    fast = learner.adapt(task, steps=3)
    with torch.no_grad():
        logits = functional_call(model, fast, (task.query[0],))
    loss, acc = learner.evaluate([task], steps=3)
    torch.testing.assert_close(F.cross_entropy(logits, task.query[1]), loss[0], atol=1e-10, rtol=0)


def test_built_by_name_and_needs_a_linear_head():
    learner = make_learner("protomaml", Conv4(hidden=8), {})
    assert isinstance(learner, ProtoMAML) and learner.inner_lr == 0.4
    with pytest.raises(ValueError, match="no 2-d parameter 'classifier.weight'"):
        ProtoMAML(conv(), head="classifier")
