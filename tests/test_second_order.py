"""metalearn.second_order against slow, obvious references.

References: the dense Hessian built row by row with double backward (`hessian(method="rows")`),
closed forms on polynomials, central finite differences and `torch.linalg`. Everything runs
in float64 with fixed seeds and fixed tolerances.
"""

from __future__ import annotations

import functools
import gc
import inspect
import itertools
import warnings
import weakref
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from metalearn.functional import flatten_tree, tree_dot, tree_leaves, tree_map, unflatten_like
from metalearn.second_order import (
    DEFAULT_HVP_METHOD,
    HVP_METHODS,
    conjugate_gradient,
    hessian,
    hessian_trace,
    hvp,
    hvp_double_backward,
    top_eigenvalues,
)

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


# --------------------------------------------------------------------------- hvp


@pytest.mark.parametrize("method", HVP_METHODS)
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_hvp_equals_dense_hessian_times_v(name, method):
    f, params = make_problem(name)
    v = random_tree(params, seed=10)
    out = hvp(f, params, v, method=method)
    assert_same_structure(out, params)
    expected = dense_hessian(name) @ flatten_tree(v)
    assert rel_err(flatten_tree(out), expected) < 1e-10


def test_batch_norm_problems_agree():
    # nn.BatchNorm2d (fused kernel) and the mean/var one compute the same function
    f_bn, params = make_problem("conv_bn")
    f_hand, _ = make_problem("conv_hand_bn")
    assert abs(float(f_bn(params)) - float(f_hand(params))) < 1e-12
    assert rel_err(dense_hessian("conv_bn"), dense_hessian("conv_hand_bn")) < 1e-10


@pytest.mark.parametrize("name", ["mlp", "conv_bn", "transposed", "tuple"])
def test_hvp_methods_agree_in_float32(name):
    f, params = make_problem(name, dtype=torch.float32)
    v = random_tree(params, seed=11)
    outs = {m: flatten_tree(hvp(f, params, v, method=m)) for m in HVP_METHODS}
    for a, b in itertools.combinations(HVP_METHODS, 2):
        assert rel_err(outs[a], outs[b]) < 1e-4, (a, b)


@pytest.mark.parametrize("method", HVP_METHODS)
def test_hvp_single_tensor_params(method):
    A = torch.randn(4, 4, generator=gen(4), dtype=F64)
    A = A + A.T

    def f(x):
        return 0.5 * x @ A @ x + (x**4).sum() / 12

    x = torch.randn(4, generator=gen(5), dtype=F64)
    v = torch.randn(4, generator=gen(6), dtype=F64)
    expected = (A + torch.diag(x**2)) @ v
    assert rel_err(hvp(f, x, v, method=method), expected) < 1e-12


@pytest.mark.parametrize("method", HVP_METHODS)
def test_hvp_without_create_graph_records_nothing(method):
    f, params = make_problem("mlp")
    params = {k: t.requires_grad_() for k, t in params.items()}
    out = hvp(f, params, random_tree(params, seed=12), method=method)
    assert all(not t.requires_grad for t in tree_leaves(out))
    assert all(t.grad is None for t in params.values())


@pytest.mark.parametrize("method", HVP_METHODS)
def test_hvp_linear_and_unused_leaves_give_zeros(method):
    def f(p):
        return (p["sq"] ** 3).sum() + 2.0 * p["lin"].sum()  # "unused" does not appear

    params = {
        "sq": torch.randn(3, generator=gen(0), dtype=F64),
        "lin": torch.randn(3, generator=gen(1), dtype=F64),
        "unused": torch.randn(2, generator=gen(7), dtype=F64),
    }
    v = random_tree(params, seed=13)
    out = hvp(f, params, v, method=method)
    torch.testing.assert_close(out["sq"], 6 * params["sq"] * v["sq"], rtol=1e-12, atol=0)
    assert torch.equal(out["lin"], torch.zeros(3, dtype=F64))
    assert torch.equal(out["unused"], torch.zeros(2, dtype=F64))


# ---- create_graph: the HVP is differentiable


def _cubic_quartic(n: int, seed: int):
    """f(z) = (a.z)^4 / 24 + T(z, z, z) / 6 with T symmetric, and d/dz <H(z) v, u>."""
    g = gen(seed)
    a = torch.randn(n, generator=g, dtype=F64)
    T = torch.randn(n, n, n, generator=g, dtype=F64)
    T = sum(T.permute(*perm) for perm in itertools.permutations(range(3))) / 6

    def f_flat(z):
        return (a @ z) ** 4 / 24 + torch.einsum("ijk,i,j,k->", T, z, z, z) / 6

    def third(z, v, u):  # gradient of <H(z) v, u> = (a.z)^2 (a.v)(a.u) / 2 + T(v, u, z)
        return (a @ z) * (a @ v) * (a @ u) * a + torch.einsum("ijk,i,j->k", T, v, u)

    return f_flat, third


