"""Low-rank adapters (LoRA, Hu et al., 2021) as the fast weights of the inner loop.

A `LoRALinear` computes (Hu et al., 2021, Eq. 3, with the scaling of their Sec. 4.1)::

    h = W x + b + (alpha / r) * B A x,    A: [r, in], B: [out, r], B = 0 at the start

so at initialisation it computes exactly what the wrapped linear layer does. For
meta-learning, adapt only the adapters in the inner loop (the base weights are frozen by
convention, not by ``requires_grad``)::

    model = add_lora(Conv4(), rank=4, alpha=4.0)
    learner = MAML(model, adapt_keys=lora_keys(model))

The outer loop then meta-learns everything it is given: pass the optimiser only
``lora_keys``' parameters to freeze the base in the outer loop as well.

Everything runs through ``functional_call``: the adapters are ordinary parameters named
``<layer>.lora_A`` and ``<layer>.lora_B`` beside the layer's own ``weight`` and ``bias``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Collection

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LoRALinear", "add_lora", "lora_keys"]

Target = Callable[[str, nn.Linear], bool] | Collection[str] | None
"""Which linear layers get adapters: None (all), their names, or ``f(name, layer) -> bool``."""


class LoRALinear(nn.Module):
    """A linear layer plus a trainable low-rank update ``(alpha / rank) * B @ A``.

    The layer's ``weight`` and ``bias`` are the base layer's own parameters (shared, not
    copied). ``lora_B`` starts at zero, so the update starts at zero but its gradient does
    not (Hu et al., 2021, Sec. 4.1); ``lora_A`` starts random, Kaiming-uniform as
    `nn.Linear` initialises a ``[rank, in]`` weight (the reference implementation
    ``loralib``; the paper says Gaussian). The gradient of ``lora_A`` is zero while
    ``lora_B`` is zero, so a first inner step from the initialisation moves only B.

    Args:
        base: the linear layer to adapt.
        rank: ``r``, the rank of the update (>= 1).
        alpha: the scale numerator; the update is multiplied by ``alpha / rank``.

    Shape:
        ``[*, in_features] -> [*, out_features]``.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float = 1.0) -> None:
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise ValueError(f"LoRALinear wraps an nn.Linear, got {type(base).__name__}")
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.weight = base.weight
        self.bias = base.bias
        like = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.lora_A = nn.Parameter(torch.empty(rank, self.in_features, **like))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, **like))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x: Tensor) -> Tensor:
        # x A^T B^T costs r (in + out) per row instead of forming the [out, in] product B A.
        update = F.linear(F.linear(x, self.lora_A), self.lora_B)
        return F.linear(x, self.weight, self.bias) + self.scaling * update

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, rank={self.rank}, alpha={self.alpha}"


def add_lora(model: nn.Module, rank: int, alpha: float = 1.0, target: Target = None) -> nn.Module:
    """A copy of ``model`` whose chosen ``nn.Linear`` layers are `LoRALinear`s.

    The original model is not touched: the copy is a ``deepcopy`` whose linear children are
    replaced on their parents. At initialisation the copy computes the same function.

    Args:
        model: the network.
        rank: the adapters' rank.
        alpha: the adapters' scale numerator (see `LoRALinear`).
        target: which ``nn.Linear`` layers to adapt: None for all of them, a collection of
            module names (``"head"``, ``"features.0"``), or ``f(name, layer) -> bool``.

    Returns:
        The adapted copy; its parameter names are the original ones plus ``<layer>.lora_A``
        and ``<layer>.lora_B`` per adapted layer (see `lora_keys`).
    """
    new = copy.deepcopy(model)
    names = _targets(new, target)
    if names == [""]:  # the model is itself a linear layer
        return LoRALinear(new, rank, alpha)
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = new.get_submodule(parent) if parent else new
        setattr(owner, child, LoRALinear(getattr(owner, child), rank, alpha))
    return new


def lora_keys(model: nn.Module) -> list[str]:
    """Names of the adapter parameters (``*.lora_A``, ``*.lora_B``): pass them as adapt_keys."""
    keys = [
        f"{name}.{p}" if name else p
        for name, module in model.named_modules()
        if isinstance(module, LoRALinear)
        for p in ("lora_A", "lora_B")
    ]
    if not keys:
        raise ValueError("the model has no LoRALinear layers; build it with add_lora(model, rank)")
    return keys


def _targets(model: nn.Module, target: Target) -> list[str]:
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    if target is None:
        names = list(linears)
    elif callable(target):
        names = [n for n, m in linears.items() if target(n, m)]
    else:
        if isinstance(target, str):
            raise ValueError(
                f"target must be a collection of names, got the string {target!r}; "
                f"pass [{target!r}]"
            )
        if wrong := [n for n in target if n not in linears]:
            raise ValueError(
                f"target names {wrong} are not nn.Linear layers of the model; "
                f"its linear layers are {list(linears)}"
            )
        names = list(target)
    if not names:
        raise ValueError(
            f"target selects no nn.Linear layer; the model's linear layers are {list(linears)}"
        )
    return names
