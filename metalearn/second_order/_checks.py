"""Input checks shared by the second-order tools: scalar losses, parameter trees and the
vectors given beside them.

Each check raises a one-line `ValueError` that names what was wrong and how to fix it.
`check_like` is the one check of a vector against its parameters (structure, shape, dtype,
device) that `hvp` (every method), `hvp_double_backward` and `conjugate_gradient` run, so a
float64, float16 or int64 ``v`` beside float32 parameters is refused the same way
everywhere instead of being cast silently by one method and failing in torch by another.
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


def _names(tree: Tree) -> list[str]:
    """Each leaf's place in ``tree`` (``['w']``, ``[0]``, ...), in `tree_leaves` order."""
    if isinstance(tree, Tensor):
        return [""]
    if isinstance(tree, Mapping):
        return [f"[{k!r}]{rest}" for k, sub in tree.items() for rest in _names(sub)]
    if isinstance(tree, (tuple, list)):
        return [f"[{i}]{rest}" for i, sub in enumerate(tree) for rest in _names(sub)]
    return [""]


def check_params(params: Tree, name: str = "params", *, uniform: bool = False) -> None:
    """Raise a `ValueError` unless every leaf of ``params`` is a floating-point tensor (and,
    with ``uniform``, all of one dtype and device: the tools that flatten them need it).

    Args:
        params: the tree (leaves ``[*p_i]``).
        name: how the message names it.
        uniform: also require one dtype and one device across the leaves (`hessian` and
            `top_eigenvalues` flatten them into one vector; `hessian_trace` sums their
            quadratic forms, and a loss of mixed-dtype parameters otherwise fails inside torch).
    """
    leaves = tree_leaves(params)
    if not leaves:
        raise ValueError(f"{name} holds no tensor; pass the parameters to differentiate")
    for where, leaf in zip(_names(params), leaves):
        if not isinstance(leaf, Tensor) or not leaf.is_floating_point():
            kind = leaf.dtype if isinstance(leaf, Tensor) else type(leaf).__name__
            raise ValueError(
                f"{name}{where} is {kind}; second derivatives need floating-point tensors "
                "(convert with .double() or .float())"
            )
    first = leaves[0]
    for where, leaf in zip(_names(params), leaves):
        if uniform and (leaf.dtype, leaf.device) != (first.dtype, first.device):
            raise ValueError(
                f"{name}{where} is {leaf.dtype} on {leaf.device} but the first tensor of {name} is "
                f"{first.dtype} on {first.device}; this tool takes one dtype and device for "
                f"all of {name}, so convert every tensor to one (e.g. .double())"
            )


def check_like(params: Tree, v: Tree, name: str = "v") -> None:
    """Raise a `ValueError` unless ``v`` matches ``params`` leaf for leaf: containers, keys,
    shapes, dtypes and devices (no silent cast of a float64/float16/int64 ``v``).

    Args:
        params: the reference tree (floating-point leaves ``[*p_i]``).
        v: the vector (tree) given beside it.
        name: how the message names ``v``.
    """
    check_params(params)
    check_same_structure(params, v, name)
    for where, p, u in zip(_names(params), tree_leaves(params), tree_leaves(v)):
        if (u.dtype, u.device) != (p.dtype, p.device):
            raise ValueError(
                f"{name}{where} is {u.dtype} on {u.device} but the parameter is {p.dtype} on "
                f"{p.device}; pass {name} with the parameters' dtypes and devices "
                f"(e.g. {name} = tensor.to(param))"
            )


def _kind(node: Tree) -> str:
    if isinstance(node, Tensor):
        return "a tensor"
    if isinstance(node, Mapping):
        return "a dict"
    return "a tuple/list" if isinstance(node, (tuple, list)) else type(node).__name__


def check_same_structure(params: Tree, v: Tree, name: str = "v") -> None:
    """Raise a `ValueError` unless ``v`` has ``params``' containers, keys and leaf shapes.

    Args:
        params: the reference tree (leaves ``[*p_i]``).
        v: the tree to check (leaves must be ``[*p_i]`` too).
        name: how the message names ``v``.
    """
    p_leaves, v_leaves = tree_leaves(params), tree_leaves(v)
    if len(p_leaves) != len(v_leaves):
        raise ValueError(
            f"{name} has {len(v_leaves)} tensors but params has {len(p_leaves)}; "
            f"pass {name} with the same structure as params (e.g. the same dict keys)"
        )
    if isinstance(params, dict) and isinstance(v, dict) and list(params) != list(v):
        raise ValueError(
            f"{name}'s keys {list(v)} differ from params' keys {list(params)}; "
            f"build {name} with the same keys in the same order"
        )
    for i, (p, u) in enumerate(zip(p_leaves, v_leaves)):
        if not isinstance(u, Tensor):
            raise ValueError(
                f"{name}'s leaf {i} is {type(u).__name__}, not a tensor; pass {name} as "
                "tensors shaped like params"
            )
        if p.shape != u.shape:
            raise ValueError(
                f"{name}'s tensor {i} has shape {tuple(u.shape)} but the parameter has "
                f"{tuple(p.shape)}; {name} must match params shape for shape"
            )
    _walk(params, v, "", name)


def _walk(p: Tree, u: Tree, where: str, name: str) -> None:
    """Compare container kinds and dict keys level by level, naming the first mismatch."""
    if _kind(p) != _kind(u):
        raise ValueError(
            f"{name}{where} is {_kind(u)} but params{where} is {_kind(p)}; "
            f"pass {name} with the same structure as params (e.g. the same dict keys)"
        )
    if isinstance(p, Mapping):
        if list(p) != list(u):
            raise ValueError(
                f"{name}{where}'s keys {list(u)} differ from params{where}' keys {list(p)}; "
                f"build {name} with the same keys in the same order"
            )
        for key in p:
            _walk(p[key], u[key], f"{where}[{key!r}]", name)
    elif isinstance(p, (tuple, list)) and len(p) == len(u):
        for i, (pi, ui) in enumerate(zip(p, u)):
            _walk(pi, ui, f"{where}[{i}]", name)