@pytest.mark.parametrize("method", HVP_METHODS)
def test_hvp_create_graph_matches_third_derivative_closed_form(method):
    f_flat, third = _cubic_quartic(7, seed=20)
    like = {"x": torch.zeros(3, dtype=F64), "y": torch.zeros(2, 2, dtype=F64)}

    def f(p):
        return f_flat(flatten_tree(p))

    z, v, u = (torch.randn(7, generator=gen(21 + i), dtype=F64) for i in range(3))
    params = tree_map(lambda t: t.requires_grad_(), unflatten_like(z.clone(), like))
    hv = hvp(f, params, unflatten_like(v, like), method=method, create_graph=True)
    grads = torch.autograd.grad(tree_dot(hv, unflatten_like(u, like)), list(params.values()))
    assert rel_err(flatten_tree(grads), third(z, v, u)) < 1e-12


@pytest.mark.parametrize("method", HVP_METHODS)
def test_hvp_create_graph_matches_finite_differences(method):
    f, params0 = make_problem("mlp")
    v, u = random_tree(params0, seed=30), random_tree(params0, seed=31)
    params = tree_map(lambda t: t.clone().requires_grad_(), params0)
    hv = hvp(f, params, v, method=method, create_graph=True)
    grads = torch.autograd.grad(tree_dot(hv, u), list(params.values()))
    flat_v, flat_u = flatten_tree(v), flatten_tree(u)

    def phi(p):  # <H(p) v, u> from the independent dense reference
        return float(flat_u @ hessian(f, p) @ flat_v)

    eps = 1e-5  # truncation error ~6e-10 relative here, rounding ~1e-11
    for seed in (32, 33):
        w = random_tree(params0, seed=seed)
        fd = (
            phi(tree_map(lambda p, d: p + eps * d, params0, w))
            - phi(tree_map(lambda p, d: p - eps * d, params0, w))
        ) / (2 * eps)
        analytic = float(flatten_tree(grads) @ flatten_tree(w))
        assert abs(analytic - fd) <= 1e-7 * abs(fd)


# ---- hvp_double_backward


class TransposedNet(nn.Module):
    def __init__(self, g: torch.Generator):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(5, 3, generator=g, dtype=F64).t())  # non-contiguous
        self.b1 = nn.Parameter(torch.randn(5, generator=g, dtype=F64))
        self.w2 = nn.Parameter(torch.randn(2, 5, generator=g, dtype=F64))
        self.unused = nn.Parameter(torch.randn(4, generator=g, dtype=F64))
        self.linear_only = nn.Parameter(torch.randn(2, generator=g, dtype=F64))

    def forward(self, x):
        return torch.tanh(x @ self.w1 + self.b1) @ self.w2.T


def _net_and_objective(seed=40):
    g = gen(seed)
    model = TransposedNet(g)
    x = torch.randn(8, 3, generator=g, dtype=F64)
    y = torch.randn(8, 2, generator=g, dtype=F64)
    c = torch.randn(2, generator=g, dtype=F64)

    def objective(p):
        out = functional_call(model, p, (x,))
        return ((out - y) ** 2).mean() + (c * p["linear_only"]).sum()

    return model, objective


def _dense_reference(model, objective, v_flat):
    params = {k: t.detach() for k, t in model.named_parameters()}
    return hessian(objective, params) @ v_flat


@pytest.mark.parametrize("as_sequence", [False, True], ids=["flat", "sequence"])
def test_hvp_double_backward_equals_dense(as_sequence):
    model, objective = _net_and_objective()
    assert not model.w1.is_contiguous()
    (g_w1,) = torch.autograd.grad(objective(dict(model.named_parameters())), model.w1)
    assert not g_w1.is_contiguous()  # the case this test is about
    params = list(model.parameters())
    v_flat = torch.randn(sum(p.numel() for p in params), generator=gen(41), dtype=F64)
    v = unflatten_like(v_flat, params) if as_sequence else v_flat
    loss = objective(dict(model.named_parameters()))
    out = hvp_double_backward(loss, model.parameters(), v)
    assert isinstance(out, tuple)
    assert [t.shape for t in out] == [p.shape for p in params]
    assert not any(t.requires_grad for t in out)
    assert rel_err(flatten_tree(out), _dense_reference(model, objective, v_flat)) < 1e-10
    names = [k for k, _ in model.named_parameters()]
    assert torch.equal(out[names.index("unused")], torch.zeros(4, dtype=F64))
    assert torch.equal(out[names.index("linear_only")], torch.zeros(2, dtype=F64))
    assert all(p.grad is None for p in params)


