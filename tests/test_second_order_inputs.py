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


@pytest.mark.parametrize("bad", ["float64", "float16", "shape", "keys"])
def test_conjugate_gradient_checks_x0_against_b(bad):
    make, message = BAD_V[bad]
    b = params()
    with pytest.raises(ValueError, match=message.replace("^v", "^x0").replace("pass v", "pass x0")):
        conjugate_gradient(lambda x: x, b, x0=make(b))


def test_conjugate_gradient_refuses_an_integer_right_hand_side():
    with pytest.raises(ValueError, match=r"^b\['w'\] is torch.int64; "):
        conjugate_gradient(lambda x: x, {"w": torch.ones(2, dtype=torch.int64)})
