"""MetaOptNet's Crammer-Singer SVM head against independent float64 references.

The reference QP is MetaOptNet's ``MetaOptNetHead_SVM_CS`` written out as dense matrices
(`reference_qp`: ``G = K (x) I_C + 1.0 I``, ``e = -Y``, ``alpha <= C Y``, ``A alpha = 0``
with ``A = I_S (x) 1_C^T``, variables ordered ``i C + m``). The solver's answer is checked
by the QP's KKT conditions with multipliers recovered by least squares, and against
accelerated projected gradient (FISTA, rows projected by bisection) run to convergence;
its implicit gradient against central finite differences of the exact solve.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from metalearn.algorithms.metaoptnet import smoothed_cross_entropy, solve_dual, svm_classifier
from tests.conftest import ROOT

F64 = torch.float64
C_REG, RIDGE = 0.1, 1.0


def problem(ways: int, shots: int, seed: int, spread: float = 1.0) -> tuple[Tensor, Tensor]:
    """Non-negative features (as after a ReLU) with a class signal, ``[S, 24]``, and labels."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(ways).repeat_interleave(shots)
    x = spread * torch.randn(len(labels), 24, generator=g, dtype=F64).relu()
    return x + 0.5 * F.one_hot(labels, 24).to(F64), labels


def reference_qp(x: Tensor, labels: Tensor, ways: int):
    """``(G, e, h, A)`` of ``min 1/2 z^T G z + e^T z, z <= h, A z = 0`` as the reference
    builds them (dense Kronecker products)."""
    s = len(x)
    onehot = F.one_hot(labels, ways).to(F64).reshape(-1)
    g = torch.kron(x @ x.T, torch.eye(ways, dtype=F64)) + RIDGE * torch.eye(s * ways, dtype=F64)
    a = torch.kron(torch.eye(s, dtype=F64), torch.ones(1, ways, dtype=F64))
    return g, -onehot, C_REG * onehot, a


def kkt_violation(z: Tensor, g: Tensor, e: Tensor, h: Tensor, a: Tensor) -> float:
    """The largest violation of the QP's KKT conditions at ``z``: feasibility, stationarity
    with the multipliers of the constraints active at ``z`` (``h - z < 1e-9``) fitted by least
    squares, and their signs."""
    active = (h - z) < 1e-9
    normals = torch.cat([torch.eye(len(z), dtype=F64)[:, active], a.T], 1)
    multipliers = torch.linalg.lstsq(normals, -(g @ z + e)[:, None]).solution[:, 0]
    stationarity = (g @ z + e + normals @ multipliers).abs().max()
    sign = (-multipliers[: int(active.sum())]).clamp(min=0).max() if active.any() else 0.0
    return max(float((z - h).clamp(min=0).max()), float((a @ z).abs().max()),
               float(stationarity), float(sign))  # fmt: skip


def project_rows(v: Tensor, cap: Tensor) -> Tensor:
    """Each row onto ``{a <= cap, sum a = 0}``: ``min(v - tau, cap)``, ``tau`` by bisection."""
    lo = (v - cap).min(1).values - 1.0
    hi = v.max(1).values + 1.0
    for _ in range(64):
        mid = (lo + hi) / 2
        positive = torch.minimum(v - mid[:, None], cap).sum(1) > 0
        lo, hi = torch.where(positive, mid, lo), torch.where(positive, hi, mid)
    return torch.minimum(v - ((lo + hi) / 2)[:, None], cap)


def fista(x: Tensor, labels: Tensor, ways: int, iterations: int = 3000) -> Tensor:
    """The dual by accelerated projected gradient (Beck & Teboulle, 2009), ``[S, C]``."""
    onehot = F.one_hot(labels, ways).to(F64)
    gram = x @ x.T
    step = 1 / (float(torch.linalg.eigvalsh(gram)[-1]) + RIDGE)
    alpha = torch.zeros_like(onehot)
    z, t = alpha, 1.0
    for _ in range(iterations):
        new = project_rows(z - step * (gram @ z + RIDGE * z - onehot), C_REG * onehot)
        t_new = (1 + math.sqrt(1 + 4 * t * t)) / 2
        z, alpha, t = new + (t - 1) / t_new * (new - alpha), new, t_new
    return alpha


CASES = [(5, 1, 0, 1.0), (3, 2, 1, 1.0), (4, 3, 2, 3.0), (5, 5, 3, 0.3), (20, 1, 4, 1.0)]


@pytest.mark.parametrize(("ways", "shots", "seed", "spread"), CASES)
def test_the_dual_satisfies_the_reference_qps_kkt_conditions(ways, shots, seed, spread):
    x, labels = problem(ways, shots, seed, spread)
    solved = solve_dual(x, labels, ways, c_reg=C_REG, ridge=RIDGE, ipm_steps=15)
    assert solved.iterations <= 15
    assert kkt_violation(solved.alpha.reshape(-1), *reference_qp(x, labels, ways)) < 1e-10
    assert solved.free.sum() < solved.free.numel()  # some bounds are active: a real QP


