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
  Overhead on a Conv4 MAML meta-step (``scripts/bench_anomaly_guard.py``, CPU time):
  1.33x (vmapped tasks) to 2.0x (looped tasks) plain, 1.8x-3.9x with ``backward_origin``.
"""

from __future__ import annotations

import math
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

__all__ = [
    "FunctionCheck",
    "FunctionCheckError",
    "NonFiniteError",
    "anomaly_guard",
    "check_consistent",
    "check_function",
]


# --------------------------------------------------------------------------- check_function


class FunctionCheckError(AssertionError):
    """A function failed one of `check_function`'s checks (the message says which and how)."""


@dataclass
class FunctionCheck:
    """What `check_function` verified (it raises on the first failure instead)."""

    name: str
    """The function's name."""
    passed: list[str] = field(default_factory=list)
    """The checks run and passed, in order (e.g. ``["gradcheck", "gradgradcheck", ...]``)."""


def check_function(
    fn: Callable[..., Tensor | Sequence[Tensor]],
    *inputs: Any,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    gradgrad: bool = True,
    transforms: bool = True,
) -> FunctionCheck:
    """Check a differentiable function's derivatives, as the team requires of custom Functions.

    Floating-point tensor inputs are copied to float64 and differentiated; other inputs
    (integer tensors, numbers, ``dim`` arguments) are passed through unchanged. In order:

    1. ``gradcheck``: the backward equals central finite differences (step ``eps``).
    2. ``gradgradcheck`` (``gradgrad=True``): the backward is itself differentiable and its
       derivatives equal finite differences (needed for second-order MAML and HVPs).
    3. ``transforms=True``: ``torch.func.vjp`` equals eager autograd, ``vmap`` over a batch
       of three inputs equals a loop, ``vmap`` of the vjp equals a loop, and
       ``torch.func.jvp`` equals finite differences of the forward.

    Args:
        fn: ``fn(*inputs) -> Tensor`` or a tuple of tensors, e.g. ``MyFunction.apply``.
        *inputs: example inputs; keep them small (the dense Jacobians cost one backward per
            output element), and away from kinks (e.g. not at 0 for ``abs``).
        eps: finite-difference step (float64).
        atol: absolute tolerance of every comparison.
        rtol: relative tolerance of every comparison.
        gradgrad: run step 2.
        transforms: run step 3.

    Returns:
        A `FunctionCheck` listing the checks passed.

    Raises:
        FunctionCheckError: a check failed; the message names the check, the output and
            input, the worst element, both values, and what usually causes it.
        ValueError: no floating-point tensor among ``inputs`` (nothing to differentiate).
    """
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    if getattr(fn, "__name__", "") == "apply" and hasattr(fn, "__self__"):
        name = f"{fn.__self__.__name__}.apply"  # a Function's apply: name the Function
    args = [x.detach().double().requires_grad_() if _is_float(x) else x for x in inputs]
    diff = [i for i, x in enumerate(args) if _is_float(x)]
    if not diff:
        raise ValueError(
            f"check_function({name}) got no floating-point tensor among its {len(inputs)} "
            "inputs, so there is nothing to differentiate; pass the tensor arguments"
        )
    report = FunctionCheck(name)
    _check_gradcheck(fn, args, diff, name, eps, atol, rtol)
    report.passed.append("gradcheck")
    if gradgrad:
        _check_gradgradcheck(fn, args, diff, name, eps, atol, rtol)
        report.passed.append("gradgradcheck")
    if transforms:
        report.passed += _check_transforms(fn, args, diff, name, eps, atol, rtol)
    return report


def _is_float(x: Any) -> bool:
    return isinstance(x, Tensor) and x.is_floating_point()


def _outputs(value: Tensor | Sequence[Tensor]) -> tuple[Tensor, ...]:
    return (value,) if isinstance(value, Tensor) else tuple(value)


def _with(args: Sequence[Any], diff: Sequence[int], values: Sequence[Tensor]) -> list[Any]:
    """``args`` with the differentiable positions replaced by ``values``."""
    out = list(args)
    for i, v in zip(diff, values):
        out[i] = v
    return out


def _check_gradcheck(fn, args, diff, name, eps, atol, rtol) -> None:
    try:
        torch.autograd.gradcheck(fn, tuple(args), eps=eps, atol=atol, rtol=rtol)
        return
    except Exception as err:  # GradcheckError or an error raised by the backward itself
        cause = err
    wrapped = lambda *xs: fn(*_with(args, diff, xs))  # noqa: E731
    where = _worst_mismatch(wrapped, [args[i] for i in diff], diff, eps, atol, rtol, "backward",
                            lambda o: f"output {o}")  # fmt: skip
    raise FunctionCheckError(
        f"check_function({name}): gradcheck failed: {where or _first_line(cause)}. Fix the "
        "Function's backward (it must return d(output)/d(input) times grad_output for each "
        f"input, in the inputs' order). torch said: {_first_line(cause)}"
    ) from cause


