"""metalearn's MAML meta-gradient against higher's ``innerloop_ctx``, in float64.

higher (0.2.1) monkey-patches the module into a functional copy and unrolls its
differentiable SGD: ``innerloop_ctx(model, SGD, copy_initial_weights=False)`` keeps the
adapted weights a function of the model's, so the query loss's backward is the MAML
meta-gradient with its second-order terms (Finn et al., 2017, Eq. 1). higher is installed in
the baselines environment only (scripts/install_baselines.sh): ``.venv-baselines/bin/python
-m pytest -q -m baselines``; elsewhere the test skips, or fails where
METALEARN_REQUIRE_BASELINES=1 (CI).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from metalearn.algorithms import FOMAML, MAML, MetaLossLearner
from metalearn.engine import Task
from metalearn.models import MLP

WAYS, SHOTS, QUERIES, FEATURES, INNER_LR = 3, 2, 3, 5, 0.3


def _tasks(n: int = 3) -> list[Task]:
    """``n`` random float64 classification tasks, ``[WAYS * k, FEATURES]`` inputs."""
    gen = torch.Generator().manual_seed(0)

    def split(per_class: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(WAYS * per_class, FEATURES, generator=gen, dtype=torch.float64)
        return x, torch.arange(WAYS).repeat_interleave(per_class)

    return [Task(support=split(SHOTS), query=split(QUERIES)) for _ in range(n)]


def _mlp() -> nn.Module:
    # tanh: a curved activation, so the inner step's Hessian terms are far from zero.
    torch.manual_seed(0)
    return MLP(FEATURES, [8, 8], WAYS, activation=nn.Tanh).double()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _ours(
    cls: type[MetaLossLearner], tasks: list[Task], steps: int, vectorize: str
) -> dict[str, torch.Tensor]:
    """metalearn's meta-gradient of the mean query loss, by parameter name."""
    model = _mlp()
    learner = cls(model, inner_lr=INNER_LR, inner_steps=steps, vectorize=vectorize)
    learner.meta_loss(tasks).loss.backward()
    return _grads(model)


@pytest.mark.baselines("higher")
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("vectorize", ["loop", "vmap"])
def test_meta_gradient_equals_highers_innerloop(steps, vectorize):
    import higher

    tasks = _tasks()
    theirs = _mlp()
    inner_opt = torch.optim.SGD(theirs.parameters(), lr=INNER_LR)
    for task in tasks:
        with higher.innerloop_ctx(theirs, inner_opt, copy_initial_weights=False) as (fmodel, opt):
            for _ in range(steps):
                opt.step(F.cross_entropy(fmodel(task.support[0]), task.support[1]))
            loss = F.cross_entropy(fmodel(task.query[0]), task.query[1])
            (loss / len(tasks)).backward()

    expected = _grads(theirs)
    first_order = _ours(FOMAML, tasks, steps, vectorize)
    for name, grad in _ours(MAML, tasks, steps, vectorize).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-9, atol=1e-12)
        # The second-order terms matter here: dropping them moves the gradient well past
        # the tolerance above, so the agreement is not first order's.
        assert (grad - first_order[name]).abs().max() > 1e-4, name