def test_hvp_double_backward_all_parameters_unused_or_linear():
    w = torch.randn(3, dtype=F64, requires_grad=True)
    unused = torch.randn(2, dtype=F64, requires_grad=True)
    out = hvp_double_backward((2 * w).sum(), [w, unused], torch.ones(5, dtype=F64))
    assert torch.equal(out[0], torch.zeros(3, dtype=F64))
    assert torch.equal(out[1], torch.zeros(2, dtype=F64))


def test_hvp_double_backward_create_graph_is_differentiable():
    model, objective = _net_and_objective()
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    v, u = (torch.randn(n, generator=gen(42 + i), dtype=F64) for i in range(2))
    loss = objective(dict(model.named_parameters()))
    out = hvp_double_backward(loss, params, v, create_graph=True)
    grads = torch.autograd.grad(flatten_tree(out) @ u, params, allow_unused=True)
    # the same third derivative through hvp(..., method="double-backward", create_graph=True)
    p = {k: t for k, t in model.named_parameters()}
    hv = hvp(objective, p, unflatten_like(v, p), method="double-backward", create_graph=True)
    ref = torch.autograd.grad(tree_dot(hv, unflatten_like(u, p)), params, allow_unused=True)
    for a, b in zip(grads, ref):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def _loss_with_watched_activation(model, x, y):
    h = torch.tanh(x @ model.w1 + model.b1)  # saved by the matmul below
    return ((h @ model.w2.T - y) ** 2).mean(), weakref.ref(h)


def test_hvp_double_backward_frees_the_graph():
    model, _ = _net_and_objective()
    x, y = torch.randn(8, 3, dtype=F64), torch.randn(8, 2, dtype=F64)
    params = [model.w1, model.b1, model.w2]
    v = torch.randn(sum(p.numel() for p in params), dtype=F64)
    gc.disable()  # the activation must die by reference counting alone: no cycles
    try:
        loss, watched = _loss_with_watched_activation(model, x, y)
        assert watched() is not None  # the graph holds it
        hvp_double_backward(loss, params, v)
        del loss
        assert watched() is None

        loss, watched = _loss_with_watched_activation(model, x, y)
        first = hvp_double_backward(loss, params, v, retain_graph=True)
        second = hvp_double_backward(loss, params, v, retain_graph=True)
        for a, b in zip(first, second):
            assert torch.equal(a, b)
        assert watched() is not None
        del loss
        assert watched() is None
    finally:
        gc.enable()


def test_hvp_double_backward_twice_without_retain_graph_raises():
    model, objective = _net_and_objective()
    params = list(model.parameters())
    v = torch.randn(sum(p.numel() for p in params), dtype=F64)
    loss = objective(dict(model.named_parameters()))
    hvp_double_backward(loss, params, v)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        hvp_double_backward(loss, params, v)

    loss = objective(dict(model.named_parameters()))
    hvp_double_backward(loss, params, v, retain_graph=True)
    hvp_double_backward(loss, params, v, retain_graph=True)
    loss.backward()  # still possible: the graph was retained


def test_hvp_double_backward_bad_input():
    model, objective = _net_and_objective()
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    loss = objective(dict(model.named_parameters()))
    with pytest.raises(ValueError, match=rf"flat v has shape \({n - 1},\).*pass a vector of shape"):
        hvp_double_backward(loss, params, torch.zeros(n - 1, dtype=F64), retain_graph=True)
    with pytest.raises(ValueError, match="pass a vector of shape"):
        hvp_double_backward(loss, params, torch.zeros(1, n, dtype=F64), retain_graph=True)
    with pytest.raises(ValueError, match="shape"):
        bad = [torch.zeros(p.shape, dtype=F64) for p in params]
        bad[0] = torch.zeros(5, 3, dtype=F64)  # w1 is 3x5
        hvp_double_backward(loss, params, bad, retain_graph=True)
    with pytest.raises(ValueError, match="same structure"):
        hvp_double_backward(loss, params, [torch.zeros(3, 5, dtype=F64)], retain_graph=True)
    frozen = torch.zeros(3, dtype=F64)
    with pytest.raises(ValueError, match=r"does not require grad.*requires_grad_\(\)"):
        hvp_double_backward(loss, [*params, frozen], torch.zeros(n + 3, dtype=F64))
    with pytest.raises(ValueError, match="params is empty"):
        hvp_double_backward(loss, [], torch.zeros(0, dtype=F64))
    out = model(torch.randn(4, 3, dtype=F64))  # [4, 2]
    with pytest.raises(ValueError, match=r"scalar.*\.mean\(\) or \.sum\(\)"):
        hvp_double_backward(out, params, torch.zeros(n, dtype=F64))
    with pytest.raises(ValueError, match="requires_grad=False"):
        hvp_double_backward(loss.detach(), params, torch.zeros(n, dtype=F64))


