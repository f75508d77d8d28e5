"""`check_function`: a custom autograd Function's derivatives against finite differences.

``gradcheck`` and ``gradgradcheck`` in float64, then the ``torch.func`` transforms (``vjp``,
``vmap``, ``jvp``) against eager autograd, loops and finite differences. A failure raises
`FunctionCheckError` naming the check, the output and input, the worst element and by how much.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["FunctionCheck", "FunctionCheckError", "check_function"]


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


# A transform check: (label, run it, the reference result, the reference's name).
_TransformCheck = tuple[str, Callable[[], Sequence[Tensor]], Callable[[], Sequence[Tensor]], str]


def _check_transforms(fn, args, diff, name, eps, atol, rtol) -> list[str]:
    """vjp vs eager, vmap vs loop, vmap(vjp) vs loop, jvp vs finite differences."""
    checks = _transform_checks(fn, args, diff, eps)
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


def _transform_checks(fn, args, diff, eps) -> list[_TransformCheck]:
    """The transform checks, in order, with eager gradients and finite differences computed."""
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
    return [
        ("torch.func.vjp", lambda: pullback(*xs), lambda: eager, "eager autograd.grad"),
        ("torch.func.vmap", lambda: vmap(f)(*batch), lambda: _loop(f, batch), "a Python loop"),
        ("vmap of torch.func.vjp", lambda: vmap(pullback)(*batch), lambda: _loop(pullback, batch),
         "a Python loop"),
        ("torch.func.jvp", lambda: jvp(f, tuple(xs), tans)[1], lambda: fd,
         f"finite differences (eps={eps:g})"),
    ]  # fmt: skip


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
