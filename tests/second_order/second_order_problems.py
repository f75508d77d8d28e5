"""Small float64 problems and helpers shared by the tests of `metalearn.second_order`.

Each problem is ``f(params) -> scalar`` and a params tree, small enough for a dense Hessian;
`dense_hessian` is the reference built row by row with double backward
(``hessian(method="rows")``), itself checked against finite differences in test_hessian.py.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from metalearn.functional import tree_leaves, tree_map
from metalearn.second_order import hessian

F64 = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def random_tree(like, seed: int):
    g = gen(seed)
    return tree_map(lambda t: torch.randn(t.shape, generator=g, dtype=t.dtype), like)


def assert_same_structure(out, like) -> None:
    assert type(out) is type(like)
    if isinstance(like, dict):
        assert list(out) == list(like)
    out_leaves, like_leaves = tree_leaves(out), tree_leaves(like)
    assert [t.shape for t in out_leaves] == [t.shape for t in like_leaves]


# --------------------------------------------------------------------------- problems
# Each problem is f(params) -> scalar and a params tree, small enough for a dense Hessian.


def _mlp(dtype, g):
    net = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).to(dtype)
    params = {
        k: 0.7 * torch.randn(p.shape, generator=g, dtype=dtype) for k, p in net.named_parameters()
    }
    x = torch.randn(8, 3, generator=g, dtype=dtype)
    y = torch.randint(0, 3, (8,), generator=g)

    def f(p):
        return F.cross_entropy(functional_call(net, p, (x,)), y)

    return f, params


def _conv_params(dtype, g):
    def randn(*shape, scale=0.5):
        return scale * torch.randn(*shape, generator=g, dtype=dtype)

    return {
        "0.weight": randn(3, 2, 3, 3),
        "0.bias": randn(3),
        "1.weight": 1 + randn(3, scale=0.2),
        "1.bias": randn(3, scale=0.2),
        "4.weight": randn(2, 27),
        "4.bias": randn(2),
    }


def _conv_bn(dtype, g):
    # running statistics off: the buffers would be mutated in place, which transforms refuse
    net = nn.Sequential(
        nn.Conv2d(2, 3, 3),
        nn.BatchNorm2d(3, track_running_stats=False),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(27, 2),
    ).to(dtype)
    params = _conv_params(dtype, g)
    assert list(params) == [k for k, _ in net.named_parameters()]
    x = torch.randn(4, 2, 5, 5, generator=g, dtype=dtype)
    y = torch.randint(0, 2, (4,), generator=g)

    def f(p):
        return F.cross_entropy(functional_call(net, p, (x,)), y)

    return f, params


def hand_batch_norm(h, weight, bias, eps=1e-5):
    mean = h.mean(dim=(0, 2, 3), keepdim=True)
    var = ((h - mean) ** 2).mean(dim=(0, 2, 3), keepdim=True)
    return (h - mean) / torch.sqrt(var + eps) * weight.view(1, -1, 1, 1) + bias.view(1, -1, 1, 1)


def _conv_hand_bn(dtype, g):
    params = _conv_params(dtype, g)
    x = torch.randn(4, 2, 5, 5, generator=g, dtype=dtype)
    y = torch.randint(0, 2, (4,), generator=g)

    def f(p):
        h = F.conv2d(x, p["0.weight"], p["0.bias"])
        h = torch.tanh(hand_batch_norm(h, p["1.weight"], p["1.bias"]))
        return F.cross_entropy(F.linear(h.flatten(1), p["4.weight"], p["4.bias"]), y)

    return f, params


def _transposed(dtype, g):
    # w1 is a transposed view: non-contiguous, strides (1, 3)
    params = {
        "w1": torch.randn(5, 3, generator=g, dtype=dtype).t(),
        "b1": torch.randn(5, generator=g, dtype=dtype),
        "w2": torch.randn(2, 5, generator=g, dtype=dtype),
    }
    assert not params["w1"].is_contiguous()
    x = torch.randn(8, 3, generator=g, dtype=dtype)
    y = torch.randn(8, 2, generator=g, dtype=dtype)

    def f(p):
        out = torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"].T
        return ((out - y) ** 2).mean()

    return f, params


def _tuple(dtype, g):
    # a tuple of tensors, including a 0-dim leaf
    params = (
        torch.randn(3, 4, generator=g, dtype=dtype),
        torch.randn(4, generator=g, dtype=dtype),
        torch.tensor(0.8, dtype=dtype),
    )
    x = torch.randn(6, 3, generator=g, dtype=dtype)

    def f(p):
        w, b, c = p
        return (c * F.softplus(x @ w + b)).mean() + c**4 * (b**2).sum()

    return f, params


PROBLEMS = {
    "mlp": (_mlp, 0),
    "conv_bn": (_conv_bn, 1),
    "conv_hand_bn": (_conv_hand_bn, 1),  # same parameters and data as conv_bn
    "transposed": (_transposed, 2),
    "tuple": (_tuple, 3),
}


def make_problem(name: str, dtype=F64):
    build, seed = PROBLEMS[name]
    return build(dtype, gen(seed))


@functools.cache
def dense_hessian(name: str) -> torch.Tensor:
    f, params = make_problem(name)
    return hessian(f, params, method="rows")
