"""Parameters as trees of tensors, and the small algebra the second-order tools need.

A *tree* here is what `torch.func` accepts as a pytree of parameters: a tensor, a dict of
tensors (`dict(model.named_parameters())`), or a tuple/list of tensors, nested as deep as
you like. The helpers below keep the structure of their first argument, so an HVP of a
dict returns a dict with the same keys in the same order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call

Tree = Any  # Tensor | Mapping[str, Tree] | Sequence[Tree]


def tree_leaves(tree: Tree) -> list[Tensor]:
    """The tensors of `tree` in a fixed order (dict insertion order, then sequence order)."""
    if isinstance(tree, Tensor):
        return [tree]
    if isinstance(tree, Mapping):
        return [leaf for value in tree.values() for leaf in tree_leaves(value)]
    if isinstance(tree, (tuple, list)):
        return [leaf for value in tree for leaf in tree_leaves(value)]
    raise TypeError(
        "expected a tensor, a dict of tensors or a tuple/list of tensors, "
        f"got {type(tree).__name__}"
    )


def tree_unflatten(like: Tree, leaves: Iterable[Tensor]) -> Tree:
    """Rebuild a tree shaped like `like` from `leaves` (the inverse of `tree_leaves`)."""
    it = iter(leaves)

    def build(node: Tree) -> Tree:
        if isinstance(node, Tensor):
            leaf = next(it, None)
            if leaf is None:
                raise ValueError("fewer leaves than the tree has tensors")
            return leaf
        # Keep the container types: torch.func compares pytree structures by exact type, so
        # an OrderedDict rebuilt as a dict (or a namedtuple as a tuple) no longer matches.
        if isinstance(node, Mapping):
            items = [(key, build(value)) for key, value in node.items()]
            return OrderedDict(items) if isinstance(node, OrderedDict) else dict(items)
        values = [build(value) for value in node]
        if isinstance(node, tuple) and hasattr(node, "_fields"):  # namedtuple
            return type(node)(*values)
        return type(node)(values)

    out = build(like)
    if next(it, None) is not None:
        raise ValueError("more leaves than the tree has tensors")
    return out


def tree_map(fn: Callable[..., Tensor], tree: Tree, *rest: Tree) -> Tree:
    """Apply `fn` leaf by leaf across trees of the same structure."""
    rest_leaves = [tree_leaves(other) for other in rest]
    leaves = tree_leaves(tree)
    for other in rest_leaves:
        if len(other) != len(leaves):
            raise ValueError(
                f"trees differ in structure: {len(leaves)} tensors against {len(other)}; "
                "pass v with the same keys/shapes as params"
            )
    return tree_unflatten(tree, (fn(*group) for group in zip(leaves, *rest_leaves)))


def detached(tree: Tree) -> Tree:
    """`tree` with every tensor detached, its structure kept (other leaves, such as a float
    learning rate, as they are)."""
    if isinstance(tree, Tensor):
        return tree.detach()
    if isinstance(tree, Mapping):
        return {k: detached(v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(detached(v) for v in tree)
    return tree


def tree_dot(a: Tree, b: Tree) -> Tensor:
    """Sum over leaves of <a_i, b_i>: the Euclidean inner product of two trees (0-dim)."""
    return sum((x * y).sum() for x, y in zip(tree_leaves(a), tree_leaves(b), strict=True))


def tree_axpy(alpha: Tensor | float, x: Tree, y: Tree) -> Tree:
    """alpha * x + y, leaf by leaf."""
    return tree_map(lambda xi, yi: yi + alpha * xi, x, y)


def tree_scale(alpha: Tensor | float, x: Tree) -> Tree:
    """alpha * x, leaf by leaf."""
    return tree_map(lambda xi: alpha * xi, x)


def tree_numel(tree: Tree) -> int:
    """Total number of scalars in the tree."""
    return sum(leaf.numel() for leaf in tree_leaves(tree))


def flatten_tree(tree: Tree) -> Tensor:
    """Concatenate all leaves into one vector of shape [tree_numel(tree)].

    Uses `reshape`, not `view`, so non-contiguous leaves (e.g. a transposed weight) work.
    """
    return torch.cat([leaf.reshape(-1) for leaf in tree_leaves(tree)])


def unflatten_like(vector: Tensor, like: Tree) -> Tree:
    """Split a flat vector [tree_numel(like)] back into a tree shaped like `like`."""
    leaves = tree_leaves(like)
    total = sum(leaf.numel() for leaf in leaves)
    if vector.dim() != 1 or vector.numel() != total:
        raise ValueError(
            f"flat vector has shape {tuple(vector.shape)}, expected ({total},) to match the "
            "parameters; pass one entry per parameter scalar"
        )
    chunks = torch.split(vector, [leaf.numel() for leaf in leaves])
    return tree_unflatten(like, (c.reshape(leaf.shape) for c, leaf in zip(chunks, leaves)))


def params_and_buffers(model: nn.Module) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The model's parameters and buffers as detached-from-module dicts of tensors.

    The returned tensors *are* the module's tensors (no copy); gradients flow to them.
    """
    return dict(model.named_parameters()), dict(model.named_buffers())


def call(
    model: nn.Module,
    params: Mapping[str, Tensor],
    buffers: Mapping[str, Tensor] | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Run `model` with the given parameters via `torch.func.functional_call`.

    Params not in `params` fall back to the module's own, so adapting a subset (ANIL's head)
    needs no special case.
    """
    tensors = dict(buffers or {})
    tensors.update(params)
    return functional_call(model, tensors, args, kwargs, strict=False)


def accumulate_grad(params: Mapping[str, Tensor], grads: Mapping[str, Tensor]) -> None:
    """Add ``grads[name]`` into ``params[name].grad``, as ``loss.backward()`` would.

    For algorithms whose meta-gradient is not the gradient of a loss (Reptile, iMAML).
    Parameters that do not require grad are left alone.

    Args:
        params: theta, name -> leaf tensor (``dict(model.named_parameters())``).
        grads: name -> tensor shaped like the parameter.
    """
    with torch.no_grad():
        for name, p in params.items():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = grads[name].detach().clone()
            else:
                p.grad.add_(grads[name])
