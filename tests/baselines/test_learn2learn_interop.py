"""learn2learn interop: its task batches as metalearn tasks, and the same MAML meta-gradient.

The meta-gradient test runs learn2learn's own MAML (``clone()``, ``adapt()``, query loss
backward) on a twin of metalearn's Conv4 built from torch's layers (``nn.BatchNorm2d``
without running statistics, the same maths as `metalearn.models.batch_norm`), in float64,
on tasks drawn by a learn2learn ``Taskset``. learn2learn is installed in the baselines
environment only (scripts/install_baselines.sh): ``.venv-baselines/bin/python -m pytest -q -m
baselines``; elsewhere those tests skip, or fail where METALEARN_REQUIRE_BASELINES=1 (CI).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from metalearn.algorithms import MAML
from metalearn.data.interop import from_learn2learn, task_from_l2l_batch
from metalearn.models import Conv4

WAYS, SHOTS, QUERIES = 3, 2, 2


def _labelled_images(classes: int = 8, per_class: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Random float64 8x8 grey images, labels 10, 11, ... (not 0-based: nothing remaps them)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(classes * per_class, 1, 8, 8, generator=gen, dtype=torch.float64)
    y = torch.arange(10, 10 + classes).repeat_interleave(per_class)
    perm = torch.randperm(len(y), generator=gen)
    return x[perm], y[perm]


def test_a_batch_splits_per_class_in_batch_order():
    x, y = _labelled_images()
    keep = torch.cat([torch.nonzero(y == c).flatten()[: SHOTS + QUERIES] for c in (17, 12, 14)])
    keep = keep[torch.randperm(len(keep), generator=torch.Generator().manual_seed(1))]
    task = task_from_l2l_batch((x[keep], y[keep]), WAYS, SHOTS, QUERIES)
    # Reference: per class in label order, its examples in batch order, first SHOTS support.
    batch_x, batch_y = x[keep], y[keep]
    for new, label in enumerate((12, 14, 17)):
        rows = [i for i in range(len(batch_y)) if batch_y[i] == label]
        assert torch.equal(task.support[0][new * SHOTS : (new + 1) * SHOTS], batch_x[rows[:SHOTS]])
        assert torch.equal(
            task.query[0][new * QUERIES : (new + 1) * QUERIES], batch_x[rows[SHOTS:]]
        )
    assert task.support[1].tolist() == [0, 0, 1, 1, 2, 2]
    assert task.query[1].tolist() == [0, 0, 1, 1, 2, 2]


def test_a_batch_that_does_not_fit_is_refused():
    x, y = _labelled_images()
    with pytest.raises(ValueError, match=r"holds 8 classes .* NWays\(dataset, 3\)"):
        task_from_l2l_batch((x, y), WAYS, SHOTS, QUERIES)
    with pytest.raises(ValueError, match="meta_batch=0"):
        next(from_learn2learn(None, WAYS, SHOTS, QUERIES, meta_batch=0))


class _Block(nn.Module):
    """A Conv4 block from torch's layers: strided conv, batch-statistics norm, ReLU."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride=2, padding=1)
        self.norm = nn.BatchNorm2d(cout, track_running_stats=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.conv(x)))


class _TorchConv4(nn.Module):
    """Conv4 (strided, mean head) written with torch's layers; parameter names as Conv4's."""

    def __init__(self, hidden: int, ways: int) -> None:
        super().__init__()
        self.features = nn.Sequential(*[_Block(1 if i == 0 else hidden, hidden) for i in range(4)])
        self.head = nn.Linear(hidden, ways)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((-2, -1)))


def _taskset(seed: int):
    import learn2learn as l2l

    x, y = _labelled_images()
    dataset = l2l.data.MetaDataset(torch.utils.data.TensorDataset(x, y))
    transforms = [
        l2l.data.transforms.NWays(dataset, WAYS),
        l2l.data.transforms.KShots(dataset, SHOTS + QUERIES),
        l2l.data.transforms.LoadData(dataset),
    ]
    torch.manual_seed(seed)  # learn2learn's transforms draw from Python's and torch's RNGs
    return l2l.data.Taskset(dataset, transforms, num_tasks=-1)


@pytest.mark.baselines("learn2learn")
@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("vectorize", ["loop", "vmap"])
def test_meta_gradient_equals_learn2learns_maml(steps, vectorize):
    import learn2learn as l2l

    tasks = next(from_learn2learn(_taskset(0), WAYS, SHOTS, QUERIES, meta_batch=3))
    torch.manual_seed(0)
    model = Conv4(in_channels=1, ways=WAYS, hidden=4).double()
    twin = _TorchConv4(hidden=4, ways=WAYS).double()
    twin.load_state_dict(model.state_dict())  # the same weights, strictly

    # learn2learn's MAML adapts every parameter, batch norm's included: adapt_norm=True.
    ours = MAML(model, inner_lr=0.1, inner_steps=steps, vectorize=vectorize, adapt_norm=True)
    ours.meta_loss(tasks).loss.backward()

    theirs = l2l.algorithms.MAML(twin, lr=0.1, first_order=False)
    total = 0.0
    for task in tasks:
        learner = theirs.clone()
        for _ in range(steps):
            learner.adapt(F.cross_entropy(learner(task.support[0]), task.support[1]))
        total = total + F.cross_entropy(learner(task.query[0]), task.query[1])
    (total / len(tasks)).backward()

    grads = dict(twin.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad.abs().max() > 0, name
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-9, atol=1e-12)