# ---- structure checks and other bad input


@pytest.mark.parametrize("method", HVP_METHODS)
def test_hvp_structure_mismatch_raises(method):
    f, params = make_problem("transposed")
    v = random_tree(params, seed=50)
    cases = [
        ({"w1": v["w1"], "b1": v["b1"]}, "v has 2 tensors but params has 3"),
        ({"w1": v["w1"], "b1": v["b1"], "w3": v["w2"]}, "keys"),
        ({"b1": v["b1"], "w1": v["w1"], "w2": v["w2"]}, "same order"),
        ({**v, "w1": v["w1"].T}, r"tensor 0 has shape \(5, 3\).*\(3, 5\)"),
        (tuple(v.values()), "v is a tuple/list but params is a dict"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            hvp(f, params, bad, method=method)

    nested = {"a": {"w": params["w1"]}, "b": params["b1"]}
    with pytest.raises(ValueError, match=r"v\['a'\]'s keys \['x'\]"):
        hvp(lambda p: p["b"].sum(), nested, {"a": {"x": v["w1"]}, "b": v["b1"]}, method=method)


@pytest.mark.parametrize("method", HVP_METHODS)
def test_hvp_accepts_other_containers_of_the_same_shape(method):
    # torch.func compares container types exactly; hvp must not: dict vs OrderedDict and
    # tuple vs list are the same tree here, and the result has params' containers.
    f, params = make_problem("transposed")
    ordered = OrderedDict(params)
    v = random_tree(params, seed=51)
    expected = dense_hessian("transposed") @ flatten_tree(v)
    out = hvp(f, ordered, dict(v), method=method)
    assert_same_structure(out, ordered)
    assert rel_err(flatten_tree(out), expected) < 1e-10

    f_t, params_t = make_problem("tuple")
    v_t = random_tree(params_t, seed=52)
    out = hvp(f_t, params_t, list(v_t), method=method)
    assert_same_structure(out, params_t)
    assert rel_err(flatten_tree(out), dense_hessian("tuple") @ flatten_tree(v_t)) < 1e-10


@pytest.mark.parametrize("method", HVP_METHODS)
def test_hvp_non_scalar_f_raises(method):
    x = torch.randn(3, dtype=F64)
    with pytest.raises(ValueError, match=r"scalar.*got \(3,\).*\.mean\(\) or \.sum\(\)"):
        hvp(lambda p: p**2, x, x, method=method)


def test_hvp_unknown_method_raises():
    x = torch.randn(3, dtype=F64)
    with pytest.raises(ValueError, match="unknown HVP method"):
        hvp(lambda p: (p**2).sum(), x, x, method="finite-differences")


# --------------------------------------------------------------------------- hessian


def test_hessian_rows_of_quadratic_is_A():
    g = gen(60)
    M = torch.randn(6, 6, generator=g, dtype=F64)
    A = M + M.T
    b = torch.randn(6, generator=g, dtype=F64)
    x = torch.randn(6, generator=g, dtype=F64)
    H = hessian(lambda z: 0.5 * z @ A @ z + b @ z, x, method="rows")
    torch.testing.assert_close(H, A, rtol=0, atol=1e-12)
    # the same on a tree: flattened in tree_leaves order
    tree = {"a": x[:2].clone(), "b": x[2:].reshape(2, 2).clone()}
    H = hessian(lambda p: (lambda z: 0.5 * z @ A @ z + b @ z)(flatten_tree(p)), tree)
    torch.testing.assert_close(H, A, rtol=0, atol=1e-12)


def test_hessian_of_linear_function_is_zero():
    x, zeros = torch.randn(4, dtype=F64), torch.zeros(4, 4, dtype=F64)
    for method in ("rows", "vmap"):
        assert torch.equal(hessian(lambda z: 3 * z.sum(), x, method=method), zeros)


@pytest.mark.parametrize("name", ["mlp", "conv_hand_bn", "transposed", "tuple"])
def test_hessian_vmap_equals_rows(name):
    f, params = make_problem(name)
    assert rel_err(hessian(f, params, method="vmap"), dense_hessian(name)) < 1e-10


@pytest.mark.xfail(
    reason="torch bug (2.13): torch.func.hessian through F.batch_norm(training=True) gets the "
    "mixed second derivative wrong (7% relative error here); XPASS means torch fixed it",
    strict=False,
)
def test_hessian_vmap_through_fused_batch_norm():
    f, params = make_problem("conv_bn")
    assert rel_err(hessian(f, params, method="vmap"), dense_hessian("conv_bn")) < 1e-10


def test_hessian_rows_matches_finite_differences_on_batch_norm_net():
    # The independent check of the reference itself, on the net where vmap is wrong:
    # H w against central differences of the gradient along w.
    f, params = make_problem("conv_bn")
    x0 = flatten_tree(params)

    def grad_at(x):
        x = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(f(unflatten_like(x, params)), x)
        return g

    eps = 1e-5
    for seed in (61, 62, 63):
        w = torch.randn(x0.numel(), generator=gen(seed), dtype=F64)
        fd = (grad_at(x0 + eps * w) - grad_at(x0 - eps * w)) / (2 * eps)
        assert rel_err(dense_hessian("conv_bn") @ w, fd) < 1e-8
    # and column by column on the batch-norm weights (the block vmap gets wrong)
    start = sum(t.numel() for t in list(params.values())[:2])
    for j in range(start, start + 3):
        e = torch.zeros_like(x0)
        e[j] = 1.0
        fd = (grad_at(x0 + eps * e) - grad_at(x0 - eps * e)) / (2 * eps)
        assert rel_err(dense_hessian("conv_bn")[:, j], fd) < 1e-8


def test_hessian_bad_input():
    x = torch.randn(3, dtype=F64)
    with pytest.raises(ValueError, match="scalar"):
        hessian(lambda p: p**2, x)
    with pytest.raises(ValueError, match="unknown hessian method"):
        hessian(lambda p: (p**2).sum(), x, method="columns")


# --------------------------------------------------------------------------- CG


def _spd(n: int, seed: int, cond_spread: float = 1.0) -> torch.Tensor:
    g = gen(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64))
    eigs = torch.logspace(0, cond_spread, n, dtype=F64)
    return Q @ torch.diag(eigs) @ Q.T


def _check_residual(result, A_flat, b_flat):
    true = float((b_flat - A_flat @ flatten_tree(result.x)).norm())
    assert abs(result.residual_norm - true) <= 1e-12 * float(b_flat.norm())


def test_cg_solves_spd_system():
    A = _spd(30, seed=70, cond_spread=2.0)
    b = torch.randn(30, generator=gen(71), dtype=F64)
    result = conjugate_gradient(lambda x: A @ x, b, tol=1e-11, max_iter=200)
    assert result.converged
    assert 1 <= result.iterations <= 200
    assert result.residual_norm <= 1e-11 * float(b.norm())
    _check_residual(result, A, b)
    assert rel_err(result.x, torch.linalg.solve(A, b)) < 1e-9


def test_cg_on_a_tree():
    A = _spd(11, seed=72, cond_spread=1.5)
    like = {"a": torch.zeros(3, dtype=F64), "b": torch.zeros(2, 4, dtype=F64)}
    b_flat = torch.randn(11, generator=gen(73), dtype=F64)
    b = unflatten_like(b_flat, like)

    def matvec(tree):
        return unflatten_like(A @ flatten_tree(tree), like)

    result = conjugate_gradient(matvec, b, tol=1e-12, max_iter=100)
    assert result.converged
    assert_same_structure(result.x, like)
    _check_residual(result, A, b_flat)
    assert rel_err(flatten_tree(result.x), torch.linalg.solve(A, b_flat)) < 1e-10


def test_cg_damping():
    # A indefinite, A + 3 I positive definite
    g = gen(74)
    Q, _ = torch.linalg.qr(torch.randn(12, 12, generator=g, dtype=F64))
    A = Q @ torch.diag(torch.linspace(-2.0, 5.0, 12, dtype=F64)) @ Q.T
    b = torch.randn(12, generator=g, dtype=F64)
    result = conjugate_gradient(lambda x: A @ x, b, damping=3.0, tol=1e-12)
    damped = A + 3.0 * torch.eye(12, dtype=F64)
    assert result.converged
    _check_residual(result, damped, b)
    assert rel_err(result.x, torch.linalg.solve(damped, b)) < 1e-10


def test_cg_with_hvp_matvec_imaml_style():
    # (I + H / lam) x = b with H the Hessian of an MLP loss, as in iMAML
    f, params = make_problem("mlp")
    lam = 4.0  # the Hessian's smallest eigenvalue is -2.18: I + H / 4 is SPD
    b = random_tree(params, seed=75)

    def matvec(t):
        return tree_map(lambda h: h / lam, hvp(f, params, t))

    result = conjugate_gradient(matvec, b, damping=1.0, tol=1e-12, max_iter=200)
    system = torch.eye(38, dtype=F64) + dense_hessian("mlp") / lam
    assert result.converged
    assert_same_structure(result.x, params)
    assert rel_err(flatten_tree(result.x), torch.linalg.solve(system, flatten_tree(b))) < 1e-9


def test_cg_non_positive_curvature_raises():
    A = torch.diag(torch.tensor([1.0, -1.0, 2.0], dtype=F64))
    b = torch.ones(3, dtype=F64)
    with pytest.raises(ValueError, match="not positive definite; add damping"):
        conjugate_gradient(lambda x: A @ x, b)


def test_cg_max_iter_reached():
    A = _spd(30, seed=76, cond_spread=4.0)
    b = torch.randn(30, generator=gen(77), dtype=F64)
    result = conjugate_gradient(lambda x: A @ x, b, max_iter=3, tol=1e-12)
    assert not result.converged
    assert result.iterations == 3
    assert result.residual_norm > 1e-12 * float(b.norm())
    _check_residual(result, A, b)


def test_cg_warm_start_and_atol():
    A = _spd(10, seed=78)
    b = torch.randn(10, generator=gen(79), dtype=F64)
    exact = torch.linalg.solve(A, b)
    result = conjugate_gradient(lambda x: A @ x, b, x0=exact, tol=1e-10)
    assert result.converged and result.iterations == 0
    assert torch.equal(result.x, exact)
    loose = conjugate_gradient(lambda x: A @ x, b, tol=0.0, atol=1e-3, max_iter=100)
    assert loose.converged and loose.residual_norm <= 1e-3
    _check_residual(loose, A, b)


def test_cg_bad_arguments():
    b = torch.ones(3, dtype=F64)
    with pytest.raises(ValueError, match="max_iter"):
        conjugate_gradient(lambda x: x, b, max_iter=0)
    with pytest.raises(ValueError, match="damping"):
        conjugate_gradient(lambda x: x, b, damping=-1.0)


# --------------------------------------------------------------------------- eigenvalues


def _quadratic_with_spectrum(eigs, seed):
    n = len(eigs)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen(seed), dtype=F64))
    A = Q @ torch.diag(torch.tensor(eigs, dtype=F64)) @ Q.T
    A = (A + A.T) / 2
    x = torch.randn(n, generator=gen(seed + 1), dtype=F64)
    return (lambda z: 0.5 * z @ A @ z), x, A


