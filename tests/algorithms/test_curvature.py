"""`metalearn.algorithms.curvature` against dense float64 Hessians of a tiny network's losses,
and ``--curvature-every`` in a real Omniglot run.

The references are independent of the library's inner loop: the support loss's Hessian
from ``torch.func.hessian``, the meta-loss's from ``torch.autograd.functional.hessian`` of a
one-step MAML meta-loss written out here with ``torch.autograd.grad``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import wandb
from torch import nn
from torch.func import functional_call

from metalearn.algorithms import ANIL, FOMAML, IMAML, MAML, Reptile
from metalearn.algorithms.curvature import meta_curvature, support_curvature
from metalearn.checkpoint import load_checkpoint
from metalearn.engine import Task
from metalearn.functional import flatten_tree, unflatten_like
from metalearn.runs.lifecycle import UserError
from metalearn.runs.records import read_offline_run
from tests.conftest import OMNIGLOT, needs_omniglot
from tests.helpers.run_helpers import make, om

F64 = torch.float64
ALPHA = 0.3


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tiny_net() -> nn.Module:
    """4 -> 5 -> 3 with tanh: 43 parameters, smooth to every order."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(F64)


def tiny_tasks(count: int = 2) -> list[Task]:
    g = gen(10)

    def data():
        return torch.randn(6, 4, generator=g, dtype=F64), torch.randint(0, 3, (6,), generator=g)

    return [Task(support=data(), query=data()) for _ in range(count)]


def theta_of(net: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in net.named_parameters()}


def dense_meta_hessian(net: nn.Module, tasks: list[Task]) -> torch.Tensor:
    """Hessian of 1/T sum_t L_q(theta - alpha grad L_s(theta)) over the flat theta, [n, n]."""
    theta = theta_of(net)

    def meta_loss(flat: torch.Tensor) -> torch.Tensor:
        p = unflatten_like(flat, theta)
        total = flat.new_zeros(())
        for t in tasks:
            support = F.cross_entropy(functional_call(net, p, (t.support[0],)), t.support[1])
            grads = torch.autograd.grad(support, list(p.values()), create_graph=True)
            phi = {k: v - ALPHA * g for (k, v), g in zip(p.items(), grads)}
            total = total + F.cross_entropy(functional_call(net, phi, (t.query[0],)), t.query[1])
        return total / len(tasks)

    return torch.autograd.functional.hessian(meta_loss, flatten_tree(theta))


def rademacher_quads(theta: dict, H: torch.Tensor, samples: int, seed: int) -> torch.Tensor:
    """v'Hv for the probes `hessian_trace` draws from ``gen(seed)`` (leaf by leaf, in order)."""
    g = gen(seed)
    quads = []
    for _ in range(samples):
        leaves = [torch.randint(0, 2, t.shape, generator=g).to(t) * 2 - 1 for t in theta.values()]
        v = torch.cat([leaf.flatten() for leaf in leaves])
        quads.append(v @ H @ v)
    return torch.stack(quads)


@pytest.mark.parametrize(
    "vectorize, checkpoint", [("loop", False), ("vmap", False), ("loop", True)]
)
def test_meta_curvature_matches_the_dense_meta_hessian(vectorize, checkpoint):
    net, tasks = tiny_net(), tiny_tasks()
    H = dense_meta_hessian(net, tasks)
    n = H.shape[0]
    learner = MAML(
        net, inner_lr=ALPHA, inner_steps=1, vectorize=vectorize, gradient_checkpointing=checkpoint
    )
    result = meta_curvature(learner, tasks, iterations=n, samples=5, tol=1e-12, generator=gen(7))
    # Lanczos with a Krylov space as large as the problem: exact up to rounding.
    assert result.top_eigenvalue == pytest.approx(float(torch.linalg.eigvalsh(H)[-1]), rel=1e-8)
    # Hutchinson on the same Rademacher probes, each v'Hv computed densely: exact, not
    # statistical (the probes are drawn first from the generator).
    quads = rademacher_quads(theta_of(net), H, 5, seed=7)
    assert result.trace == pytest.approx(float(quads.mean()), rel=1e-9)
    assert result.trace_std_error == pytest.approx(float(quads.std() / 5**0.5), rel=1e-8)


def test_meta_curvature_is_second_order_for_a_first_order_learner():
    net, tasks = tiny_net(), tiny_tasks()
    top = float(torch.linalg.eigvalsh(dense_meta_hessian(net, tasks))[-1])
    fomaml = FOMAML(net, inner_lr=ALPHA, inner_steps=1)
    result = meta_curvature(fomaml, tasks, iterations=43, tol=1e-12, generator=gen(8))
    assert result.top_eigenvalue == pytest.approx(top, rel=1e-8)


def test_support_curvature_matches_each_tasks_dense_support_hessian():
    net, tasks = tiny_net(), tiny_tasks(3)
    theta = theta_of(net)
    expected = []
    for t in tasks:

        def support(flat, t=t):
            out = functional_call(net, unflatten_like(flat, theta), (t.support[0],))
            return F.cross_entropy(out, t.support[1])

        H = torch.func.hessian(support)(flatten_tree(theta))
        expected.append(float(torch.linalg.eigvalsh(H)[-1]))
    learner = MAML(net, inner_lr=ALPHA)
    values = support_curvature(learner, tasks, iterations=43, tol=1e-12, generator=gen(9))
    assert values.shape == (3,)
    torch.testing.assert_close(values, torch.tensor(expected, dtype=F64), rtol=1e-8, atol=0)


