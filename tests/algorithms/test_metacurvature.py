"""Meta-Curvature (`metalearn.algorithms.metacurvature`) against independent references, in
float64.

References: the dense Kronecker product ``torch.kron`` of the factors applied to the
flattened gradient (Park & Oliva, 2019, Eq. 7-8); the authors' TensorFlow sequence of
matmuls and transposes (``silverbottlep/maml`` ``maml.py``, ``transform_gradients``) in
TensorFlow's kernel layout; the inner step and the meta-gradient written out by hand with
torch.autograd on a small convnet written with ``F.conv2d``; MAML at the identity factors;
the loop for vmap.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from metalearn.algorithms.maml import MAML
from metalearn.algorithms.metacurvature import (
    MetaCurvatureMAML,
    curvature_factors,
    transform_gradient,
)
from metalearn.algorithms.registry import make_learner
from metalearn.engine import Task

F64 = torch.float64
WAYS, SHOTS = 3, 2
EXACT = 1e-12  # the same sums in another order
REFERENCE = 1e-10  # the learner against the written-out float64 meta-gradient


def random_factors(p: Tensor, gen: torch.Generator) -> list[Tensor]:
    """Factors of ``p``'s shapes away from the identity (so a transpose or a swapped axis
    shows)."""
    return [m + 0.3 * torch.randn(m.shape, generator=gen, dtype=F64) for m in curvature_factors(p)]


@pytest.mark.parametrize("shape", [(4, 3, 2, 3), (4, 3, 5), (5, 3), (6,)])
def test_transform_is_the_kronecker_product_applied_to_the_flat_gradient(shape):
    """Eq. 7: vec(M g) = (M_o^T (x) M_i (x) M_f) vec(G) for G = [C_out, C_in, d] flattened
    row-major; M_o enters transposed because the authors multiply the gradient by it from
    the right (``tf.matmul(..., mc_out)``). A linear weight drops M_f, a bias is elementwise."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(shape, generator=gen, dtype=F64)
    factors = random_factors(g, gen)
    if len(shape) == 1:
        dense = torch.diag(factors[0])
    else:
        dense = torch.kron(factors[0].T.contiguous(), factors[1])
        if len(factors) == 3:
            dense = torch.kron(dense, factors[2])
    want = (dense @ g.flatten()).reshape(shape)
    torch.testing.assert_close(transform_gradient(g, factors), want, rtol=EXACT, atol=EXACT)


def authors_transform(g: Tensor, m_out: Tensor, m_in: Tensor, m_f: Tensor) -> Tensor:
    """``transform_gradients`` of ``silverbottlep/maml`` (``maml.py``, the conv branch) on a
    torch kernel ``[C_out, C_in, k_h, k_w]`` moved to TensorFlow's ``[k_h, k_w, C_in, C_out]``
    and back, its reshapes and matmuls one for one."""
    c_out, c_in = g.shape[:2]
    tf = g.permute(2, 3, 1, 0)
    n_f = tf.shape[0] * tf.shape[1]
    temp = tf.reshape(-1, c_out) @ m_out
    temp = (m_f @ temp.reshape(n_f, -1)).reshape(n_f, c_in, c_out)
    temp = m_in @ temp.permute(1, 0, 2).reshape(c_in, -1)
    out = temp.reshape(c_in, n_f, c_out).permute(1, 0, 2).reshape(tf.shape)
    return out.permute(3, 2, 0, 1)


def test_transform_is_the_authors_procedure_in_tensorflows_layout():
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(4, 3, 3, 2, generator=gen, dtype=F64)
    factors = random_factors(g, gen)
    want = authors_transform(g, *factors)
    torch.testing.assert_close(transform_gradient(g, factors), want, rtol=EXACT, atol=EXACT)