@pytest.mark.slow
@pytest.mark.parametrize(("ways", "shots", "seed", "spread"), CASES[:3])
def test_the_dual_equals_projected_gradient_run_to_convergence(ways, shots, seed, spread):
    x, labels = problem(ways, shots, seed, spread)
    reference = fista(x, labels, ways)
    assert kkt_violation(reference.reshape(-1), *reference_qp(x, labels, ways)) < 1e-9
    solved = solve_dual(x, labels, ways, c_reg=C_REG, ridge=RIDGE)
    torch.testing.assert_close(solved.alpha, reference, rtol=0, atol=1e-10)


def test_too_few_interior_point_steps_are_named():
    x, labels = problem(5, 5, 3, 0.3)
    with pytest.raises(ValueError, match="found no optimal face in 2 iterations .*raise ipm_steps"):
        solve_dual(x, labels, 5, c_reg=C_REG, ridge=RIDGE, ipm_steps=2)


@pytest.mark.parametrize(("ways", "shots", "seed", "spread"), CASES[:4])
def test_the_implicit_gradient_equals_finite_differences_of_the_exact_solve(
    ways, shots, seed, spread
):
    """d <q, W*(X)> / dX along random directions: the IFT through `svm_classifier` against
    central differences of `solve_dual` (exact to rounding on a fixed face), step 1e-6."""
    x, labels = problem(ways, shots, seed, spread)
    probe = torch.randn(ways, x.shape[1], generator=torch.Generator().manual_seed(9), dtype=F64)

    def value(features: Tensor) -> Tensor:
        alpha = solve_dual(features, labels, ways, c_reg=C_REG, ridge=RIDGE).alpha
        return (probe * (alpha.T @ features)).sum()

    leaf = x.clone().requires_grad_()
    head = svm_classifier(leaf, labels, ways, c_reg=C_REG, ridge=RIDGE,
                          scale=torch.tensor(1.0, dtype=F64))  # fmt: skip
    (gradient,) = torch.autograd.grad((probe * head.weight).sum(), leaf)
    g = torch.Generator().manual_seed(seed + 100)
    for _ in range(3):
        direction = torch.randn(x.shape, generator=g, dtype=F64)
        h = 1e-6
        numeric = (value(x + h * direction) - value(x - h * direction)) / (2 * h)
        assert float((gradient * direction).sum()) == pytest.approx(float(numeric), rel=1e-6,
                                                                     abs=1e-9)  # fmt: skip


def test_label_smoothing_is_metaoptnets():
    """The target is ``1 - eps`` on the label and ``eps / (C - 1)`` on the others (MetaOptNet's
    train.py), over the task's classes only (an absent class's -inf logit is not a class)."""
    g = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(6, 4, generator=g, dtype=F64), torch.tensor([0, 1, 2, 3, 0, 2])
    target = torch.full((6, 4), 0.1 / 3, dtype=F64).scatter(1, labels[:, None], 0.9)
    expected = -(target * torch.log_softmax(logits, 1)).sum(1).mean()
    torch.testing.assert_close(smoothed_cross_entropy(logits, labels, 0.1), expected)
    masked = torch.cat([logits, torch.full((6, 1), float("-inf"), dtype=F64)], 1)
    torch.testing.assert_close(smoothed_cross_entropy(masked, labels, 0.1), expected)
    torch.testing.assert_close(smoothed_cross_entropy(logits, labels, 0.0),
                               F.cross_entropy(logits, labels))  # fmt: skip


def test_a_degenerate_float32_task_is_solved_within_the_reference_steps():
    """A 5-way 1-shot task met at meta-step ~470 of a 600-step Omniglot training: one
    variable sits at its bound with a multiplier of about 0, which the interior point's
    partition leaves undecided for 17 iterations at the float64 tolerance. Its float32
    features cannot tell the two faces apart, so the float32 tolerance accepts the face at
    15 steps, and the answer equals the exact optimum to float32 rounding."""
    saved = json.loads((ROOT / "tests" / "fixtures" / "svm" / "degenerate_omniglot_task.json")
                       .read_text())  # fmt: skip
    x = torch.tensor(saved["support"], dtype=torch.float32)  # the decimals are float32 values
    labels = torch.tensor(saved["labels"])
    solved = solve_dual(x, labels, 5, c_reg=C_REG, ridge=RIDGE, ipm_steps=15)
    qp = reference_qp(x.to(F64), labels, 5)
    assert kkt_violation(solved.alpha.reshape(-1), *qp) < 1e-6
    with pytest.raises(ValueError, match="no optimal face in 15 iterations"):
        solve_dual(x.to(F64), labels, 5, c_reg=C_REG, ridge=RIDGE, ipm_steps=15)
    exact = solve_dual(x.to(F64), labels, 5, c_reg=C_REG, ridge=RIDGE, ipm_steps=30)
    assert exact.iterations == 17 and kkt_violation(exact.alpha.reshape(-1), *qp) < 1e-10
    torch.testing.assert_close(solved.alpha, exact.alpha, rtol=0, atol=1e-7)