def _check_eigenpairs(result, H, k):
    assert result.eigenvalues.shape == (k,)
    assert len(result.eigenvectors) == k
    for lam, vec in zip(result.eigenvalues, result.eigenvectors):
        u = flatten_tree(vec)
        assert abs(float(u.norm()) - 1) < 1e-10
        assert float((H @ u - lam * u).norm()) <= 1e-5 * abs(float(lam))


@pytest.mark.parametrize("name", ["mlp", "conv_bn"])
def test_lanczos_top_eigenvalues_match_eigvalsh(name):
    f, params = make_problem(name)
    H = dense_hessian(name)
    expected = torch.linalg.eigvalsh(H).flip(0)[:3]  # largest algebraic first
    result = top_eigenvalues(f, params, k=3, method="lanczos", which="LA", generator=gen(80))
    torch.testing.assert_close(result.eigenvalues, expected, rtol=1e-6, atol=0)
    _check_eigenpairs(result, H, 3)


@pytest.mark.parametrize("method", ["lanczos", "power"])
def test_largest_magnitude_eigenvalues_match_eigvalsh(method):
    f, params = make_problem("mlp")
    H = dense_hessian("mlp")
    evals = torch.linalg.eigvalsh(H)
    expected = evals[evals.abs().argsort(descending=True)][:2]
    result = top_eigenvalues(
        f, params, k=2, method=method, which="LM", max_iter=1000, tol=1e-12, generator=gen(81)
    )
    torch.testing.assert_close(result.eigenvalues, expected, rtol=1e-6, atol=0)
    _check_eigenpairs(result, H, 2)


