"""metalearn.functional: tree utilities and functional_call helpers."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn

from metalearn.functional import (
    call,
    flatten_tree,
    params_and_buffers,
    tree_axpy,
    tree_dot,
    tree_leaves,
    tree_map,
    tree_numel,
    tree_scale,
    tree_unflatten,
    unflatten_like,
)

F64 = torch.float64
Pair = namedtuple("Pair", ["weight", "bias"])


def t(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def trees():
    a, b, c, d = t(2, 3, seed=1), t(4, seed=2), t(seed=3), t(3, 2, seed=4).T
    return {
        "tensor": (a, [a]),
        "dict": ({"w": a, "b": b}, [a, b]),
        "ordered_dict": (OrderedDict(b=b, w=a), [b, a]),
        "tuple": ((a, b, c), [a, b, c]),
        "list": ([c, a], [c, a]),
        "namedtuple": (Pair(a, b), [a, b]),
        "nested": ({"enc": {"w": a, "b": b}, "heads": (c, [d])}, [a, b, c, d]),
    }


def same_structure(x, y) -> bool:
    if isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and x.shape == y.shape
    if type(x) is not type(y):
        return False
    if isinstance(y, dict):
        return list(x) == list(y) and all(same_structure(x[k], y[k]) for k in y)
    return len(x) == len(y) and all(same_structure(xi, yi) for xi, yi in zip(x, y))


@pytest.mark.parametrize("name", list(trees()))
def test_tree_leaves_order_and_round_trip(name):
    tree, expected = trees()[name]
    leaves = tree_leaves(tree)
    assert len(leaves) == len(expected)
    assert all(x is y for x, y in zip(leaves, expected))
    rebuilt = tree_unflatten(tree, leaves)
    assert same_structure(rebuilt, tree)  # containers keep their types, OrderedDict included
    assert all(x is y for x, y in zip(tree_leaves(rebuilt), leaves))


@pytest.mark.parametrize("name", list(trees()))
def test_flatten_unflatten_round_trip(name):
    tree, leaves = trees()[name]
    flat = flatten_tree(tree)
    assert flat.shape == (tree_numel(tree),)
    assert torch.equal(flat, torch.cat([leaf.contiguous().view(-1) for leaf in leaves]))
    back = unflatten_like(flat, tree)
    assert same_structure(back, tree)
    for x, y in zip(tree_leaves(back), leaves):
        assert torch.equal(x, y)


def test_flatten_tree_non_contiguous_leaves():
    base = t(5, 3, seed=5)
    tree = {"wt": base.t(), "strided": base[::2, 1:], "expanded": t(3, seed=6).expand(2, 3)}
    assert not any(leaf.is_contiguous() for leaf in tree.values())
    flat = flatten_tree(tree)
    expected = torch.cat([base.t().contiguous().view(-1), base[::2, 1:].contiguous().view(-1)])
    expected = torch.cat([expected, tree["expanded"].contiguous().view(-1)])
    assert torch.equal(flat, expected)
    back = unflatten_like(flat, tree)
    for key, leaf in tree.items():
        assert back[key].shape == leaf.shape
        assert torch.equal(back[key], leaf)


def test_flatten_tree_keeps_the_graph():
    w = t(3, 2, seed=7).requires_grad_()
    (g,) = torch.autograd.grad((flatten_tree({"w": w.T}) ** 2).sum(), w)
    assert torch.equal(g, 2 * w.detach())


def test_unflatten_like_wrong_size_raises():
    like = {"a": t(2, 3), "b": t(4)}
    with pytest.raises(ValueError, match=r"shape \(9,\), expected \(10,\).*one entry per"):
        unflatten_like(torch.zeros(9, dtype=F64), like)
    with pytest.raises(ValueError, match=r"shape \(2, 5\), expected \(10,\)"):
        unflatten_like(torch.zeros(2, 5, dtype=F64), like)


def test_tree_unflatten_wrong_leaf_count_raises():
    like = {"a": t(2), "b": (t(3), t(1))}
    leaves = tree_leaves(like)
    with pytest.raises(ValueError, match="more leaves"):
        tree_unflatten(like, [*leaves, t(1)])
    with pytest.raises(ValueError, match="fewer leaves"):
        tree_unflatten(like, leaves[:2])


def test_tree_leaves_rejects_other_types():
    with pytest.raises(TypeError, match="got int"):
        tree_leaves({"a": 3})


def test_tree_map_and_algebra():
    x = {"a": t(2, 3, seed=8), "b": (t(4, seed=9),)}
    y = {"a": t(2, 3, seed=10), "b": (t(4, seed=11),)}
    fx, fy = flatten_tree(x), flatten_tree(y)
    summed = tree_map(torch.add, x, y)
    assert same_structure(summed, x)
    assert torch.equal(flatten_tree(summed), fx + fy)
    assert torch.allclose(tree_dot(x, y), fx @ fy, rtol=1e-14, atol=0)
    assert tree_dot(x, y).dim() == 0
    assert torch.allclose(flatten_tree(tree_axpy(2.5, x, y)), 2.5 * fx + fy, rtol=1e-14, atol=0)
    assert torch.equal(flatten_tree(tree_scale(-3.0, x)), -3.0 * fx)
    assert tree_numel(x) == 10
    with pytest.raises(ValueError, match="trees differ in structure"):
        tree_map(torch.add, x, {"a": y["a"]})


def test_params_and_buffers_and_call():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).to(F64).eval()
    params, buffers = params_and_buffers(model)
    assert set(params) == {"0.weight", "0.bias", "1.weight", "1.bias", "2.weight", "2.bias"}
    assert set(buffers) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert params["0.weight"] is model[0].weight  # the module's own tensors, no copy
    x = t(5, 3, seed=12)
    assert torch.equal(call(model, params, buffers, x), model(x))

    # a subset of params: the rest fall back to the module's own
    head = {"2.weight": torch.zeros(2, 4, dtype=F64), "2.bias": torch.ones(2, dtype=F64)}
    assert torch.equal(call(model, head, None, x), torch.ones(5, 2, dtype=F64))

    # gradients flow to the passed tensors
    w = params["2.weight"].detach().clone().requires_grad_()
    out = call(model, {**params, "2.weight": w}, buffers, x).sum()
    (g,) = torch.autograd.grad(out, w)
    assert g.shape == w.shape and model[2].weight.grad is None
