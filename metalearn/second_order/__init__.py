"""Hessian-vector products and the curvature tools built on them.

Every function here takes ``f(params) -> scalar`` with ``params`` a tree of tensors (a dict
from ``model.named_parameters()``, a tuple, or a single tensor) and never materialises the
Hessian except `hessian`, which exists as the dense reference for small problems.

One concept per module, and data flows one way, from the products to their users:

* `metalearn.second_order.hessian_vector`: `hvp` (three exact methods, double backward by
  default, see `DEFAULT_HVP_METHOD`) and `hvp_double_backward` for ordinary training code;
* `metalearn.second_order.dense_hessian`: `hessian`, the O(n^2) reference;
* `metalearn.second_order.solve`: `conjugate_gradient` (iMAML's linear solve);
* `metalearn.second_order.eigen`: `top_eigenvalues` (Lanczos, power iteration);
* `metalearn.second_order.trace`: `hessian_trace` (Hutchinson).

`eigen` and `trace` call `hvp`; `hessian_vector` calls none of them.
"""

from metalearn.second_order.dense_hessian import hessian
from metalearn.second_order.eigen import EigenResult, top_eigenvalues
from metalearn.second_order.hessian_vector import (
    DEFAULT_HVP_METHOD,
    HVP_METHODS,
    HVPMethod,
    hvp,
    hvp_double_backward,
)
from metalearn.second_order.solve import (
    NEGATIVE_CURVATURE_POLICIES,
    CGResult,
    NegativeCurvature,
    check_negative_curvature,
    conjugate_gradient,
)
from metalearn.second_order.trace import TraceEstimate, hessian_trace

__all__ = [
    "DEFAULT_HVP_METHOD",
    "HVP_METHODS",
    "NEGATIVE_CURVATURE_POLICIES",
    "CGResult",
    "EigenResult",
    "HVPMethod",
    "NegativeCurvature",
    "TraceEstimate",
    "check_negative_curvature",
    "conjugate_gradient",
    "hessian",
    "hessian_trace",
    "hvp",
    "hvp_double_backward",
    "top_eigenvalues",
]
