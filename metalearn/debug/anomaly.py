"""`anomaly_guard`: raise `NonFiniteError` at the first op that makes a NaN or infinity.

A ``TorchDispatchMode`` checks the floating outputs of every aten op, forward and backward,
also under ``torch.func`` transforms (inside ``vmap``/``grad`` it sees the unbatched ops), and
names the op, the autograd node and forward line (in backward) and the user code that ran it.
Overhead on a Conv4 MAML meta-step (CPU time; command and commit in ``docs/deploy.md``): 1.33x
(vmapped tasks) to 2.0x (looped tasks) plain, 1.8x-3.9x with ``backward_origin``.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["NonFiniteError", "anomaly_guard"]


class NonFiniteError(FloatingPointError):
    """An op made (or received) the first NaN/infinity inside `anomaly_guard`.

    Attributes:
        op: the aten op, e.g. ``"aten.log.default"``.
        phase: ``"forward"`` or ``"backward"``.
        node: in backward, the autograd node being run (e.g. ``"SqrtBackward0"``), else None.
    """

    def __init__(self, message: str, op: str, phase: str, node: str | None) -> None:
        super().__init__(message)
        self.op, self.phase, self.node = op, phase, node


# Ops whose output is uninitialised memory: NaNs there are not a bug.
_UNINITIALISED = {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
                  "new_empty_strided", "resize_"}  # fmt: skip
# Ops that write a given value: a NaN/inf they make was asked for (a placeholder, a mask).
_FILLS = {"full", "full_like", "new_full", "fill", "fill_", "scalar_tensor", "masked_fill",
          "masked_fill_", "index_fill", "index_fill_", "lift_fresh", "lift_fresh_copy"}  # fmt: skip
# Frames in these files are the guard's and torch's own: errors name the user code around them.
_HERE = str(Path(__file__).resolve())
_TORCH = str(Path(torch.__file__).resolve().parent)


class _FiniteMode(TorchDispatchMode):
    """Checks every op's floating outputs; tracks the non-finite values written on purpose."""

    def __init__(self, nan_only: bool) -> None:
        super().__init__()
        self.nan_only = nan_only
        self.intended = WeakIdKeyDictionary()  # tensors whose NaN/inf were asked for

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        outs = [t for t in tree_flatten(out)[0] if self._checked(t)]
        if all(self._clean(t) for t in outs) or name in _UNINITIALISED:
            return out  # the fast path: one reduction per output
        bad_outs = [(o, t) for o, t in enumerate(outs) if self._kinds(t)]
        if name in _FILLS:
            self._mark(outs)
            return out
        inputs = [a for a in tree_flatten((args, kwargs))[0] if self._checked(a)]
        bad_ins = [(i, a) for i, a in enumerate(inputs) if self._kinds(a)]
        if bad_ins and all(a in self.intended for _, a in bad_ins):
            # Propagating an intended value is fine; making a new kind (inf * 0 = NaN) is not.
            carried = set().union(*(self._kinds(a) for _, a in bad_ins))
            if all(self._kinds(t) <= carried for _, t in bad_outs):
                self._mark(outs)
                return out
            bad_ins = []
        o, t = bad_outs[0]
        raise _non_finite_error(str(func), o, t, [i for i, a in bad_ins if a not in self.intended])

    def _checked(self, t: Any) -> bool:
        return isinstance(t, Tensor) and t.is_floating_point() and t.device.type != "meta"

    def _clean(self, t: Tensor) -> bool:
        # A sum is finite only if every term is (NaN and +-inf propagate; inf - inf is NaN),
        # and one read-only pass is cheap: a guarded Conv4 meta-step cost 3.7x a plain one
        # with isfinite(t).all() here, 1.33x with the sum (docs/deploy.md).
        # A sum that overflows from finite terms alone goes on to the exact check.
        if bool(t.sum().isfinite()):
            return True
        return not self._kinds(t)

    def _kinds(self, t: Tensor) -> set[str]:
        """Which of "nan", "inf" ``t`` holds (only "nan" is looked for with check="nan")."""
        kinds = {"nan"} if t.isnan().any() else set()
        if not self.nan_only and t.isinf().any():
            kinds.add("inf")
        return kinds

    def _mark(self, tensors: list[Tensor]) -> None:
        for t in tensors:
            self.intended[t] = True


