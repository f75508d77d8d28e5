"""metalearn: exact, fast meta-learning on torch.func.

The second-order core (`metalearn.second_order`) is re-exported here::

    from metalearn import hvp, hessian, conjugate_gradient, top_eigenvalues, hessian_trace

and `tune_malloc` (`metalearn.allocator`), which makes glibc keep freed memory for reuse.
"""

from metalearn.allocator import MallocTuning, tune_malloc
from metalearn.autograd import (
    clip_grad,
    safe_cross_entropy,
    safe_log,
    safe_log_softmax,
    safe_sigmoid,
)
from metalearn.debug import anomaly_guard, check_consistent, check_function
from metalearn.second_order import (
    HVP_METHODS,
    CGResult,
    EigenResult,
    TraceEstimate,
    conjugate_gradient,
    hessian,
    hessian_trace,
    hvp,
    hvp_double_backward,
    top_eigenvalues,
)

__version__ = "0.1.0"

__all__ = [
    "HVP_METHODS",
    "CGResult",
    "EigenResult",
    "TraceEstimate",
    "conjugate_gradient",
    "hessian",
    "hessian_trace",
    "hvp",
    "hvp_double_backward",
    "top_eigenvalues",
    "clip_grad",
    "safe_cross_entropy",
    "safe_log",
    "safe_log_softmax",
    "safe_sigmoid",
    "anomaly_guard",
    "check_consistent",
    "check_function",
    "MallocTuning",
    "tune_malloc",
]
