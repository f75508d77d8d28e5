"""One input check for every curvature tool: ``v`` (and CG's ``x0``) against the parameters'
structure, shape, dtype and device, and the parameters themselves, with one message each
whichever HVP method runs; a well-formed input still gives the dense Hessian's product."""

from __future__ import annotations

import pytest
import torch

from metalearn.second_order import (
    HVP_METHODS,
    conjugate_gradient,
    hessian,
    hessian_trace,
    hvp,
    hvp_double_backward,
    top_eigenvalues,
)

F32 = torch.float32


def params(dtype: torch.dtype = F32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 2, generator=g).to(dtype),
        "b": torch.randn(2, generator=g).to(dtype),
    }


def f(p: dict[str, torch.Tensor]) -> torch.Tensor:
    return (p["w"].sin() ** 2).sum() + (p["w"].sum(0) * p["b"]).pow(2).sum()


BAD_V = {
    "float64": (lambda p: {k: v.double() for k, v in p.items()},
                r"^v\['w'\] is torch.float64 on cpu but the parameter is torch.float32 on cpu; "
                r"pass v with the parameters' dtypes and devices"),
    "float16": (lambda p: {k: v.half() for k, v in p.items()}, r"^v\['w'\] is torch.float16"),
    "int64": (lambda p: {k: torch.ones_like(v, dtype=torch.int64) for k, v in p.items()},
              r"^v\['w'\] is torch.int64"),
    "meta device": (lambda p: {"w": p["w"], "b": p["b"].to("meta")},
                    r"^v\['b'\] is torch.float32 on meta but the parameter is torch.float32 "
                    r"on cpu"),
    "shape": (lambda p: {"w": p["w"].T, "b": p["b"]}, r"^v's tensor 0 has shape \(2, 3\)"),
    "keys": (lambda p: {"b": p["b"], "w": p["w"]}, r"^v's keys \['b', 'w'\] differ"),
    "count": (lambda p: {"w": p["w"]}, r"^v has 1 tensors but params has 2"),
}  # fmt: skip


@pytest.mark.parametrize("method", HVP_METHODS)
@pytest.mark.parametrize("bad", list(BAD_V))
def test_hvp_refuses_a_mismatched_v_with_one_message_for_every_method(method, bad):
    make, message = BAD_V[bad]
    p = params()
    with pytest.raises(ValueError, match=message):
        hvp(f, p, make(p), method=method)


@pytest.mark.parametrize("bad", ["float64", "float16", "int64", "shape"])
def test_hvp_double_backward_refuses_the_same_way(bad):
    make, message = BAD_V[bad]
    p = {k: v.requires_grad_() for k, v in params().items()}
    loss = f(p)
    with pytest.raises(ValueError, match=message.replace(r"v\['w'\]", r"v\[0\]")
                       .replace(r"v's keys", "")):  # fmt: skip
        hvp_double_backward(loss, list(p.values()), list(make(p).values()))


def test_a_flat_v_of_another_dtype_is_refused_by_hvp_double_backward():
    p = {k: v.requires_grad_() for k, v in params().items()}
    with pytest.raises(ValueError, match=r"^v\[0\] is torch.float64 on cpu but the parameter"):
        hvp_double_backward(f(p), list(p.values()), torch.ones(8, dtype=torch.float64))


@pytest.mark.parametrize("method", HVP_METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_matching_v_gives_the_dense_hessians_product(method, dtype):
    p = params(dtype)
    v = {k: torch.linspace(-1, 1, t.numel(), dtype=dtype).view_as(t) for k, t in p.items()}
    H = hessian(f, p)
    flat_v = torch.cat([t.flatten() for t in v.values()])
    got = torch.cat([t.flatten() for t in hvp(f, p, v, method=method).values()])
    assert got.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, H @ flat_v, rtol=tol, atol=tol)


BAD_PARAMS = {
    "integer": ({"w": torch.ones(3, 2, dtype=torch.int64)}, r"^params\['w'\] is torch.int64; "),
    "mixed dtype": ({"w": torch.ones(3, 2), "b": torch.ones(2, dtype=torch.float64)},
                    r"^params\['b'\] is torch.float64 on cpu but the first tensor of params is "
                    r"torch.float32 on cpu"),
    "empty": ({}, r"^params holds no tensor"),
}  # fmt: skip


