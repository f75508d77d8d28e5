"""Where each learner's inner loop starts (`MetaLearner.inner_start`), and the support
curvature measured there, against dense float64 Hessians of support losses written out here.

The reference network is written by hand (linear -> batch norm -> tanh -> linear head, and
the LoRA update ``(alpha / r) B A`` where LoRA adds it), as is each algorithm's starting
point: theta for MAML and its relatives, the prototype head ``W_k = 2 c_k``,
``b_k = -||c_k||^2`` for Proto-MAML (Triantafillou et al., 2020, Sec. 4), step 0's
batch-norm copies for MAML++ (Antoniou et al., 2019, BNWB), the adapters and head for LoRA.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metalearn.algorithms.curvature import support_curvature
from metalearn.algorithms.registry import LEARNERS, make_learner
from metalearn.engine import Task
from metalearn.models import MetaBatchNorm
from metalearn.models.norm import normalise

F64 = torch.float64
EPS = 1e-5
INNER = ("maml", "fomaml", "anil", "metasgd", "mamlpp", "imaml", "reptile", "protomaml", "lora",
         "boil", "metacurvature")  # fmt: skip
HEADS = ("protonet", "r2d2", "metaoptnet", "metaoptnet-lr")


class Tiny(nn.Module):
    """4 -> 3 (batch norm, tanh) -> 3: a body, a `MetaBatchNorm` and a head named ``head``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)
        self.norm = MetaBatchNorm(3, eps=EPS)
        self.head = nn.Linear(3, 3)

    def forward(self, x: Tensor, norm_rows: int | None = None) -> Tensor:
        # norm_rows as metalearn's backbones take it (Proto-MAML's query reading)
        return self.head(torch.tanh(normalise(self.norm, self.body(x), norm_rows)))


def tiny() -> Tiny:
    torch.manual_seed(0)
    net = Tiny().to(F64)
    with torch.no_grad():  # batch norm off its identity start, so its copies matter
        net.norm.weight.copy_(torch.tensor([1.3, 0.7, 1.1]))
        net.norm.bias.copy_(torch.tensor([0.2, -0.1, 0.05]))
    return net


def task(seed: int = 1) -> Task:
    g = torch.Generator().manual_seed(seed)

    def data() -> tuple[Tensor, Tensor]:
        x = torch.randn(6, 4, generator=g, dtype=F64)
        return x, torch.tensor([0, 1, 2, 0, 1, 2])

    return Task(support=data(), query=data())


def features(p: dict[str, Tensor], x: Tensor, scaling: float = 0.0) -> Tensor:
    """tanh(bn(x W' + b)), plus LoRA's ``scaling * x A' B'`` inside when ``scaling`` > 0."""
    h = x @ p["body.weight"].T + p["body.bias"]
    if scaling:
        h = h + scaling * (x @ p["body.lora_A"].T @ p["body.lora_B"].T)
    centred = h - h.mean(0)
    h = centred / torch.sqrt((centred**2).mean(0) + EPS) * p["norm.weight"] + p["norm.bias"]
    return torch.tanh(h)


def support_loss(p: dict[str, Tensor], t: Task, scaling: float = 0.0) -> Tensor:
    x, y = t.support
    return F.cross_entropy(features(p, x, scaling) @ p["head.weight"].T + p["head.bias"], y)


def prototype_start(p: dict[str, Tensor], t: Task) -> dict[str, Tensor]:
    """Proto-MAML's head: ``2 c_k`` and ``-||c_k||^2`` from the class means of the features."""
    f, y = features(p, t.support[0]), t.support[1]
    c = torch.stack([f[y == k].mean(0) for k in range(3)])
    return {**p, "head.weight": 2 * c, "head.bias": -(c**2).sum(1)}


def dense_top(loss, start: dict[str, Tensor], keys: list[str]) -> float:
    """Top eigenvalue of the dense Hessian of ``loss`` over ``keys``, the rest at ``start``."""
    sizes = [start[k].numel() for k in keys]

    def flat_loss(flat: Tensor) -> Tensor:
        parts = flat.split(sizes)
        return loss({**start, **{k: v.view_as(start[k]) for k, v in zip(keys, parts)}})

    flat = torch.cat([start[k].flatten() for k in keys])
    return float(torch.linalg.eigvalsh(torch.func.hessian(flat_loss)(flat))[-1])


def learner_of(name: str):
    args = {"inner_lr": 0.3, "inner_steps": 2, "vectorize": "loop"}
    if name == "mamlpp":
        args["vectorize"] = "auto"
    learner = make_learner(name, tiny(), args)
    with torch.no_grad():  # move what starts at its default, so a wrong start shows
        if name == "mamlpp":
            for copy in learner.bn.values():
                copy.mul_(torch.tensor([[0.5], [2.0]], dtype=F64))
        if name == "lora":
            learner.model.body.lora_B.copy_(0.3 * torch.ones_like(learner.model.body.lora_B))
    return learner