@pytest.mark.parametrize("hvp_method", HVP_METHODS)
def test_top_eigenvalue_with_each_hvp_method(hvp_method):
    f, params = make_problem("transposed")
    expected = torch.linalg.eigvalsh(dense_hessian("transposed"))[-1]
    result = top_eigenvalues(f, params, generator=gen(82), hvp_method=hvp_method)
    torch.testing.assert_close(result.eigenvalues[0], expected, rtol=1e-6, atol=0)


def test_lanczos_repeated_eigenvalues():
    # A single Krylov space sees one copy of a repeated eigenvalue; Lanczos must restart
    # after the breakdown instead of returning [3, 1] (or NaN when k exceeds its dimension).
    f, x, A = _quadratic_with_spectrum([3.0, 3.0, 1.0, 1.0, 0.5, 0.2], seed=83)
    result = top_eigenvalues(f, x, k=3, generator=gen(84))
    torch.testing.assert_close(result.eigenvalues, torch.tensor([3.0, 3.0, 1.0], dtype=F64))
    _check_eigenpairs(result, A, 3)
    identity = top_eigenvalues(lambda z: 0.5 * z @ z, x, k=2, generator=gen(85))
    torch.testing.assert_close(identity.eigenvalues, torch.ones(2, dtype=F64))


