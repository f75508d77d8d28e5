"""Proto-MAML against independent references, in float64.

References: prototypes and nearest-prototype distances computed from Conv4's own feature
stack (not the identity-head trick); the meta-gradient of Proto-MAML written out with
``torch.autograd.grad``: second order with every weight adapted (the learner before its
defaults followed the reference), and the defaults, google-research/meta-dataset's
``MAMLLearner`` with ``proto_maml_fc_layer_init`` (``learners/optimization_learners.py``
lines 118-145 and 510-579; ``learn/gin/learners/maml_init_with_proto_config.gin``): each
inner gradient a constant (``tf.stop_gradient`` when ``first_order``), batch norm's
offset and scale never stepped (``adapt_batch_norm = False``), 5 steps at 0.01; the loop
path for vmap; a build round trip.
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


NORMS = {f"features.{i}.norm.{w}" for i in range(4) for w in ("weight", "bias")}


def support_normed_logits(p: dict[str, Tensor], xs: Tensor, xq: Tensor) -> Tensor:
    """Conv4 (stride 2, ReLU, mean head) written out, the query's batch norms reading the
    support set's moments: each block convolves both sets, takes the mean and biased
    variance of the support maps over (N, H, W), and normalises both with them
    (meta-dataset's ``transductive_batch_norm = False``). The query's logits ``[Q, C]``."""
    hs, hq = xs, xq
    for i in range(4):
        w, b = p[f"features.{i}.conv.weight"], p[f"features.{i}.conv.bias"]
        hs, hq = (F.conv2d(h, w, b, stride=2, padding=1) for h in (hs, hq))
        mean = hs.mean((0, 2, 3), keepdim=True)
        var = ((hs - mean) ** 2).mean((0, 2, 3), keepdim=True)
        gamma = p[f"features.{i}.norm.weight"][:, None, None]
        beta = p[f"features.{i}.norm.bias"][:, None, None]
        hs, hq = (torch.relu((h - mean) / torch.sqrt(var + 1e-5) * gamma + beta)
                  for h in (hs, hq))  # fmt: skip
    return hq.mean((2, 3)) @ p["head.weight"].T + p["head.bias"]


def reference_meta_gradient(
    model: Conv4,
    tasks_: list[Task],
    lr: float,
    steps: int = 1,
    first_order: bool = False,
    adapt_norm: bool = True,
    transductive: bool = True,
) -> dict[str, Tensor]:
    """Proto-MAML written out with autograd.grad: ``steps`` inner steps from the prototype
    head, the norm layers' weights held at theta unless ``adapt_norm``, each inner gradient
    a constant when ``first_order`` (the fast weights, and the prototypes, stay functions
    of theta); the query in its own batch, or (not ``transductive``) normalised with the
    support set's moments at the adapted weights (`support_normed_logits`)."""
    theta = dict(model.named_parameters())
    body = {k: v for k, v in theta.items() if not k.startswith("head.")}
    total = 0.0
    for task in tasks_:
        (xs, ys), (xq, yq) = task.support, task.query
        f = features(model, theta, xs)
        protos = torch.stack([f[ys == k].mean(0) for k in range(WAYS)])
        # The inner loop's variables: copies of theta's body (so that the inner gradient is
        # the partial one, the head held fixed) and the prototype head.
        fast = {k: v * 1.0 for k, v in body.items()}
        fast.update({"head.weight": 2 * protos, "head.bias": -(protos**2).sum(1)})
        adapted = [k for k in fast if adapt_norm or k not in NORMS]
        for _ in range(steps):
            support_loss = F.cross_entropy(functional_call(model, fast, (xs,)), ys)
            grads = torch.autograd.grad(
                support_loss, [fast[k] for k in adapted], create_graph=not first_order,
                retain_graph=True,
            )  # fmt: skip
            fast = {**fast, **{k: fast[k] - lr * g for k, g in zip(adapted, grads)}}
        logits = (functional_call(model, fast, (xq,)) if transductive
                  else support_normed_logits(fast, xs, xq))  # fmt: skip
        total = total + F.cross_entropy(logits, yq)
    names = list(body)
    grads = torch.autograd.grad(total / len(tasks_), [theta[n] for n in names])
    return dict(zip(names, grads))


def assert_meta_gradient(learner: ProtoMAML, batch: list[Task], reference: dict) -> None:
    learner.zero_grad(set_to_none=True)
    learner.backward(batch)
    for name, p in learner.model.named_parameters():
        if name.startswith("head."):
            assert p.grad is None, f"{name}: the prototype head replaces it, so no gradient"
        else:
            torch.testing.assert_close(p.grad, reference[name], atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("vectorize", ["loop", "vmap"])
def test_meta_gradient_matches_hand_written_second_order(vectorize):
    model, batch = conv(), tasks()
    reference = reference_meta_gradient(model, batch, lr=0.3)
    learner = ProtoMAML(model, inner_lr=0.3, inner_steps=1, first_order=False, adapt_norm=True,
                        transductive=True, vectorize=vectorize)  # fmt: skip
    assert_meta_gradient(learner, batch, reference)
    # The reference's reading: the query normalised with the support set's moments.
    reference = reference_meta_gradient(model, batch, lr=0.3, transductive=False)
    learner = ProtoMAML(model, inner_lr=0.3, inner_steps=1, first_order=False, adapt_norm=True,
                        vectorize=vectorize)  # fmt: skip
    assert_meta_gradient(learner, batch, reference)


@pytest.mark.parametrize("vectorize", ["loop", "vmap"])
def test_defaults_are_meta_datasets_first_order_learner_with_norms_held(vectorize):
    """fo-Proto-MAML as meta-dataset's configuration runs it: 5 first-order steps at 0.01,
    batch norm's weights not stepped, the query normalised with the support set's moments;
    at 0.01 the steps move little, so the same learner at a rate of 0.3 is checked too (a
    mix-up of order, of the held norms or of the query's statistics would show)."""
    model, batch = conv(), tasks()
    learner = ProtoMAML(model, vectorize=vectorize)
    assert (learner.inner_lr, learner.inner_steps, learner.first_order) == (0.01, 5, True)
    assert not learner.adapt_norm and NORMS.isdisjoint(learner.fast_weight_names(batch))
    assert not learner.transductive and learner.evaluation_norm == "support"
    reference = reference_meta_gradient(model, batch, lr=0.01, steps=5, first_order=True,
                                        adapt_norm=False, transductive=False)  # fmt: skip
    assert_meta_gradient(learner, batch, reference)
    faster = ProtoMAML(model, inner_lr=0.3, vectorize=vectorize)
    reference = reference_meta_gradient(model, batch, lr=0.3, steps=5, first_order=True,
                                        adapt_norm=False, transductive=False)  # fmt: skip
    assert_meta_gradient(faster, batch, reference)
    adapted = reference_meta_gradient(model, batch, lr=0.3, steps=5, first_order=True,
                                      transductive=False)  # fmt: skip
    second = reference_meta_gradient(model, batch, lr=0.3, steps=5, adapt_norm=False,
                                     transductive=False)  # fmt: skip
    own = reference_meta_gradient(model, batch, lr=0.3, steps=5, first_order=True,
                                  adapt_norm=False)  # fmt: skip
    for other in (adapted, second, own):  # the controls: the reference tells them apart
        assert max(float((other[k] - reference[k]).abs().max()) for k in reference) > 1e-4


def test_zero_steps_is_a_prototypical_network():
    """With the query in its own batch (metalearn's ProtoNet reads it so), 0 steps classify
    by the nearest prototype."""
    model, batch = conv(), tasks(4, seed=5)
    learner = ProtoMAML(model, transductive=True)
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
    with torch.no_grad():  # the default reading: the query with the support set's moments
        logits = support_normed_logits(fast, task.support[0], task.query[0])
    loss, acc = learner.evaluate([task], steps=3)
    torch.testing.assert_close(F.cross_entropy(logits, task.query[1]), loss[0], atol=1e-10, rtol=0)
    torch.testing.assert_close(learner.query_logits(task, steps=3), logits, atol=1e-10, rtol=0)
    own = ProtoMAML(model, inner_lr=0.2, inner_steps=2, transductive=True)
    with torch.no_grad():
        logits = functional_call(model, own.adapt(task, steps=3), (task.query[0],))
    torch.testing.assert_close(F.cross_entropy(logits, task.query[1]),
                               own.evaluate([task], steps=3)[0][0], atol=1e-10, rtol=0)  # fmt: skip


def test_each_query_is_read_alone_beside_the_support_set():
    """With the support set's moments a query's logits do not depend on the other queries
    (the reading deployment freezes), and a network that cannot read them is refused."""
    model, task = conv(), tasks(1, seed=8)[0]
    learner = ProtoMAML(model, inner_lr=0.2, inner_steps=2)
    logits = learner.query_logits(task, steps=2)
    (xs, ys), (xq, yq) = task.support, task.query
    for i in range(len(xq)):
        alone = learner.query_logits(Task((xs, ys), (xq[i : i + 1], yq[i : i + 1])), steps=2)
        torch.testing.assert_close(alone[0], logits[i], atol=1e-12, rtol=0)
    fused = Conv4(in_channels=1, ways=WAYS, hidden=4,
                  norm_layer=lambda c: nn.BatchNorm2d(c, track_running_stats=False))  # fmt: skip
    with pytest.raises(ValueError, match="support set's batch-norm statistics.*transductive=True"):
        ProtoMAML(fused)
    assert ProtoMAML(fused, transductive=True).evaluation_norm == "transductive"


def test_built_by_name_and_needs_a_linear_head():
    learner = make_learner("protomaml", Conv4(hidden=8), {})
    assert isinstance(learner, ProtoMAML) and learner.inner_lr == 0.01
    with pytest.raises(ValueError, match="no 2-d parameter 'classifier.weight'"):
        ProtoMAML(conv(), head="classifier")