def reference(name: str, learner, t: Task) -> tuple:
    """(loss, start, adapted keys) of the inner loop's first step, written out."""
    theta = {k: v.detach() for k, v in learner.model.named_parameters()}
    everything = list(theta)
    if name in ("imaml", "reptile"):
        return (lambda p: support_loss(p, t)), theta, everything
    if name in ("maml", "fomaml", "metasgd", "metacurvature"):  # the norm layer stays out
        keys = [k for k in theta if not k.startswith("norm.")]
        return (lambda p: support_loss(p, t)), theta, keys
    if name == "anil":
        return (lambda p: support_loss(p, t)), theta, ["head.weight", "head.bias"]
    if name == "boil":  # the body only: the head stays theta's
        return (lambda p: support_loss(p, t)), theta, [k for k in theta if "head" not in k]
    if name == "protomaml":  # the norm layer stays out (adapt_norm=False, meta-dataset's)
        keys = [k for k in theta if not k.startswith("norm.")]
        return (lambda p: support_loss(p, t)), prototype_start(theta, t), keys
    if name == "mamlpp":  # BNWB: step 0's copies, meta-learned, not adapted
        bn = {"norm.weight": learner.bn["norm__weight"][0].detach(),
              "norm.bias": learner.bn["norm__bias"][0].detach()}  # fmt: skip
        keys = [k for k in theta if k not in bn]
        return (lambda p: support_loss(p, t)), {**theta, **bn}, keys
    if name == "lora":
        keys = ["body.lora_A", "body.lora_B", "head.weight", "head.bias"]
        return (lambda p: support_loss(p, t, scaling=learner.alpha / learner.rank)), theta, keys
    raise AssertionError(f"no reference for {name}")


def test_every_registered_learner_is_classified_here():
    assert set(LEARNERS) == set(INNER) | set(HEADS)


@pytest.mark.parametrize("name", INNER)
def test_support_curvature_is_the_dense_hessian_where_the_inner_loop_starts(name):
    learner, t = learner_of(name), task()
    loss, start, keys = reference(name, learner, t)
    expected = dense_top(loss, start, keys)
    n = sum(start[k].numel() for k in keys)
    (value,) = support_curvature(
        learner, [t], iterations=n, tol=1e-12, generator=torch.Generator().manual_seed(2)
    )
    assert float(value) == pytest.approx(expected, rel=1e-8)
    got = learner.inner_start(t)
    assert sorted(got.adapted) == sorted(keys)
    for k in keys:
        torch.testing.assert_close(got.adapted[k], start[k], rtol=1e-12, atol=1e-12)


def test_reptile_trained_on_the_query_starts_on_support_and_query():
    learner = make_learner("reptile", tiny(), {"inner_lr": 0.3, "train_on_query": True})
    t = task()
    both = Task(support=(torch.cat([t.support[0], t.query[0]]),
                         torch.cat([t.support[1], t.query[1]])), query=t.query)  # fmt: skip
    theta = {k: v.detach() for k, v in learner.model.named_parameters()}
    expected = dense_top(lambda p: support_loss(p, both), theta, list(theta))
    (value,) = support_curvature(learner, [t], iterations=27, tol=1e-12)
    assert float(value) == pytest.approx(expected, rel=1e-8)


def test_proto_maml_curvature_does_not_see_thetas_unused_head():
    learner, t = learner_of("protomaml"), task()
    before = support_curvature(learner, [t], iterations=27, tol=1e-12)
    fast_before = learner.adapt(t)
    with torch.no_grad():
        learner.model.head.weight.mul_(25.0)
        learner.model.head.bias.add_(3.0)
    after = support_curvature(learner, [t], iterations=27, tol=1e-12)
    torch.testing.assert_close(after, before, rtol=1e-10, atol=0)
    fast_after = learner.adapt(t)
    for k in fast_before:
        torch.testing.assert_close(fast_after[k], fast_before[k], rtol=1e-12, atol=1e-12)
    # MAML from the same theta does see that head: the measurement is of the start point.
    maml = make_learner("maml", learner.model, {"inner_lr": 0.3})
    assert float(support_curvature(maml, [t], iterations=27, tol=1e-12)[0]) != pytest.approx(
        float(before[0]), rel=1e-3
    )


@pytest.mark.parametrize("name", HEADS)
def test_learners_without_an_inner_loop_are_refused_by_name(name):
    learner = make_learner(name, tiny(), {})
    with pytest.raises(ValueError, match=f"^{LEARNERS[name].__name__} solves its head"):
        support_curvature(learner, [task()])