def test_lanczos_is_scale_free():
    eigs = [5.0, 4.0, 2.0, 1.0, -1.0, 0.5, 0.1]
    f, x, A = _quadratic_with_spectrum([1e-12 * e for e in eigs], seed=86)
    result = top_eigenvalues(f, x, k=2, generator=gen(87))
    torch.testing.assert_close(result.eigenvalues, torch.tensor([5e-12, 4e-12], dtype=F64))
    _check_eigenpairs(result, A, 2)


def test_top_eigenvalues_reproducible_and_ordered_dict():
    f, params = make_problem("mlp")
    a = top_eigenvalues(f, params, k=2, generator=gen(88))
    b = top_eigenvalues(f, OrderedDict(params), k=2, generator=gen(88))
    assert torch.equal(a.eigenvalues, b.eigenvalues)
    assert a.iterations == b.iterations
    assert type(b.eigenvectors[0]) is OrderedDict


def test_top_eigenvalues_bad_arguments():
    f, params = make_problem("mlp")
    with pytest.raises(ValueError, match="k must be between 1"):
        top_eigenvalues(f, params, k=0)
    with pytest.raises(ValueError, match=r"number of parameters \(38\)"):
        top_eigenvalues(f, params, k=39)
    with pytest.raises(ValueError, match="use which='LM' or method='lanczos'"):
        top_eigenvalues(f, params, method="power", which="LA")
    with pytest.raises(ValueError, match="which must be"):
        top_eigenvalues(f, params, which="SA")
    with pytest.raises(ValueError, match="unknown method"):
        top_eigenvalues(f, params, method="arnoldi")


# --------------------------------------------------------------------------- trace


@pytest.mark.parametrize("name", ["mlp", "conv_bn", "tuple"])
def test_hutchinson_trace_within_three_standard_errors(name):
    f, params = make_problem(name)
    exact = float(torch.trace(dense_hessian(name)))
    est = hessian_trace(f, params, samples=100, generator=gen(90))
    assert est.samples == 100
    assert est.std_error > 0
    assert abs(est.estimate - exact) <= 3 * est.std_error


def test_hutchinson_trace_reproducible():
    f, params = make_problem("transposed")
    a = hessian_trace(f, params, samples=20, generator=gen(91))
    b = hessian_trace(f, OrderedDict(params), samples=20, generator=gen(91))
    assert a == b
    c = hessian_trace(f, params, samples=20, generator=gen(92))
    assert c.estimate != a.estimate


@pytest.mark.parametrize("hvp_method", HVP_METHODS)
def test_hutchinson_trace_exact_for_diagonal_hessian(hvp_method):
    # Rademacher probes have v_i^2 = 1, so v'Dv = tr D for every probe: no variance
    d = torch.tensor([1.0, 2.0, 3.0], dtype=F64)

    def f(p):
        return (p["a"] ** 4).sum() / 12 + 0.5 * (d * p["b"] ** 2).sum()

    params = {"a": torch.randn(2, 2, generator=gen(93), dtype=F64), "b": torch.randn(3, dtype=F64)}
    exact = float((params["a"] ** 2).sum()) + 6.0
    est = hessian_trace(f, params, samples=5, generator=gen(94), hvp_method=hvp_method)
    assert abs(est.estimate - exact) <= 1e-12 * exact
    assert est.std_error <= 1e-12 * exact