def _non_finite_error(op: str, o: int, t: Tensor, inputs: list[int]) -> NonFiniteError:
    node = torch._C._current_autograd_node()
    phase = "forward" if node is None else "backward"
    nans, infs = int(t.isnan().sum()), int(t.isinf().sum())
    where = f"in forward at {_user_frame()}"
    if node is not None:
        made = node.metadata.get("traceback_")
        origin = f", created in forward at {_last_frame(made)}" if made else ""
        where = f"in backward of {node.name()}{origin} (backward called at {_user_frame()})"
    if inputs:
        cause = (
            f"its input {inputs[0]} was already non-finite, so the value came from outside "
            "the guard: check the data, the parameters and the loss scale"
        )
    else:
        cause = (
            "its inputs were finite, so this op made the first non-finite value: check its "
            "inputs' range (log or sqrt of <= 0, 0/0, exp overflow) or use "
            "metalearn.autograd's safe_log / safe_sigmoid / safe_cross_entropy"
        )
    message = (
        f"{op} produced {nans} NaN and {infs} infinite values among {t.numel()} "
        f"(output {o}, shape {tuple(t.shape)}, {t.dtype}) {where}; {cause}"
    )
    return NonFiniteError(message, op, phase, None if node is None else node.name())


def _user_frame() -> str:
    """The innermost stack frame outside torch and this module, as ``file:line in fn: code``."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename != _HERE and not frame.filename.startswith(_TORCH):
            return f"{frame.filename}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return "<unknown>"


def _last_frame(formatted: list[str]) -> str:
    """The innermost user frame of a traceback recorded by anomaly mode."""
    for entry in reversed(formatted):
        if _TORCH not in entry and _HERE not in entry:
            return " ".join(part.strip() for part in entry.strip().splitlines())
    return formatted[-1].strip()


@contextmanager
def anomaly_guard(
    *, check: Literal["nonfinite", "nan"] = "nonfinite", backward_origin: bool = True
) -> Iterator[None]:
    """Raise `NonFiniteError` at the first op whose output holds a NaN (or an infinity).

    Every aten op run inside the block, forward and backward (``loss.backward()`` or
    ``torch.autograd.grad`` called inside it), and inside ``torch.func`` transforms, has its
    floating-point outputs checked. The error names the op (``aten.log.default``), its
    output's shape and counts, the user code that ran it, and in backward the autograd
    node (``SqrtBackward0``) and, with ``backward_origin``, the forward line that made it.
    Results are unchanged when nothing is non-finite. Values written on purpose are not
    reported: a NaN or inf made by a fill (``torch.full(..., nan)``, ``masked_fill(mask,
    -inf)``, ``torch.tensor([nan])``) and what ops carry over from it unchanged in kind (a
    NaN placeholder stacked with losses); a new kind made from it (``-inf`` logits whose
    softmax is NaN) is reported.

    Example::

        with anomaly_guard():
            loss = model(x).log().mean()
            loss.backward()

    Args:
        check: ``"nonfinite"`` (NaN and +-inf) or ``"nan"`` (NaN only: for code that uses
            ``-inf`` on purpose, e.g. attention masks).
        backward_origin: record where each autograd node was created (turns on
            ``torch.autograd`` anomaly mode without its NaN check), so a backward error
            names the forward line; costs more (see ``docs/deploy.md``).

    Raises:
        NonFiniteError: from the first op whose output is not finite.
    """
    if check not in ("nonfinite", "nan"):
        raise ValueError(f"check={check!r}; choose 'nonfinite' (NaN and inf) or 'nan'")
    # Anomaly mode is only switched on, never off: a caller may have it on already.
    origin = torch.autograd.set_detect_anomaly(True, check_nan=False) if backward_origin else None
    with origin or nullcontext(), _FiniteMode(nan_only=check == "nan"):
        yield
