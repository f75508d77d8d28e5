"""`metalearn.hessian_trace` (Hutchinson) against the trace of the dense Hessian."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from metalearn.second_order import HVP_METHODS, hessian_trace
from tests.second_order.second_order_problems import F64, dense_hessian, gen, make_problem


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