@pytest.mark.parametrize("bad", list(BAD_PARAMS))
@pytest.mark.parametrize("tool", ["hessian", "top_eigenvalues"])
def test_flattening_tools_refuse_params_they_cannot_flatten(tool, bad):
    p, message = BAD_PARAMS[bad]
    run = {"hessian": lambda: hessian(lambda q: sum(t.sum() for t in q.values()), p),
           "top_eigenvalues": lambda: top_eigenvalues(lambda q: sum(t.sum() for t in q.values()),
                                                      p)}  # fmt: skip
    with pytest.raises(ValueError, match=message):
        run[tool]()


def test_hessian_trace_refuses_integer_params():
    with pytest.raises(ValueError, match=r"^params\['w'\] is torch.int64; "):
        hessian_trace(lambda q: q["w"].sum(), {"w": torch.ones(2, dtype=torch.int64)})


@pytest.mark.parametrize("hvp_method", HVP_METHODS)
def test_hessian_trace_refuses_mixed_dtypes_naming_them(hvp_method):
    # f mixes them as a model with one float64 layer would: torch would fail inside the product
    p = {"w": torch.ones(3, 2), "b": torch.ones(2, dtype=torch.float64)}
    with pytest.raises(ValueError, match=BAD_PARAMS["mixed dtype"][1] + r"; .*\(e\.g\. \.double"):
        hessian_trace(lambda q: (q["w"] @ q["b"]).pow(2).sum(), p, hvp_method=hvp_method)
    # in one dtype the estimate agrees with the dense Hessian's trace
    q = {k: t.double() for k, t in p.items()}
    exact = float(torch.trace(hessian(lambda r: (r["w"] @ r["b"]).pow(2).sum(), q)))
    got = hessian_trace(
        lambda r: (r["w"] @ r["b"]).pow(2).sum(),
        q,
        samples=400,
        generator=torch.Generator().manual_seed(0),
    )
    assert abs(got.estimate - exact) < 4 * got.std_error + 1e-12


@pytest.mark.parametrize("bad", ["float64", "float16", "shape", "keys"])
def test_conjugate_gradient_checks_x0_against_b(bad):
    make, message = BAD_V[bad]
    b = params()
    with pytest.raises(ValueError, match=message.replace("^v", "^x0").replace("pass v", "pass x0")):
        conjugate_gradient(lambda x: x, b, x0=make(b))


def test_conjugate_gradient_refuses_an_integer_right_hand_side():
    with pytest.raises(ValueError, match=r"^b\['w'\] is torch.int64; "):
        conjugate_gradient(lambda x: x, {"w": torch.ones(2, dtype=torch.int64)})


# --------------------------------------------------------------------------- running statistics
# A train-mode batch norm that tracks running statistics writes its buffers on every call of f:
# every tool refuses it (before the layer runs), and both fixes the message names give the
# dense Hessian of their own loss, written out by hand.

BN_REFUSAL = (
    r"^f\(params\) calls BatchNorm2d\(3\) in training mode with running statistics, which would "
    r"update its buffers on every call .*call model\.eval\(\) .*"
    r"torch\.func\.replace_all_batch_norm_modules_\(model\)"
)


def bn_problem():
    g = torch.Generator().manual_seed(3)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3),
        torch.nn.BatchNorm2d(3),
        torch.nn.Tanh(),
        torch.nn.Flatten(),
        torch.nn.Linear(27, 2),
    ).double()
    with torch.no_grad():  # running statistics away from their (0, 1) start, so eval differs
        net[1].running_mean.copy_(torch.randn(3, generator=g, dtype=torch.float64))
        net[1].running_var.copy_(torch.rand(3, generator=g, dtype=torch.float64) + 0.5)
    p = {k: torch.randn(t.shape, generator=g, dtype=torch.float64) for k, t in
         net.named_parameters()}  # fmt: skip
    x = torch.randn(4, 2, 5, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 2, (4,), generator=g)

    def f(q):
        return torch.nn.functional.cross_entropy(torch.func.functional_call(net, q, (x,)), y)

    def by_hand(q, mean=None, var=None):
        # the same loss with the normalisation written out: batch statistics, or given ones
        h = torch.nn.functional.conv2d(x, q["0.weight"], q["0.bias"])
        if mean is None:
            mean = h.mean(dim=(0, 2, 3))
            var = h.var(dim=(0, 2, 3), unbiased=False)
        h = (h - mean.view(1, -1, 1, 1)) / torch.sqrt(var.view(1, -1, 1, 1) + 1e-5)
        h = torch.tanh(h * q["1.weight"].view(1, -1, 1, 1) + q["1.bias"].view(1, -1, 1, 1))
        out = h.flatten(1) @ q["4.weight"].T + q["4.bias"]
        return torch.nn.functional.cross_entropy(out, y)

    return net, f, by_hand, p


