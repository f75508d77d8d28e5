"""Debugging tools: check a custom autograd Function, tensors' devices/dtypes, find NaNs.

* `check_function` runs ``gradcheck`` and ``gradgradcheck`` on a function (typically a
  custom ``torch.autograd.Function``'s ``apply``) in float64, then checks it under the
  ``torch.func`` transforms (``vjp``, ``vmap``, ``jvp``) against eager autograd, loops and
  finite differences. A failure raises `FunctionCheckError` saying which check failed,
  where (output, input, element) and by how much.
* `check_consistent` checks that the tensors of models, batches and dicts share one device
  and one floating dtype, and names every tensor that does not.
* `anomaly_guard` is a context manager that checks the output of every aten op, forward and
  backward, and raises `NonFiniteError` at the first NaN or infinity, naming the op (and in
  backward the autograd node and the forward line that made it) and the user code that ran
  it. Unlike ``torch.autograd.detect_anomaly`` it also checks the forward pass, and works
  under ``torch.func`` transforms (inside ``vmap``/``grad`` it sees the unbatched ops).
  Overhead on a Conv4 MAML meta-step (CPU time; command and commit in ``docs/deploy.md``):
  1.33x (vmapped tasks) to 2.0x (looped tasks) plain, 1.8x-3.9x with ``backward_origin``.
"""

from metalearn.debug.anomaly import NonFiniteError, anomaly_guard
from metalearn.debug.consistency import check_consistent
from metalearn.debug.functions import FunctionCheck, FunctionCheckError, check_function

__all__ = [
    "FunctionCheck",
    "FunctionCheckError",
    "NonFiniteError",
    "anomaly_guard",
    "check_consistent",
    "check_function",
]