class SmallConv(nn.Module):
    """Two 3x3 convolutions and a linear head, written out again in `forward_by_hand`."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 2, 3, padding=1)
        self.conv2 = nn.Conv2d(2, 3, 3, padding=1)
        self.head = nn.Linear(3, WAYS)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.conv2(torch.tanh(self.conv1(x))))
        return self.head(h.mean((2, 3)))


def forward_by_hand(p: dict[str, Tensor], x: Tensor) -> Tensor:
    h = torch.tanh(F.conv2d(x, p["conv1.weight"], p["conv1.bias"], padding=1))
    h = torch.tanh(F.conv2d(h, p["conv2.weight"], p["conv2.bias"], padding=1))
    return h.mean((2, 3)) @ p["head.weight"].T + p["head.bias"]


def small_learner(seed: int = 0, **kwargs) -> MetaCurvatureMAML:
    torch.manual_seed(seed)
    learner = MetaCurvatureMAML(SmallConv().double(), **kwargs)
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # factors away from their identity start, as after training
        for m in learner.curvature.values():
            m.add_(0.2 * torch.randn(m.shape, generator=gen, dtype=F64))
    return learner


def tasks(n: int = 3, seed: int = 1) -> list[Task]:
    gen = torch.Generator().manual_seed(seed)
    y = torch.arange(WAYS).repeat(SHOTS)

    def x() -> Tensor:
        return torch.randn(len(y), 1, 5, 5, generator=gen, dtype=F64)

    return [Task((x(), y), (x(), y)) for _ in range(n)]


def reference_meta_gradient(learner: MetaCurvatureMAML, tasks_: list[Task], steps: int):
    """Park & Oliva (2019) Eq. 5-6 written out: ``steps`` steps ``phi - alpha M grad L_s(phi)``
    from theta, ``M g`` as the dense Kronecker matrix times the flat gradient (as in
    `test_transform_is_the_kronecker_product_applied_to_the_flat_gradient`, written
    independently of `transform_gradient`), the mean query loss differentiated by autograd
    w.r.t. theta and the factors."""
    named = {k: v.detach().clone().requires_grad_() for k, v in learner.named_parameters()}
    theta = {k.removeprefix("model."): v for k, v in named.items() if k.startswith("model.")}
    key = {n: n.replace(".", "__") for n in theta}
    alpha = float(learner.inner_lr)
    total = 0.0
    for task in tasks_:
        phi = dict(theta)
        for _ in range(steps):
            loss = F.cross_entropy(forward_by_hand(phi, task.support[0]), task.support[1])
            grads = torch.autograd.grad(loss, list(phi.values()), create_graph=True)
            new = {}
            for (n, p), g in zip(phi.items(), grads):
                factors = [named[f"curvature.{key[n]}/{a}"] for a in range(min(p.dim(), 3))]
                if p.dim() == 1:
                    mg = factors[0] * g
                else:
                    dense = torch.kron(factors[0].T.contiguous(), factors[1])
                    if p.dim() > 2:
                        dense = torch.kron(dense, factors[2])
                    mg = (dense @ g.flatten()).reshape(p.shape)
                new[n] = p - alpha * mg
            phi = new
        query = F.cross_entropy(forward_by_hand(phi, task.query[0]), task.query[1])
        total = total + query / len(tasks_)
    return dict(zip(named, torch.autograd.grad(total, list(named.values()))))


def learner_gradient(learner: MetaCurvatureMAML, tasks_: list[Task]) -> dict[str, Tensor]:
    learner.zero_grad(set_to_none=True)
    learner.backward(tasks_)
    return {k: p.grad.clone() for k, p in learner.named_parameters()}


@pytest.mark.parametrize("vectorize", ["loop", "vmap"])
def test_meta_gradient_matches_the_written_out_reference(vectorize):
    """Second order through two inner steps: theta's and every factor's meta-gradient."""
    learner = small_learner(inner_lr=0.5, inner_steps=2, vectorize=vectorize, chunk_size=None)
    batch = tasks()
    want = reference_meta_gradient(learner, batch, steps=2)
    got = learner_gradient(learner, batch)
    assert set(got) == set(want) and any(k.startswith("curvature.") for k in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=REFERENCE, atol=REFERENCE,
                                   msg=lambda m, name=name: f"{name}: {m}")  # fmt: skip


def test_vmap_equals_the_loop():
    batch = tasks(4, seed=3)
    loop = learner_gradient(small_learner(inner_steps=2, vectorize="loop"), batch)
    vmap = learner_gradient(small_learner(inner_steps=2, vectorize="vmap"), batch)
    for name in loop:
        torch.testing.assert_close(vmap[name], loop[name], rtol=EXACT, atol=EXACT)


def test_at_the_identity_factors_it_is_maml():
    """The factors start at the identity (the authors' ``tf.diag([1.0] * n)``), so a fresh
    learner's adapted weights and theta's meta-gradient are MAML's."""
    torch.manual_seed(0)
    model = SmallConv().double()
    fresh = MetaCurvatureMAML(model, inner_steps=2, vectorize="loop")
    maml = MAML(model, inner_steps=2, vectorize="loop")
    batch = tasks()
    for a, b in zip(fresh.adapt(batch[0]).values(), maml.adapt(batch[0]).values()):
        torch.testing.assert_close(a, b, rtol=EXACT, atol=EXACT)
    got, want = learner_gradient(fresh, batch), learner_gradient(maml, batch)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=EXACT, atol=EXACT)


def test_factors_are_meta_parameters_not_network_weights():
    """The outer optimizer steps the factors; the meta-gradient clamp and deploy read the
    network's weights alone."""
    learner = small_learner()
    factors = {id(m) for m in learner.curvature.values()}
    assert factors <= {id(p) for p in learner.parameters()}
    assert not factors & {id(p) for p in learner.network_parameters()}


def test_the_inner_optimizer_is_its_own():
    with pytest.raises(ValueError, match="takes no argument inner_optimizer"):
        make_learner("metacurvature", SmallConv(), {"inner_optimizer": "adam"})
    with pytest.raises(ValueError, match="drop inner_optimizer"):
        MetaCurvatureMAML(SmallConv(), inner_optimizer="adam")