def test_support_curvature_is_over_the_adapted_parameters_only():
    net, tasks = tiny_net(), tiny_tasks(1)
    theta = theta_of(net)
    body = {k: v for k, v in theta.items() if not k.startswith("2.")}
    (t,) = tasks

    def support(head):
        out = functional_call(net, {**body, **head}, (t.support[0],))
        return F.cross_entropy(out, t.support[1])

    head = {k: v for k, v in theta.items() if k.startswith("2.")}
    H = torch.func.hessian(lambda flat: support(unflatten_like(flat, head)))(flatten_tree(head))
    learner = ANIL(net, head="2", inner_lr=ALPHA)
    (value,) = support_curvature(learner, tasks, iterations=18, tol=1e-12, generator=gen(11))
    assert float(value) == pytest.approx(float(torch.linalg.eigvalsh(H)[-1]), rel=1e-8)


def test_measurements_are_seeded_and_leave_theta_alone():
    net, tasks = tiny_net(), tiny_tasks()
    learner = MAML(net, inner_lr=ALPHA)
    before = {k: v.clone() for k, v in theta_of(net).items()}
    first = meta_curvature(learner, tasks, iterations=4, samples=3, generator=gen(5))
    second = meta_curvature(learner, tasks, iterations=4, samples=3, generator=gen(5))
    assert first == second
    assert all(torch.equal(before[k], v) for k, v in theta_of(net).items())
    assert all(p.grad is None for p in net.parameters())


@pytest.mark.parametrize("cls", [Reptile, IMAML])
def test_learners_without_a_meta_loss_are_named(cls):
    learner = cls(tiny_net(), inner_lr=ALPHA, inner_steps=2)
    with pytest.raises(TypeError, match=f"^{cls.__name__} has no meta-loss .*support_curvature"):
        meta_curvature(learner, tiny_tasks())
    # The support loss exists for every learner.
    assert support_curvature(learner, tiny_tasks(1), iterations=5).shape == (1,)


def test_empty_task_lists_are_refused():
    learner = MAML(tiny_net(), inner_lr=ALPHA)
    with pytest.raises(ValueError, match="probe_tasks is empty"):
        meta_curvature(learner, [])
    with pytest.raises(ValueError, match="tasks is empty"):
        support_curvature(learner, [])


# --------------------------------------------------------------------------- in a run

DATA = OMNIGLOT
CURV_KEYS = {
    "curv/support_top_eig", "curv/support_top_eig_max", "curv/two_over_inner_lr",
    "curv/meta_top_eig", "curv/meta_trace", "curv/meta_trace_std_error", "perf/curvature_s",
}  # fmt: skip


def tiny_run(tmp_path: Path, **overrides) -> om.Args:
    """Two meta-steps of a small conv4 on Omniglot."""
    return make(om, **{**dict(
        algorithm="maml", iterations=2, meta_batch=2, query=1, eval_query=2, hidden=8,
        val_every=2, val_tasks=2, test_tasks=2, eval_inner_steps=1, data_root=str(DATA),
        track=False, device="cpu", out_dir=str(tmp_path), curvature_tasks=2,
    ), **overrides})  # fmt: skip


@pytest.mark.slow  # two runs of the experiment end to end: 13 s on 2 cores
@needs_omniglot
def test_curvature_every_step_enters_the_history_and_wandb(tmp_path):
    om.main(tiny_run(tmp_path, curvature_every=1, track=True, wandb_mode="offline", run_name="c"))
    om.main(tiny_run(tmp_path, run_name="plain"))
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    wandb.teardown()  # finish() may return before the .wandb file is complete
    record = read_offline_run(run_dir)
    rows = [row for row in record.history if "curv/meta_top_eig" in row]
    assert [row["_step"] for row in rows] == [1, 2]
    for row in rows:
        assert CURV_KEYS <= set(row) and all(math.isfinite(row[k]) for k in CURV_KEYS)
        assert row["curv/two_over_inner_lr"] == pytest.approx(2 / 2.0)  # MAML's default rate
        assert row["curv/support_top_eig_max"] >= row["curv/support_top_eig"]
    history = load_checkpoint(tmp_path / "c" / "checkpoint.pt")["history"]
    assert [CURV_KEYS <= set(row) for row in history] == [True, True]
    for row, logged in zip(history, rows):
        assert row["curv/meta_top_eig"] == logged["curv/meta_top_eig"]
    # Measuring draws nothing from the training generator: the same training.
    plain = load_checkpoint(tmp_path / "plain" / "checkpoint.pt")["history"]
    assert [r["train/loss"] for r in history] == [r["train/loss"] for r in plain]
    assert not any(k.startswith("curv/") for r in plain for k in r)


@needs_omniglot
def test_curvature_refused_for_a_learner_without_a_meta_loss(tmp_path):
    with pytest.raises(UserError, match="--curvature-every 1 with --algorithm reptile: Reptile"):
        om.main(tiny_run(tmp_path, algorithm="reptile", curvature_every=1))
    with pytest.raises(UserError, match="--curvature-every -1: must be >= 0"):
        om.main(tiny_run(tmp_path, curvature_every=-1))
    with pytest.raises(UserError, match="--curvature-tasks 0: must be at least 1"):
        om.main(tiny_run(tmp_path, curvature_every=1, curvature_tasks=0))
    assert list(tmp_path.iterdir()) == []
