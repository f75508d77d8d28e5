"""The HVP tools on a transformer: every method's H v, and `hessian`, equal the dense Hessian
of the hand-written reference (`tests.helpers.transformer_reference`) in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from metalearn.attention import attention_kernel
from metalearn.functional import flatten_tree
from metalearn.models.sequence import SequenceTransformer
from metalearn.second_order import HVP_METHODS, hessian, hvp, hvp_double_backward, top_eigenvalues
from tests.helpers.transformer_reference import reference_logits


@pytest.fixture(scope="module")
def problem():
    torch.manual_seed(0)
    model = SequenceTransformer(vocab=3, ways=2, length=3, width=4, heads=2, layers=1, ffn=4)
    model = model.double()
    params = {n: p.detach() for n, p in model.named_parameters()}
    x = torch.randint(3, (6, 3), generator=torch.Generator().manual_seed(1))
    y = torch.arange(6) % 2

    def loss(p):
        return F.cross_entropy(functional_call(model, p, (x,)), y)

    def reference(p):
        return F.cross_entropy(reference_logits(p, x, heads=2, layers=1), y)

    dense = hessian(reference, params)
    return model, params, (x, y), loss, dense


@pytest.mark.parametrize("method", HVP_METHODS)
def test_hvp_equals_the_dense_hessian(problem, method):
    _, params, _, loss, dense = problem
    gen = torch.Generator().manual_seed(2)
    v = {k: torch.randn(t.shape, generator=gen, dtype=t.dtype) for k, t in params.items()}
    got = flatten_tree(hvp(loss, params, v, method=method))
    want = dense @ flatten_tree(v)
    assert want.abs().max() > 1e-2
    assert (got - want).abs().max().item() < 1e-10


def test_dense_hessian_of_the_model_equals_the_reference(problem):
    _, params, _, loss, dense = problem
    assert (hessian(loss, params) - dense).abs().max().item() < 1e-10


def test_lanczos_finds_the_dense_hessians_top_eigenvalue(problem):
    _, params, _, loss, dense = problem
    found = top_eigenvalues(
        loss, params, k=1, max_iter=60, generator=torch.Generator().manual_seed(0)
    )
    want = torch.linalg.eigvalsh(dense)[-1]
    assert abs(found.eigenvalues[0].item() - want.item()) < 1e-6 * abs(want.item())


def test_hvp_double_backward_names_the_rule(problem):
    model, params, (x, y), _, dense = problem
    leaves = {k: t.clone().requires_grad_() for k, t in params.items()}
    v = [torch.ones_like(t) for t in leaves.values()]
    fused = F.cross_entropy(functional_call(model, leaves, (x,)), y)
    with pytest.raises(RuntimeError, match="attention_kernel\\(twice_differentiated=True\\)"):
        hvp_double_backward(fused, leaves.values(), v)
    with attention_kernel(twice_differentiated=True):
        math = F.cross_entropy(functional_call(model, leaves, (x,)), y)
    got = torch.cat([t.reshape(-1) for t in hvp_double_backward(math, leaves.values(), v)])
    assert (got - dense @ torch.ones(dense.shape[0], dtype=dense.dtype)).abs().max() < 1e-10
