"""`metalearn.hvp` and `metalearn.hvp_double_backward` against slow, obvious references.

References: the dense Hessian built row by row with double backward, closed forms on
polynomials and central finite differences. Everything runs in float64 with fixed seeds and
fixed tolerances.
"""

from __future__ import annotations

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
    hessian,
    hessian_trace,
    hvp,
    hvp_double_backward,
    top_eigenvalues,
)
from tests.second_order.second_order_problems import (
    F64,
    PROBLEMS,
    assert_same_structure,
    dense_hessian,
    gen,
    make_problem,
    random_tree,
    rel_err,
)


@pytest.mark.parametrize("method", HVP_METHODS)
@pytest.mark.parametrize("name", list(PROBLEMS))
def test_hvp_equals_dense_hessian_times_v(name, method):
    f, params = make_problem(name)
    v = random_tree(params, seed=10)
    out = hvp(f, params, v, method=method)
    assert_same_structure(out, params)
    expected = dense_hessian(name) @ flatten_tree(v)
    assert rel_err(flatten_tree(out), expected) < 1e-10


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


@pytest.mark.parametrize("method", ["reverse-over-reverse", "forward-over-reverse"])
@pytest.mark.parametrize("name", ["mlp", "conv_hand_bn"])
def test_hvp_under_vmap_equals_dense_hessian_times_each_direction(name, method):
    f, params = make_problem(name)
    V = torch.randn(3, dense_hessian(name).shape[0], generator=gen(15), dtype=F64)
    out = torch.func.vmap(
        lambda u: flatten_tree(hvp(f, params, unflatten_like(u, params), method=method))
    )(V)
    torch.testing.assert_close(out, V @ dense_hessian(name), rtol=1e-10, atol=1e-12)


def test_double_backward_under_vmap_names_the_torch_func_method():
    # Inside vmap autograd cannot make leaves: the error says which method runs there.
    f, params = make_problem("mlp")
    V = torch.randn(3, dense_hessian("mlp").shape[0], generator=gen(15), dtype=F64)
    with pytest.raises(RuntimeError, match="pass method='reverse-over-reverse'"):
        torch.func.vmap(lambda u: flatten_tree(hvp(f, params, unflatten_like(u, params))))(V)


def test_hvp_under_torch_func_grad_equals_dense_hessian():
    # d/dv <H v, u> = H u, with v the input of torch.func.grad and params plain tensors:
    # inside the transform autograd cannot make params leaves, so double backward refuses
    # (naming the fix) and reverse-over-reverse gives the product.
    f, params = make_problem("mlp")
    v = flatten_tree(random_tree(params, seed=16))
    u = flatten_tree(random_tree(params, seed=17))

    def phi(w, method):
        hv = hvp(f, params, unflatten_like(w, params), method=method, create_graph=True)
        return flatten_tree(hv) @ u

    expected = dense_hessian("mlp") @ u
    assert rel_err(torch.func.grad(phi)(v, "reverse-over-reverse"), expected) < 1e-10
    with pytest.raises(RuntimeError, match="pass method='reverse-over-reverse'"):
        torch.func.grad(phi)(v, "double-backward")
