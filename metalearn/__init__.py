"""metalearn: exact, fast meta-learning on torch.func.

The second-order core (`metalearn.second_order`) is re-exported here::

    from metalearn import hvp, hessian, conjugate_gradient, top_eigenvalues, hessian_trace

and `tune_malloc` (`metalearn.allocator`), which makes glibc keep freed memory for reuse.

The re-exports are imported on first use (PEP 562), not with the package: ``import
metalearn.tools.compare`` then costs no torch import, so a command's ``--help`` answers at
once.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_HOMES = {
    "metalearn.second_order": (
        "HVP_METHODS", "CGResult", "EigenResult", "TraceEstimate", "conjugate_gradient",
        "hessian", "hessian_trace", "hvp", "hvp_double_backward", "top_eigenvalues",
    ),
    "metalearn.autograd": (
        "clip_grad", "safe_cross_entropy", "safe_log", "safe_log_softmax", "safe_sigmoid",
    ),
    "metalearn.debug": ("anomaly_guard", "check_consistent", "check_function"),
    "metalearn.allocator": ("MallocTuning", "tune_malloc"),
}  # fmt: skip
_HOME = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [name for names in _HOMES.values() for name in names]


def __getattr__(name: str) -> Any:
    """A re-exported name, imported from its module on first use."""
    if name not in _HOME:
        raise AttributeError(f"module 'metalearn' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
