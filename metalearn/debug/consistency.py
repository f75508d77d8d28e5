"""`check_consistent`: tensors of models, batches and dicts on one device and one dtype.

A mismatch raises with every offending tensor named by where it sits (``model.head.weight``,
``batch[0]``, ``params['head.bias']``) and how to move or convert it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["check_consistent"]


def check_consistent(
    *items: Any,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    **named: Any,
) -> tuple[torch.device, torch.dtype | None]:
    """Check that tensors share one device and floating-point tensors one dtype.

    Items may be tensors, modules (their parameters and buffers), dicts, lists and tuples
    of those, nested; other values are ignored. Tensors are named by where they sit:
    ``model.head.weight``, ``batch[0]``, ``params['head.bias']``; positional items are
    ``arg0``, ``arg1``..., keyword items take their keyword. Integer and bool tensors (labels,
    masks) count for the device but not the dtype.

    Args:
        *items: what to check, e.g. ``check_consistent(model=model, batch=(x, y))``.
        device: the expected device; None: the device most tensors are on.
        dtype: the expected floating dtype; None: the one most floating tensors have.
        **named: items under their own names.

    Returns:
        ``(device, dtype)`` shared by all (dtype None when no tensor is floating-point).

    Raises:
        ValueError: a tensor on another device; every such tensor is named.
        TypeError: a floating tensor of another dtype; every such tensor is named.
    """
    tensors = [t for i, item in enumerate(items) for t in _named_tensors(f"arg{i}", item)]
    tensors += [t for key, item in named.items() for t in _named_tensors(key, item)]
    if not tensors:
        raise ValueError("check_consistent found no tensors in its arguments; pass tensors, "
                         "modules, or dicts/lists/tuples of them")  # fmt: skip
    found_device = _expect([t.device for _, t in tensors], device and torch.device(device))
    bad = [(n, t.device) for n, t in tensors if not _same_device(t.device, found_device)]
    if bad:
        raise ValueError(
            _mismatch_message("devices", found_device, len(tensors), bad, device is not None)
            + f"; move them with .to({str(found_device)!r}) (a module: module.to(...))"
        )
    floats = [(n, t) for n, t in tensors if t.is_floating_point()]
    if not floats:
        return found_device, None
    found_dtype = _expect([t.dtype for _, t in floats], dtype)
    bad = [(n, t.dtype) for n, t in floats if t.dtype != found_dtype]
    if bad:
        raise TypeError(
            _mismatch_message("floating dtypes", found_dtype, len(floats), bad, dtype is not None)
            + f"; convert them with .to({found_dtype}) (a module: module.to({found_dtype}))"
        )
    return found_device, found_dtype


def _named_tensors(name: str, item: Any) -> Iterator[tuple[str, Tensor]]:
    if isinstance(item, Tensor):
        yield name, item
    elif isinstance(item, nn.Module):
        for key, t in (*item.named_parameters(), *item.named_buffers()):
            yield f"{name}.{key}", t
    elif isinstance(item, Mapping):
        for key, value in item.items():
            yield from _named_tensors(f"{name}[{key!r}]", value)
    elif isinstance(item, (list, tuple)):
        for i, value in enumerate(item):
            yield from _named_tensors(f"{name}[{i}]", value)


def _expect(values: list[Any], given: Any) -> Any:
    """``given`` if set, else the most common value (the first seen on a tie)."""
    if given is not None:
        return given
    counts = Counter(values)
    top = max(counts.values())
    return next(v for v in values if counts[v] == top)


def _same_device(actual: torch.device, expected: torch.device) -> bool:
    if expected.index is None:  # "cuda" matches any cuda:N
        return actual.type == expected.type
    return actual == expected


def _mismatch_message(what: str, expected: Any, total: int, bad: list, given: bool) -> str:
    why = "as asked" if given else f"held by {total - len(bad)} of {total} tensors"
    shown = ", ".join(f"{n} is {v}" for n, v in bad[:6])
    more = f" and {len(bad) - 6} more" if len(bad) > 6 else ""
    return f"tensors of different {what}: expected {expected} ({why}), but {shown}{more}"