def _check_gradgradcheck(fn, args, diff, name, eps, atol, rtol) -> None:
    try:
        torch.autograd.gradgradcheck(fn, tuple(args), eps=eps, atol=atol, rtol=rtol)
        return
    except Exception as err:
        cause = err
    outs = _outputs(fn(*args))
    gen = torch.Generator().manual_seed(0)
    cotangents = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]

    def vjp(*xs: Tensor) -> tuple[Tensor, ...]:
        out = _outputs(fn(*_with(args, diff, xs)))
        return torch.autograd.grad(out, xs, cotangents, create_graph=True, allow_unused=True)

    where = _worst_mismatch(vjp, [args[i] for i in diff], diff, eps, atol, rtol, "double backward",
                            lambda o: f"the gradient of input {diff[o]}")  # fmt: skip
    raise FunctionCheckError(
        f"check_function({name}): gradgradcheck failed: {where or _first_line(cause)}. The "
        "backward must be built from differentiable torch ops (no .detach(), torch.no_grad(),"
        " .item() or NumPy inside it), or its own derivative must be right. "
        f"torch said: {_first_line(cause)}"
    ) from cause


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def _worst_mismatch(fn, xs, positions, eps, atol, rtol, kind, out_name) -> str | None:
    """Dense analytical vs finite-difference Jacobians; the worst element, described."""
    try:
        analytical = _analytical_jacobians(fn, xs)
    except Exception as err:  # the backward itself failed
        return f"the {kind} raised {_first_line(err)}"
    numerical = _numerical_jacobians(fn, xs, eps)
    worst = None
    for (o, i), num in numerical.items():
        ana = analytical.get((o, i), torch.zeros_like(num))
        excess = (ana - num).abs() - (atol + rtol * num.abs())
        k = int(excess.argmax())
        if excess.flatten()[k] > 0 and (worst is None or excess.flatten()[k] > worst[0]):
            worst = (excess.flatten()[k].item(), o, i, k, ana.flatten()[k], num.flatten()[k])
    if worst is None:
        return None
    _, o, i, k, a, n = worst
    out_shape = tuple(_outputs(fn(*xs))[o].shape)
    row, col = divmod(k, max(xs[i].numel(), 1))
    out_at = _unravel(row, out_shape)
    in_at = _unravel(col, tuple(xs[i].shape))
    return (
        f"d({out_name(o)}){out_at} / d(input {positions[i]}){in_at} is {a.item():.6g} by the "
        f"{kind} but {n.item():.6g} by finite differences (eps={eps:g}; "
        f"|difference| {abs(a.item() - n.item()):.3g} > atol {atol:g} + rtol {rtol:g} * "
        f"|finite difference|)"
    )


def _unravel(index: int, shape: tuple[int, ...]) -> str:
    if not shape:
        return ""
    coords = []
    for size in reversed(shape):
        index, rem = divmod(index, size)
        coords.append(rem)
    return "[" + ", ".join(map(str, reversed(coords))) + "]"


def _analytical_jacobians(fn, xs) -> dict[tuple[int, int], Tensor]:
    """``{(output, input): [out_numel, in_numel]}`` by one backward per output element."""
    xs = [x.detach().requires_grad_() for x in xs]
    outs = _outputs(fn(*xs))
    jac = {}
    for o, out in enumerate(outs):
        rows = [[] for _ in xs]
        flat = out.reshape(-1)
        for j in range(flat.numel()):
            if out.requires_grad:
                grads = torch.autograd.grad(flat[j], xs, retain_graph=True, allow_unused=True)
            else:  # the output does not depend differentiably on anything: all zeros
                grads = [None] * len(xs)
            for i, (g, x) in enumerate(zip(grads, xs)):
                rows[i].append(
                    torch.zeros(x.numel(), dtype=x.dtype) if g is None else g.reshape(-1)
                )
        for i, x in enumerate(xs):
            jac[o, i] = torch.stack(rows[i]) if rows[i] else torch.zeros(0, x.numel())
    return jac


def _numerical_jacobians(fn, xs, eps) -> dict[tuple[int, int], Tensor]:
    """Central differences, ``{(output, input): [out_numel, in_numel]}``."""
    xs = [x.detach() for x in xs]
    cols: dict[tuple[int, int], list[Tensor]] = {}
    with torch.no_grad():
        for i, x in enumerate(xs):
            for k in range(x.numel()):
                step = torch.zeros_like(x).reshape(-1)
                step[k] = eps
                step = step.reshape(x.shape)
                plus = _outputs(_eval(fn, _replace(xs, i, x + step)))
                minus = _outputs(_eval(fn, _replace(xs, i, x - step)))
                for o, (p, m) in enumerate(zip(plus, minus)):
                    cols.setdefault((o, i), []).append(((p - m) / (2 * eps)).reshape(-1))
    return {key: torch.stack(c, dim=1) for key, c in cols.items()}