def test_hutchinson_trace_needs_two_samples():
    f, params = make_problem("mlp")
    with pytest.raises(ValueError, match="samples must be >= 2"):
        hessian_trace(f, params, samples=1)


@pytest.mark.parametrize("loss", [F.mse_loss, F.huber_loss])
def test_forward_over_reverse_falls_back_where_torch_lacks_forward_mode(loss):
    # torch 2.13: mse_loss(mean) fails forward-over-reverse ("ZeroTensors are immutable") and
    # huber_loss has no forward-AD formula; asked for by name, it must still give the exact
    # H v, warned. The default method needs no fallback there: it neither warns nor differs.
    f, params, v = _regression_problem(loss)
    dense = hessian(f, params) @ v["w"].reshape(-1)
    with pytest.warns(RuntimeWarning, match="using reverse-over-reverse"):
        hv = hvp(f, params, v, method="forward-over-reverse")
    torch.testing.assert_close(hv["w"].reshape(-1), dense, rtol=1e-10, atol=1e-14)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hv = hvp(f, params, v)
    torch.testing.assert_close(hv["w"].reshape(-1), dense, rtol=1e-10, atol=1e-14)


def _regression_problem(loss):
    g = gen(3)
    x = torch.randn(6, 3, generator=g, dtype=F64)
    y = torch.randn(6, 1, generator=g, dtype=F64)
    params = {"w": torch.randn(3, 1, generator=g, dtype=F64)}
    v = {"w": torch.randn(3, 1, generator=g, dtype=F64)}

    def f(p):
        return loss(torch.tanh(x @ p["w"]), y)

    return f, params, v


# --------------------------------------------------------------------------- the default


def test_default_hvp_method_is_the_documented_one_and_exact_on_a_batch_norm_conv_net():
    """Double backward, for hvp and every tool with a method default; exact through a conv
    net with nn.BatchNorm2d and cross-entropy (float64, against the dense Hessian)."""
    assert DEFAULT_HVP_METHOD == "double-backward"
    assert f'``"{DEFAULT_HVP_METHOD}"`` (default' in hvp.__doc__
    from metalearn.algorithms.imaml import IMAML, implicit_meta_gradient

    defaults = {
        hvp: "method",
        top_eigenvalues: "hvp_method",
        hessian_trace: "hvp_method",
        implicit_meta_gradient: "hvp_method",
        IMAML.__init__: "hvp_method",
    }
    for fn, name in defaults.items():
        assert inspect.signature(fn).parameters[name].default == DEFAULT_HVP_METHOD, fn
    f, params = make_problem("conv_bn")
    v = random_tree(params, seed=14)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback, no warning of any kind
        out = hvp(f, params, v)
    assert_same_structure(out, params)
    expected = dense_hessian("conv_bn") @ flatten_tree(v)
    assert rel_err(flatten_tree(out), expected) < 1e-10


@pytest.mark.parametrize("method", HVP_METHODS)
@pytest.mark.parametrize("name", ["mlp", "conv_hand_bn"])
def test_hvp_under_vmap_equals_dense_hessian_times_each_direction(name, method):
    # Inside vmap autograd cannot make leaves, so double backward runs through torch.func
    f, params = make_problem(name)
    V = torch.randn(3, dense_hessian(name).shape[0], generator=gen(15), dtype=F64)
    out = torch.func.vmap(
        lambda u: flatten_tree(hvp(f, params, unflatten_like(u, params), method=method))
    )(V)
    torch.testing.assert_close(out, V @ dense_hessian(name), rtol=1e-10, atol=1e-12)


def test_double_backward_under_torch_func_grad_matches_the_dense_third_derivative():
    # grad of <H(z) v, u> with z a torch.func.grad input: double backward cannot make z a
    # leaf there and runs as reverse-over-reverse; closed form as in the create_graph tests
    f_flat, third = _cubic_quartic(5, seed=16)
    z, v, u = (torch.randn(5, generator=gen(17 + i), dtype=F64) for i in range(3))

    def phi(x):
        return hvp(f_flat, x, v, method="double-backward", create_graph=True) @ u

    assert rel_err(torch.func.grad(phi)(z), third(z, v, u)) < 1e-12
