"""The dense Hessian: the reference the Hessian-vector products are tested against."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from metalearn.attention import attention_kernel
from metalearn.functional import Tree, flatten_tree, unflatten_like
from metalearn.second_order._checks import check_params, check_scalar
from metalearn.second_order._running_stats import refuse_running_stat_updates

__all__ = ["hessian"]


def hessian(
    f: Callable[[Tree], Tensor], params: Tree, *, method: Literal["rows", "vmap"] = "rows"
) -> Tensor:
    """The dense Hessian of ``f`` at ``params``, over the flattened parameters.

    Meant for small problems and as the reference the HVP paths are tested against: it
    costs O(n^2) memory for n parameter scalars.

    Args:
        f: ``f(params) -> Tensor[]``.
        params: the parameter tree (n scalars in all, flattened in ``tree_leaves`` order).
        method: ``"rows"`` (default: n double-backward passes through one retained graph,
            one row each; slow and obviously right) or ``"vmap"`` (``torch.func.hessian``,
            jacfwd of jacrev, vectorised and much faster). Beware ``"vmap"`` through
            ``F.batch_norm`` in training mode: measured on torch 2.13, the mixed block
            (batch-norm weight x upstream conv weight) comes out wrong by about 10%,
            because the fused kernel's batching rule is wrong for second derivatives.
            Batch norm written from ``mean``/``var`` (``metalearn.models``) is fine.

    Returns:
        Tensor of shape ``[n, n]``.

    Raises:
        ValueError: ``f`` runs a training-mode batch norm that tracks running statistics
            (refused before any buffer is written, as by `hvp`).
    """
    check_params(params, uniform=True)
    flat = flatten_tree(params).detach()

    def f_flat(x: Tensor) -> Tensor:
        # differentiated twice: attention runs its math kernel (metalearn.attention)
        with refuse_running_stat_updates("f(params)"), attention_kernel(twice_differentiated=True):
            return check_scalar(f(unflatten_like(x, params)), "f(params)")

    if method == "vmap":
        with torch.no_grad():
            return torch.func.hessian(f_flat)(flat)
    if method != "rows":
        raise ValueError(f"unknown hessian method {method!r}; choose 'rows' or 'vmap'")
    with torch.enable_grad():
        x = flat.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(f_flat(x), x, create_graph=True)
        rows = []
        for i in range(x.numel()):
            if not g.requires_grad:  # f is linear or constant in x: zero Hessian
                rows.append(torch.zeros_like(x))
                continue
            (row,) = torch.autograd.grad(g[i], x, retain_graph=True, allow_unused=True)
            rows.append(torch.zeros_like(x) if row is None else row)
    return torch.stack(rows)
