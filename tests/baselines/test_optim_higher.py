"""metalearn's inner optimizers against higher 0.2.1's differentiable ones, in float64.

higher unrolls ``DifferentiableSGD`` (momentum, Nesterov), ``DifferentiableAdam`` and
``DifferentiableRMSprop`` through ``innerloop_ctx(model, opt, copy_initial_weights=False)``,
so the query loss's backward is the MAML meta-gradient through that optimizer. metalearn's
MAML with ``inner_optimizer=...`` must give the same meta-gradient, looped and vmapped.
higher's Adam adds ``eps`` before the bias correction (Kingma & Ba's "efficient" form),
torch.optim's and metalearn's after it; the two updates are the same at ``eps = 0``, which
the Adam case uses (a tanh network, so no gradient entry is exactly zero). higher lives in
the baselines environment: ``.venv-baselines/bin/python -m pytest -q -m baselines``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from metalearn.algorithms import MAML
from metalearn.engine import Task
from tests.baselines.test_higher_interop import _grads, _mlp, _tasks

STEPS = 3

CASES = {
    "momentum": (torch.optim.SGD, dict(lr=0.3, momentum=0.8), dict(inner_momentum=0.8)),
    "nesterov": (torch.optim.SGD, dict(lr=0.3, momentum=0.7, nesterov=True),
                 dict(inner_momentum=0.7)),
    "adam": (torch.optim.Adam, dict(lr=0.05, betas=(0.85, 0.95), eps=0.0),
             dict(inner_beta1=0.85, inner_beta2=0.95, inner_eps=0.0)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=0.02, alpha=0.9, eps=1e-3),
                dict(inner_alpha=0.9, inner_eps=1e-3)),
}  # fmt: skip


def _highers(kind: str, tasks: list[Task]) -> tuple[float, dict[str, torch.Tensor]]:
    import higher

    opt_cls, kwargs, _ = CASES[kind]
    model = _mlp()
    total = 0.0
    for task in tasks:
        inner_opt = opt_cls(model.parameters(), **kwargs)
        with higher.innerloop_ctx(model, inner_opt, copy_initial_weights=False) as (fmodel, opt):
            for _ in range(STEPS):
                opt.step(F.cross_entropy(fmodel(task.support[0]), task.support[1]))
            loss = F.cross_entropy(fmodel(task.query[0]), task.query[1]) / len(tasks)
            loss.backward()
            total += float(loss.detach())
    return total, _grads(model)


# higher warns that its RMSprop's gradients may be wrong: its mask of zero mean squares (the
# entries where metalearn's safe_sqrt has derivative 0); a tanh network has none.
@pytest.mark.filterwarnings("ignore:Differentiable RMSprop suffers from gradient correctness")
@pytest.mark.baselines("higher")
@pytest.mark.parametrize("vectorize", ["loop", "vmap"])
@pytest.mark.parametrize("kind", list(CASES))
def test_meta_gradient_equals_highers_differentiable_optimizer(kind, vectorize):
    tasks = _tasks()
    their_loss, theirs = _highers(kind, tasks)
    _, kwargs, ours_kwargs = CASES[kind]
    model = _mlp()
    learner = MAML(model, inner_lr=kwargs["lr"], inner_steps=STEPS, vectorize=vectorize,
                   inner_optimizer=kind, **ours_kwargs)  # fmt: skip
    batch = learner.meta_loss(tasks)
    batch.loss.backward()
    assert abs(float(batch.loss.detach()) - their_loss) < 1e-12
    sgd = MAML(_mlp(), inner_lr=kwargs["lr"], inner_steps=STEPS, vectorize=vectorize)
    sgd.meta_loss(tasks).loss.backward()
    plain = _grads(sgd.model)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, theirs[name], rtol=0, atol=1e-10)
        # The optimizer matters: plain SGD's meta-gradient is far from this one.
        assert (grad - plain[name]).abs().max() > 1e-4, name
