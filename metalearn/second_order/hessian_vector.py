"""Hessian-vector products H(params) v of a scalar function, without forming H.

Three exact ways to compute H v (Pearlmutter, 1994):

* ``"double-backward"`` (the default, `DEFAULT_HVP_METHOD`): ``autograd.grad`` of
  ``<grad f, v>``, the gradient taken with ``create_graph=True``: reverse mode twice
  through torch's autograd graph.
* ``"reverse-over-reverse"``: ``vjp(grad(f), params)(v)`` in ``torch.func``; the same
  maths (valid because H is symmetric), through functorch's transforms.
* ``"forward-over-reverse"``: ``jvp(grad(f), (params,), (v,))``, one forward-mode pass
  through the backward graph.

Why double backward is the default: it is the fastest of the three on the models of
``scripts/bench_hvp.py`` and the lightest in memory, and every op with a backward has a
double backward, while torch 2.13 has no forward-mode formula for the backward of
``F.mse_loss`` (mean) or ``F.huber_loss``. Measured with::

    .venv/bin/python scripts/bench_hvp.py --repeats 11 --warmup 2 --threads 1 --clock cpu \\
        --hessian-sizes 100 300 1000

(torch 2.13 CPU, 1 thread, process CPU time, median over 11 rounds, shared 2-core
machine), time of one H v over one gradient:

=========================  ===============  ====================  ====================
model                      double-backward  reverse-over-reverse  forward-over-reverse
=========================  ===============  ====================  ====================
conv4 (hand batch norm)    2.78             2.95                  3.54
conv4 (fused batch norm)   3.97             4.02                  4.29
MLP(64, [100, 32], 5)      1.40             1.98                  3.27
=========================  ===============  ====================  ====================

Double backward also had the lowest peak memory on both conv4s (29.2 and 25.4 MB against
30.6-32.6 MB), and all three agree to float32 rounding (relative difference at most 2.6e-6).
The GPU measurements in ``docs/benchmarks.md`` (H200) rank the three methods the same way
on all three models.

Inside a ``torch.func`` transform (``vmap``, ``grad``, ...) autograd cannot mark the
transform's tensors for differentiation, so ``"double-backward"`` raises there, naming the
fix: ``method="reverse-over-reverse"``, the same reverse-of-reverse product through
``torch.func``. The method is the caller's choice, never switched behind their back.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

import torch
from torch import Tensor
from torch.func import grad, jvp, vjp

from metalearn.attention import attention_kernel
from metalearn.functional import Tree, tree_leaves, tree_map, tree_unflatten
from metalearn.second_order._checks import check_like, check_scalar
from metalearn.second_order._running_stats import refuse_running_stat_updates

__all__ = [
    "DEFAULT_HVP_METHOD",
    "HVP_METHODS",
    "HVPMethod",
    "hvp",
    "hvp_double_backward",
]

HVPMethod = Literal["forward-over-reverse", "reverse-over-reverse", "double-backward"]
HVP_METHODS: tuple[str, ...] = ("forward-over-reverse", "reverse-over-reverse", "double-backward")
DEFAULT_HVP_METHOD: HVPMethod = "double-backward"
"""The method `hvp` and every tool built on it use unless told otherwise (see above)."""


def hvp(
    f: Callable[[Tree], Tensor],
    params: Tree,
    v: Tree,
    *,
    method: HVPMethod = DEFAULT_HVP_METHOD,
    create_graph: bool = False,
) -> Tree:
    """Hessian-vector product H(params) @ v of a scalar function, without forming H.

    Args:
        f: ``f(params) -> Tensor[]``, a scalar loss of the parameter tree.
        params: the point at which the Hessian is taken: a tensor, a dict of tensors or a
            tuple/list of tensors (shapes ``[*p_i]``).
        v: the direction, a tree with the same structure and shapes as ``params``.
        method: ``"double-backward"`` (default: autograd.grad of ``<grad f, v>``; not
            inside ``torch.func`` transforms, where it raises naming the fix),
            ``"reverse-over-reverse"`` (vjp of grad) or ``"forward-over-reverse"`` (jvp of
            grad; where torch lacks a forward-mode formula it warns and uses
            reverse-over-reverse, once per calling line).
        create_graph: keep the result differentiable with respect to ``params`` and ``v``
            (for iMAML-style meta-gradients and third-order uses). When False the result is
            detached and no graph is kept.

    Returns:
        H v as a tree shaped like ``params`` (each leaf ``[*p_i]``).

    Raises:
        ValueError: ``v`` differs from ``params`` in structure, a shape, a dtype or a device
            (one check for every method, `metalearn.second_order._checks.check_like`); or
            ``f`` runs a training-mode batch norm that tracks running statistics, which every
            method refuses before any buffer is written, naming ``model.eval()`` and
            ``torch.func.replace_all_batch_norm_modules_``
            (`metalearn.second_order._running_stats`).
    """
    check_like(params, v)
    if method not in HVP_METHODS:
        raise ValueError(f"unknown HVP method {method!r}; choose one of {HVP_METHODS}")
    # torch.func compares containers by exact type (dict vs OrderedDict, tuple vs list): give v
    # params' own containers so any v with the same keys and shapes is accepted.
    v = tree_unflatten(params, tree_leaves(v))

    def scalar_f(p: Tree) -> Tensor:
        # f's gradient is differentiated again: attention runs its math kernel.
        with refuse_running_stat_updates("f(params)"), attention_kernel(twice_differentiated=True):
            return check_scalar(f(p), "f(params)")

    if method == "double-backward":
        try:
            return _hvp_autograd(scalar_f, params, v, create_graph)
        except RuntimeError as error:
            if "functorch transform" not in str(error):
                raise
            raise RuntimeError(
                "hvp(method='double-backward') cannot run inside a torch.func transform (vmap, "
                "grad, ...): autograd cannot mark the transform's tensors for differentiation; "
                "pass method='reverse-over-reverse', the same exact product through torch.func"
            ) from None
    # torch.func transforms ignore an outer no_grad for their own differentiation, so this
    # only stops the *outer* graph from being recorded when nobody asked for it.
    with torch.enable_grad() if create_graph else torch.no_grad():
        if method == "forward-over-reverse":
            try:
                return jvp(_gradient_by_vjp(scalar_f), (params,), (v,))[1]
            except (RuntimeError, NotImplementedError) as error:
                if not _forward_mode_unsupported(error):
                    raise
                _warn_forward_fallback(error)
        _, vjp_fn = vjp(grad(scalar_f), params)
        return vjp_fn(v)[0]


def _gradient_by_vjp(f: Callable[[Tree], Tensor]) -> Callable[[Tree], Tree]:
    """``p -> grad f(p)`` as one vjp with a unit cotangent.

    The same numbers as ``torch.func.grad(f)``, but measured 16-20% faster and ~30% lighter
    as the inner function of a jvp on Conv4 (CPU, torch 2.13): forward mode then pushes
    tangents through a plain vjp instead of grad's extra bookkeeping.
    """

    def gradient(p: Tree) -> Tree:
        out, pullback = vjp(f, p)
        return pullback(torch.ones_like(out))[0]

    return gradient


# Some ops' backward formulas have no forward-mode derivative in torch (measured, torch 2.13:
# F.mse_loss with mean reduction fails with "ZeroTensors are immutable", F.huber_loss has no
# forward AD formula). Reverse-over-reverse gives the same exact H v, so forward-over-reverse
# falls back to it, warned, rather than fail on common losses. The warning goes through
# Python's warning registry, which by default shows it once per calling line.
_FORWARD_MODE_ERRORS = ("ZeroTensors are immutable", "forward AD", "forward-mode", "jvp")


def _forward_mode_unsupported(error: BaseException) -> bool:
    # torch.func's refusal to write a captured tensor names "(vjp, jvp, grad, etc)" too, but
    # reverse mode refuses it just the same: it is not a missing forward-mode formula.
    if "mutate a captured Tensor" in str(error):
        return False
    return any(marker in str(error) for marker in _FORWARD_MODE_ERRORS)


def _warn_forward_fallback(error: BaseException) -> None:
    warnings.warn(
        "forward-over-reverse HVP is not supported by an op in f (torch said: "
        f"{str(error).splitlines()[0][:160]}); using reverse-over-reverse, which is equally "
        f"exact. Pass method={DEFAULT_HVP_METHOD!r} (the default) to avoid forward mode.",
        RuntimeWarning,
        stacklevel=3,
    )


def _hvp_autograd(f: Callable[[Tree], Tensor], params: Tree, v: Tree, create_graph: bool) -> Tree:
    """H v by double backward on fresh leaves (or on ``params`` themselves for create_graph)."""

    # Without create_graph the HVP must not reach back into whatever produced `params`.
    def prepare(t: Tensor) -> Tensor:
        if create_graph and t.requires_grad:
            return t
        return t.detach().requires_grad_(True)

    with torch.enable_grad():
        p = tree_map(prepare, params)
        leaves = tree_leaves(p)
        loss = f(p)
        products = _grad_of_grad(loss, leaves, tree_leaves(v), create_graph)
    return tree_unflatten(params, products)


def _grad_of_grad(
    loss: Tensor,
    leaves: Sequence[Tensor],
    v: Sequence[Tensor],
    create_graph: bool,
    retain_graph: bool | None = None,
) -> list[Tensor]:
    """d/dθ <∇loss(θ), v> for each leaf θ (``[*θ_i]``); zeros where there is no curvature.

    ``retain_graph`` (default: ``create_graph``) keeps the loss's graph after the second pass.
    """
    grads = torch.autograd.grad(loss, leaves, create_graph=True, allow_unused=True)
    # A gradient that is None (unused leaf) or constant (loss linear in that leaf) has no
    # second derivative; keep only the terms that do.
    terms = [(g * u).sum() for g, u in zip(grads, v) if g is not None and g.requires_grad]
    if not terms:
        return [torch.zeros_like(t) for t in leaves]
    second = torch.autograd.grad(
        torch.stack(terms).sum(),
        leaves,
        retain_graph=retain_graph,
        create_graph=create_graph,
        allow_unused=True,
    )
    return [torch.zeros_like(t) if s is None else s for s, t in zip(second, leaves)]


def hvp_double_backward(
    loss: Tensor,
    params: Iterable[Tensor],
    v: Tensor | Sequence[Tensor],
    *,
    retain_graph: bool = False,
    create_graph: bool = False,
) -> tuple[Tensor, ...]:
    """H v for a loss already computed in ordinary (graph-building) training code.

    Example::

        loss = criterion(model(x), y)
        hv = hvp_double_backward(loss, model.parameters(), v)

    Args:
        loss: a scalar tensor whose graph reaches ``params``.
        params: the tensors to differentiate with respect to (e.g. ``model.parameters()``);
            each must require grad. Parameters the loss does not use get zeros.
        v: either one flat vector of shape ``[sum(p.numel())]`` (split in the order of
            ``params``), or a sequence of tensors shaped like ``params``.
        retain_graph: keep the loss's graph alive afterwards (to call ``loss.backward()``
            later). By default it is freed, so memory does not grow across calls.
        create_graph: make the result differentiable (implies the graph is kept).

    Returns:
        A tuple with one tensor per parameter, shaped like it.

    Raises:
        RuntimeError: the loss's attention ran a fused kernel (no double backward): compute
            it under ``metalearn.attention.attention_kernel(twice_differentiated=True)``.
    """
    params = list(params)
    if not params:
        raise ValueError(
            "params is empty; pass the tensors to differentiate, e.g. model.parameters()"
        )
    for i, p in enumerate(params):
        if not p.requires_grad:
            raise ValueError(
                f"parameter {i} (shape {tuple(p.shape)}) does not require grad; "
                "call .requires_grad_() on it or leave it out of params"
            )
    loss = check_scalar(loss, "loss")
    if not loss.requires_grad:
        raise ValueError("loss has no graph (requires_grad=False); compute it with grad enabled")
    v = _split_flat(v, params) if isinstance(v, Tensor) else list(v)
    check_like(params, v)
    with torch.enable_grad():
        try:
            products = _grad_of_grad(
                loss, params, v, create_graph, retain_graph=retain_graph or create_graph
            )
        except RuntimeError as error:
            if "attention" not in str(error) or "not implemented" not in str(error):
                raise
            raise RuntimeError(
                "hvp_double_backward: the loss's attention ran a fused kernel, which has no "
                "double backward; compute the loss inside "
                "metalearn.attention.attention_kernel(twice_differentiated=True)"
            ) from None
    return tuple(products)


def _split_flat(v: Tensor, params: Sequence[Tensor]) -> list[Tensor]:
    """A flat ``[sum(p.numel())]`` vector cut into tensors shaped like ``params``."""
    total = sum(p.numel() for p in params)
    if v.dim() != 1 or v.numel() != total:
        raise ValueError(
            f"flat v has shape {tuple(v.shape)} but params have {total} scalars in all; "
            f"pass a vector of shape ({total},) or one tensor per parameter"
        )
    # reshape, not view: a flat slice reshaped to a transposed parameter's shape is fine,
    # and nothing here assumes the parameter or its gradient is contiguous.
    chunks = torch.split(v, [p.numel() for p in params])
    return [c.reshape(p.shape) for c, p in zip(chunks, params)]
