"""The one refusal every second-order tool makes about ``f``'s side effects: a normalisation
layer in training mode that tracks running statistics.

Such a layer (``nn.BatchNorm*``, ``nn.InstanceNorm*(track_running_stats=True)``) writes its
``running_mean``, ``running_var`` and ``num_batches_tracked`` buffers in place on every call
of ``f``. Double backward would silently advance them once per Hessian-vector product, and
``torch.func`` cannot differentiate a function that writes a tensor it did not receive as an
input, so the three `hvp` methods would disagree (one side effect, two raw torch errors).
Every tool therefore refuses, before the layer runs (so no buffer is written), in one line
naming the two fixes: ``model.eval()`` (normalise with the running statistics) or
``torch.func.replace_all_batch_norm_modules_(model)`` (normalise with the batch's statistics
and track none, the same function as training mode without the side effect).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _NormBase
from torch.nn.modules.module import register_module_forward_pre_hook

__all__ = ["refuse_running_stat_updates"]


@contextmanager
def refuse_running_stat_updates(where: str) -> Iterator[None]:
    """Inside the block, calling a training-mode norm layer that tracks running statistics
    raises a one-line `ValueError` before the layer writes any buffer.

    The check is a module forward pre-hook registered for the block only (removed on exit,
    whatever happens), so it sees every such layer ``f`` reaches, including through
    ``torch.func.functional_call``. It is process-wide while the block runs.

    Args:
        where: how the message names the function being differentiated, e.g. ``"f(params)"``.
    """

    def check(module: nn.Module, args: Any) -> None:
        if isinstance(module, _NormBase) and module.training and module.track_running_stats:
            name = f"{type(module).__name__}({module.num_features})"
            raise ValueError(
                f"{where} runs {name} in training mode with running statistics, which would "
                "update its buffers on every call and cannot be differentiated by torch.func; "
                "call model.eval() to normalise with the running statistics, or "
                "torch.func.replace_all_batch_norm_modules_(model) to normalise with the "
                "batch's statistics without tracking them"
            )

    handle = register_module_forward_pre_hook(check)
    try:
        yield
    finally:
        handle.remove()