def _eval(fn, xs) -> tuple[Tensor, ...]:
    # The double-backward function needs grad mode to build its inner graph.
    with torch.enable_grad():
        xs = [x.requires_grad_() for x in xs]
        return tuple(o.detach() for o in _outputs(fn(*xs)))


def _replace(xs: list[Tensor], i: int, value: Tensor) -> list[Tensor]:
    return [value.clone() if j == i else x.clone() for j, x in enumerate(xs)]


def _check_transforms(fn, args, diff, name, eps, atol, rtol) -> list[str]:
    """vjp vs eager, vmap vs loop, vmap(vjp) vs loop, jvp vs finite differences."""
    from torch.func import jvp, vjp, vmap

    xs = [args[i].detach() for i in diff]

    def f(*ys: Tensor) -> tuple[Tensor, ...]:
        return _outputs(fn(*_with(args, diff, ys)))

    gen = torch.Generator().manual_seed(0)
    outs = f(*xs)
    cots = tuple(torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs)
    tans = tuple(torch.randn(x.shape, generator=gen, dtype=x.dtype) for x in xs)
    batch = [torch.stack([x, x * 0.9, x * 1.1]) for x in xs]

    def pullback(*ys: Tensor) -> tuple[Tensor, ...]:
        return vjp(f, *ys)[1](cots)

    eager = torch.autograd.grad(f(*[x.requires_grad_() for x in xs]), xs, cots, allow_unused=True)
    eager = tuple(torch.zeros_like(x) if g is None else g for g, x in zip(eager, xs))
    with torch.no_grad():
        fd = [(p - m) / (2 * eps) for p, m in zip(
            f(*[x + eps * t for x, t in zip(xs, tans)]),
            f(*[x - eps * t for x, t in zip(xs, tans)]))]  # fmt: skip
    checks = [
        ("torch.func.vjp", lambda: pullback(*xs), lambda: eager, "eager autograd.grad"),
        ("torch.func.vmap", lambda: vmap(f)(*batch), lambda: _loop(f, batch), "a Python loop"),
        ("vmap of torch.func.vjp", lambda: vmap(pullback)(*batch), lambda: _loop(pullback, batch),
         "a Python loop"),
        ("torch.func.jvp", lambda: jvp(f, tuple(xs), tans)[1], lambda: fd,
         f"finite differences (eps={eps:g})"),
    ]  # fmt: skip
    for label, run, reference, ref_name in checks:
        try:
            got = run()
        except Exception as err:
            raise FunctionCheckError(
                f"check_function({name}): fails under {label}: {_first_line(err)}. A custom "
                "Function needs the setup_context style (forward without ctx, a "
                "setup_context staticmethod), generate_vmap_rule = True (or a vmap "
                "staticmethod) for vmap, and a jvp staticmethod for forward mode"
            ) from err
        _compare(label, got, reference(), ref_name, name, atol, rtol)
    return [label for label, *_ in checks]


def _loop(f, batch: list[Tensor]) -> tuple[Tensor, ...]:
    rows = [f(*[b[k] for b in batch]) for k in range(3)]
    return tuple(torch.stack(parts) for parts in zip(*rows))


def _compare(label, got, want, ref_name, name, atol, rtol) -> None:
    for o, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape or not torch.allclose(g, w, atol=atol, rtol=rtol):
            diff = (g - w).abs().max().item() if g.shape == w.shape else math.nan
            raise FunctionCheckError(
                f"check_function({name}): {label} differs from {ref_name} in result {o}: "
                f"shape {tuple(g.shape)} vs {tuple(w.shape)}, max |difference| {diff:.3g} "
                f"(atol {atol:g}, rtol {rtol:g}); a vmap or jvp staticmethod of the Function "
                "disagrees with its forward/backward"
            )


# --------------------------------------------------------------------------- check_consistent


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


# --------------------------------------------------------------------------- anomaly_guard


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
_HERE = str(Path(__file__).resolve())
_TORCH = str(Path(torch.__file__).resolve().parent)


# Ops that write a given value: a NaN/inf they make was asked for (a placeholder, a mask).
_FILLS = {"full", "full_like", "new_full", "fill", "fill_", "scalar_tensor", "masked_fill",
          "masked_fill_", "index_fill", "index_fill_", "lift_fresh", "lift_fresh_copy"}  # fmt: skip


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
        # with isfinite(t).all() here, 1.33x with the sum (scripts/bench_anomaly_guard.py).
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
