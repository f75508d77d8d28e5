"""R2-D2's dropout (``R2D2Net(dropout=p)``, ``--dropout``): it masks the features in
meta-training, each task its own masks, and never in an evaluation (validation and test
through `evaluate_tasks`, the ensemble, deploy's `adapt_to_support`, the curvature probes),
which run under `evaluation_mode` and leave every module's mode and torch's generator as
they were. The references are the formulas written out on the network's own forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metalearn.algorithms import make_learner
from metalearn.data import EpisodicSampler
from metalearn.deploy import adapt_to_support
from metalearn.engine import Task
from metalearn.models import R2D2Net, build_backbone, evaluation_mode
from metalearn.runs.evaluation import evaluate_tasks
from metalearn.runs.metrics import measure_curvature
from tests.algorithms.test_heads import rrnet_logits

F64 = torch.float64
SIZE, WAYS, SHOTS, QUERIES = 16, 3, 2, 2


def net(dropout: float, seed: int = 0) -> R2D2Net:
    torch.manual_seed(seed)
    return R2D2Net(in_channels=1, ways=WAYS, image_size=SIZE, widths=(3, 4, 5, 6),
                   dropout=dropout).double()  # fmt: skip


def tasks(count: int = 3, seed: int = 1, same: bool = False) -> list[Task]:
    g = torch.Generator().manual_seed(seed)
    ys, yq = torch.arange(WAYS).repeat_interleave(SHOTS), torch.arange(WAYS).repeat(QUERIES)

    def one() -> Task:
        xs = torch.randn(len(ys), 1, SIZE, SIZE, generator=g, dtype=F64)
        return Task((xs, ys), (torch.randn(len(yq), 1, SIZE, SIZE, generator=g, dtype=F64), yq))

    first = one()
    return [first] + [first if same else one() for _ in range(count - 1)]


def rrnet_loss(model: R2D2Net, task: Task, lam: float, scale: float) -> Tensor:
    """RRNet's ridge head (`rrnet_logits`, the bias 0) on the features of ``model``'s own
    forward, support first, then query: the order in which the learner draws the masks."""
    (xs, ys), (xq, yq) = task.support, task.query
    fs, fq = model.features(xs), model.features(xq)
    return F.cross_entropy(rrnet_logits(fs, ys, fq, lam, scale), yq)


def body_gradient(learner: nn.Module) -> dict[str, Tensor]:
    return {k: p.grad.clone() for k, p in learner.named_parameters()
            if p.grad is not None and k.startswith("model.features.")}  # fmt: skip


def test_the_meta_gradient_is_the_formula_on_the_dropped_features() -> None:
    batch = tasks()
    learner = make_learner("r2d2", net(0.5), {"vectorize": "loop"})
    torch.manual_seed(3)
    learner.backward(batch)
    got = body_gradient(learner)
    reference = net(0.5)
    torch.manual_seed(3)
    loss = sum(rrnet_loss(reference, t, 50.0, 10.0) for t in batch) / len(batch)
    names = [f"model.{k}" for k, _ in reference.named_parameters() if k.startswith("features.")]
    params = [p for k, p in reference.named_parameters() if k.startswith("features.")]
    expected = dict(zip(names, torch.autograd.grad(loss, params), strict=True))
    assert set(got) == set(expected)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-10, msg=name)
    # dropout acts: the network without it has another meta-gradient
    plain = make_learner("r2d2", net(0.0), {"vectorize": "loop"})
    plain.backward(batch)
    assert not torch.allclose(body_gradient(plain)[names[0]], got[names[0]])


def test_under_vmap_each_task_draws_its_own_masks() -> None:
    batch = tasks(4, same=True)  # four copies of one task
    for dropout, distinct in ((0.5, 4), (0.0, 1)):
        learner = make_learner("r2d2", net(dropout), {"vectorize": "vmap"})
        losses = learner.meta_loss(batch).task_losses.detach()
        assert len(set(losses.tolist())) == distinct


def sampler() -> EpisodicSampler:
    g = torch.Generator().manual_seed(2)
    images = torch.randint(0, 256, (6, 5, 1, SIZE, SIZE), generator=g, dtype=torch.uint8)
    return EpisodicSampler(images, ways=WAYS, shots=SHOTS, queries=QUERIES, dtype=F64)


@pytest.mark.parametrize("algorithm", ["r2d2", "maml"])
def test_every_evaluation_runs_without_dropout_and_leaves_the_modes(algorithm: str) -> None:
    """The learner with dropout scores as the same weights without it, through the run's
    evaluation, the ensemble and deploy's adaptation, and consumes no random numbers."""
    dropped, plain = (make_learner(algorithm, net(p), {}) for p in (0.5, 0.0))
    plain.load_state_dict(dropped.state_dict())
    source = sampler()
    rng = torch.get_rng_state()
    # the ensemble is for learners that score the network at adapted weights (MAML's)
    ensembles = [None] + ([[dropped.state_dict()] * 2] if algorithm == "maml" else [])
    for ensemble in ensembles:
        draw = [torch.Generator().manual_seed(0) for _ in range(2)]
        scores = [evaluate_tasks(learner, source, 6, 1, gen, progress=False, ensemble=ensemble)
                  for learner, gen in zip((dropped, plain), draw, strict=True)]  # fmt: skip
        assert scores[0] == scores[1]
    support = tasks(1)[0].support
    adapted = [adapt_to_support(learner, *support, steps=1) for learner in (dropped, plain)]
    for name, value in adapted[1].items():
        torch.testing.assert_close(adapted[0][name], value, rtol=0, atol=0, msg=name)
    assert torch.equal(torch.get_rng_state(), rng)  # no mask was drawn
    assert all(m.training for m in dropped.modules())


def test_the_curvature_probes_run_without_dropout() -> None:
    dropped, plain = (make_learner("maml", net(p), {}) for p in (0.5, 0.0))
    plain.load_state_dict(dropped.state_dict())
    probe = tasks(2)
    a, b = measure_curvature(dropped, probe), measure_curvature(plain, probe)
    for key in a:
        if not key.startswith("perf/"):
            assert a[key] == b[key], key
    assert all(m.training for m in dropped.modules())


def test_evaluation_mode_gives_each_module_its_own_mode_back() -> None:
    model = net(0.5)
    model.head.eval()  # a mixed model: the head in evaluation mode already
    with pytest.raises(RuntimeError, match="inside"), evaluation_mode(model):
        assert not any(m.training for m in model.modules())
        raise RuntimeError("inside")
    assert model.training and model.features.training and not model.head.training


def test_dropout_is_refused_where_the_network_has_none_or_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"^--dropout 0.1: only backbone rrnet"):
        build_backbone("conv4", in_channels=1, ways=5, hidden=4, dropout=0.1)
    with pytest.raises(ValueError, match=r"^--dropout 1.0: a probability in \[0, 1\)"):
        build_backbone("rrnet", in_channels=1, ways=5, hidden=4, image_size=28, dropout=1.0)
