"""The one refusal every second-order tool makes about ``f``'s side effects: a normalisation
call in training mode that writes running statistics.

Such a call (``F.batch_norm(x, running_mean, running_var, training=True)``, as
``nn.BatchNorm*`` and ``nn.InstanceNorm*(track_running_stats=True)`` make it) writes its
running statistics in place on every call of ``f``. Double backward would silently advance
them once per Hessian-vector product, and ``torch.func`` cannot differentiate a function that
writes a tensor it did not receive as an input, so the three `hvp` methods would disagree
(one side effect, two raw torch errors). Every tool therefore refuses, before the call runs
(so no buffer is written), in one line naming the two fixes: ``model.eval()`` (normalise
with the running statistics) or ``torch.func.replace_all_batch_norm_modules_(model)``
(normalise with the batch's statistics and track none, the same function as training mode
without the side effect). The call is found by what ``f`` does
(`metalearn.normalisation.watching_normalisation`, `NormCall.updates_running_stats`), however
it is made. torch's own norm modules add one to ``num_batches_tracked`` in place before their
``F.batch_norm`` call, so for them alone a module pre-hook refuses first, on the same
condition (training mode and running statistics), so that no buffer is written.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.module import register_module_forward_pre_hook

from metalearn.normalisation import NormCall, watching_normalisation

__all__ = ["refuse_running_stat_updates"]


@contextmanager
def refuse_running_stat_updates(where: str) -> Iterator[None]:
    """Inside the block, a normalisation call that would write running statistics raises a
    one-line `ValueError` before it writes any buffer.

    The check is a ``TorchFunctionMode`` active for the block only (in this thread), so it
    sees every such call ``f`` makes, through modules, ``torch.func.functional_call`` or
    ``F.batch_norm`` called directly.

    Args:
        where: how the message names the function being differentiated, e.g. ``"f(params)"``.
    """

    def refuse(what: str) -> None:
        raise ValueError(
            f"{where} calls {what} in training mode with running statistics, which would "
            "update its buffers on every call and cannot be differentiated by torch.func; "
            "call model.eval() to normalise with the running statistics, or "
            "torch.func.replace_all_batch_norm_modules_(model) to normalise with the "
            "batch's statistics without tracking them"
        )

    def check(call: NormCall) -> None:
        if call.updates_running_stats:
            refuse(call.function)

    def before_counting(module: nn.Module, args: Any) -> None:
        # The module would write num_batches_tracked before its norm call reaches `check`.
        if isinstance(module, _NormBase) and module.training and module.track_running_stats:
            refuse(f"{type(module).__name__}({module.num_features})")

    handle = register_module_forward_pre_hook(before_counting)
    try:
        with watching_normalisation({}, check):
            yield
    finally:
        handle.remove()
