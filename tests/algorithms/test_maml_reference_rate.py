"""MAML's inner rate on the mean loss is cbfinn/maml's ``update_lr`` times the ways.

cbfinn/maml (a7f45f1) divides each support example's cross-entropy by ``K``
(``utils.py`` line 58, ``xent``) and differentiates the vector with ``tf.gradients``
(``maml.py`` line 90), which sums it: its inner loss is the sum over the ``N K`` examples over
``K``. The reference step here is written out on that loss with plain autograd; metalearn's
MAML steps on the mean loss at ``N`` times the rate. No engine function builds the reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metalearn.algorithms import MAML
from metalearn.engine import Task
from metalearn.models import MLP

F64 = torch.float64


def cbfinn_step(model: MLP, x: torch.Tensor, y: torch.Tensor, update_lr: float, shots: int):
    """One inner step as cbfinn/maml takes it: ``theta - update_lr * d/dtheta sum(xent / K)``."""
    names, params = zip(*model.named_parameters())
    logits = torch.func.functional_call(model, dict(zip(names, params)), (x,))
    per_example = F.cross_entropy(logits, y, reduction="none") / shots
    grads = torch.autograd.grad(per_example.sum(), params)
    return {n: p - update_lr * g for n, p, g in zip(names, params, grads)}


@pytest.mark.parametrize(("ways", "shots", "update_lr"), [(5, 1, 0.4), (20, 5, 0.1)])
def test_maml_at_ways_times_update_lr_takes_cbfinns_inner_step(ways, shots, update_lr):
    torch.manual_seed(0)
    model = MLP(6, [8], ways).to(F64)
    g = torch.Generator().manual_seed(1)
    y = torch.arange(ways).repeat(shots)
    x = torch.randn(len(y), 6, generator=g, dtype=F64)
    task = Task(support=(x, y), query=(x, y))
    learner = MAML(model, inner_lr=ways * update_lr, inner_steps=1)
    fast = learner.adapt(task)
    reference = cbfinn_step(model, x, y, update_lr, shots)
    for name, value in reference.items():
        torch.testing.assert_close(fast[name], value.detach(), rtol=1e-12, atol=1e-14)
    # and the same step at update_lr itself on the mean loss is N times shorter
    short = MAML(model, inner_lr=update_lr, inner_steps=1).adapt(task)
    theta = dict(model.named_parameters())
    moved = {n: (reference[n] - theta[n]).detach() for n in theta}
    for name in theta:
        torch.testing.assert_close((short[name] - theta[name]) * ways, moved[name], rtol=1e-10,
                                   atol=1e-14)  # fmt: skip


def test_mamls_default_is_the_reference_omniglot_step_on_the_mean_loss():
    """5 x 0.4 (5-way) and 20 x 0.1 (20-way) are both 2.0: ``MAML``'s default."""
    assert MAML(MLP(2, [2], 2)).inner_lr == 2.0 == 5 * 0.4 == 20 * 0.1
