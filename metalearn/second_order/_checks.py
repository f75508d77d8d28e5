"""Input checks shared by the second-order tools: scalar losses and matching trees.

Each check raises a one-line `ValueError` that names what was wrong and how to fix it.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor

from metalearn.functional import Tree, tree_leaves


def check_scalar(value: Tensor, where: str) -> Tensor:
    """``value`` reshaped to ``[]``, or a `ValueError` if it has more than one element.

    Args:
        value: what ``f(params)`` (or a loss) returned.
        where: how the error names it, e.g. ``"f(params)"``.

    Returns:
        The same value with shape ``[]``.
    """
    if not isinstance(value, Tensor) or value.numel() != 1:
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(
            f"{where} must return a scalar tensor (one element), got {shape}; "
            "reduce the loss with .mean() or .sum() first"
        )
    return value.reshape(())


def _kind(node: Tree) -> str:
    if isinstance(node, Tensor):
        return "a tensor"
    if isinstance(node, Mapping):
        return "a dict"
    return "a tuple/list" if isinstance(node, (tuple, list)) else type(node).__name__


def check_same_structure(params: Tree, v: Tree) -> None:
    """Raise a `ValueError` unless ``v`` has ``params``' containers, keys and leaf shapes.

    Args:
        params: the reference tree (leaves ``[*p_i]``).
        v: the tree to check (leaves must be ``[*p_i]`` too).
    """
    p_leaves, v_leaves = tree_leaves(params), tree_leaves(v)
    if len(p_leaves) != len(v_leaves):
        raise ValueError(
            f"v has {len(v_leaves)} tensors but params has {len(p_leaves)}; "
            "pass v with the same structure as params (e.g. the same dict keys)"
        )
    if isinstance(params, dict) and isinstance(v, dict) and list(params) != list(v):
        raise ValueError(
            f"v's keys {list(v)} differ from params' keys {list(params)}; "
            "build v with the same keys in the same order"
        )
    for i, (p, u) in enumerate(zip(p_leaves, v_leaves)):
        if p.shape != u.shape:
            raise ValueError(
                f"v's tensor {i} has shape {tuple(u.shape)} but the parameter has "
                f"{tuple(p.shape)}; v must match params shape for shape"
            )
    _walk(params, v, "")


def _walk(p: Tree, u: Tree, where: str) -> None:
    """Compare container kinds and dict keys level by level, naming the first mismatch."""
    if _kind(p) != _kind(u):
        raise ValueError(
            f"v{where} is {_kind(u)} but params{where} is {_kind(p)}; "
            "pass v with the same structure as params (e.g. the same dict keys)"
        )
    if isinstance(p, Mapping):
        if list(p) != list(u):
            raise ValueError(
                f"v{where}'s keys {list(u)} differ from params{where}' keys {list(p)}; "
                "build v with the same keys in the same order"
            )
        for key in p:
            _walk(p[key], u[key], f"{where}[{key!r}]")
    elif isinstance(p, (tuple, list)) and len(p) == len(u):
        for i, (pi, ui) in enumerate(zip(p, u)):
            _walk(pi, ui, f"{where}[{i}]")