def buffers(net):
    return {k: t.clone() for k, t in net.named_buffers()}


TOOLS = {
    **{f"hvp {m}": (lambda f, p, m=m: hvp(f, p, p, method=m)) for m in HVP_METHODS},
    "hessian rows": lambda f, p: hessian(f, p),
    "hessian vmap": lambda f, p: hessian(f, p, method="vmap"),
    "hessian_trace": lambda f, p: hessian_trace(f, p, samples=2),
    "top_eigenvalues": lambda f, p: top_eigenvalues(f, p, max_iter=3),
}


@pytest.mark.parametrize("tool", list(TOOLS))
def test_f_batch_norm_called_with_running_statistics_is_refused_untouched(tool):
    """No norm module: ``f`` calls F.batch_norm on buffers of its own, in training mode. The
    refusal reads the call itself (`metalearn.normalisation.watching_normalisation`)."""
    g = torch.Generator().manual_seed(4)
    mean, var = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    x = torch.randn(5, 3, generator=g, dtype=torch.float64)
    p = {"w": torch.randn(3, 3, generator=g, dtype=torch.float64),
         "gamma": torch.rand(3, generator=g, dtype=torch.float64) + 0.5}  # fmt: skip

    def f(q):
        h = torch.nn.functional.batch_norm(x @ q["w"], mean, var, q["gamma"], training=True)
        return (h.tanh() ** 2).sum()

    with pytest.raises(ValueError, match=r"^f\(params\) calls torch\.nn\.functional\.batch_norm "
                       r"in training mode with running statistics.*model\.eval\(\)"):  # fmt: skip
        TOOLS[tool](f, p)
    assert torch.equal(mean, torch.zeros(3, dtype=torch.float64))
    assert torch.equal(var, torch.ones(3, dtype=torch.float64))


@pytest.mark.parametrize("tool", list(TOOLS))
def test_a_train_mode_batch_norm_with_running_statistics_is_refused_untouched(tool):
    net, f, _, p = bn_problem()
    before = buffers(net)
    with pytest.raises(ValueError, match=BN_REFUSAL):
        TOOLS[tool](f, p)
    after = buffers(net)
    assert list(after) == list(before)
    for name in before:
        assert torch.equal(after[name], before[name]), name
    # the check lives only inside the call: the module trains as before afterwards
    torch.func.functional_call(net, p, (torch.ones(2, 2, 5, 5, dtype=torch.float64),))
    assert int(net[1].num_batches_tracked) == int(before["1.num_batches_tracked"]) + 1


@pytest.mark.parametrize("method", HVP_METHODS)
def test_the_named_fixes_give_the_dense_hessian_of_their_loss(method):
    net, f, by_hand, p = bn_problem()
    v = {k: torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view_as(t) for k, t in p.items()}
    flat_v = torch.cat([t.flatten() for t in v.values()])

    def product(fn):
        return torch.cat([t.flatten() for t in hvp(fn, p, v, method=method).values()])

    net.eval()  # fix 1: the running statistics, untouched
    before = buffers(net)
    mean, var = net[1].running_mean.clone(), net[1].running_var.clone()
    H = hessian(lambda q: by_hand(q, mean, var), p)
    torch.testing.assert_close(product(f), H @ flat_v, rtol=1e-10, atol=1e-12)
    assert all(torch.equal(buffers(net)[k], t) for k, t in before.items())

    net.train()  # fix 2: the train-mode loss itself (batch statistics), nothing tracked
    torch.func.replace_all_batch_norm_modules_(net)
    H = hessian(by_hand, p)
    assert H.abs().max() > 1e-3
    torch.testing.assert_close(product(f), H @ flat_v, rtol=1e-10, atol=1e-12)
