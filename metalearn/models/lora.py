"""Low-rank adapters (LoRA, Hu et al., 2021) as the fast weights of the inner loop.

A `LoRALinear` computes (Hu et al., 2021, Eq. 3, with the scaling of their Sec. 4.1)::

    h = W x + b + (alpha / r) * B A x,    A: [r, in], B: [out, r], B = 0 at the start

so at initialisation it computes exactly what the wrapped linear layer does. A `LoRAConv2d`
applies the same update to a convolution's kernel seen as the ``[out, in * kh * kw]``
matrix it multiplies each (unfolded) input patch by::

    K' = K + (alpha / r) * reshape(B A, K.shape),    A: [r, in * kh * kw], B: [out, r]

so the update has rank at most ``r`` as that matrix, whatever the kernel size. For
meta-learning, adapt only the adapters in the inner loop (the base weights are frozen by
convention, not by ``requires_grad``)::

    model = add_lora(Conv4(), rank=4, alpha=4.0, layers=(nn.Linear, nn.Conv2d))
    learner = MAML(model, adapt_keys=lora_keys(model))

The outer loop then meta-learns everything it is given: pass the optimiser only
``lora_keys``' parameters to freeze the base in the outer loop as well.
`metalearn.algorithms.LoRAMAML` is this recipe as an algorithm.

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

__all__ = ["LoRAConv2d", "LoRALinear", "add_lora", "lora_keys"]

Target = Callable[[str, nn.Module], bool] | Collection[str] | None
"""Which layers get adapters: None (all of the chosen kinds), their names, or
``f(name, layer) -> bool``."""


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
        _check_rank(rank)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.weight = base.weight
        self.bias = base.bias
        self.lora_A, self.lora_B = _adapters(base.weight, rank, self.in_features)

    def forward(self, x: Tensor) -> Tensor:
        # x A^T B^T costs r (in + out) per row instead of forming the [out, in] product B A.
        update = F.linear(F.linear(x, self.lora_A), self.lora_B)
        return F.linear(x, self.weight, self.bias) + self.scaling * update

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, rank={self.rank}, alpha={self.alpha}"


class LoRAConv2d(nn.Module):
    """A 2-d convolution whose kernel carries a trainable low-rank update.

    The kernel ``K`` (``[out, in / groups, kh, kw]``) becomes ``K + (alpha / rank) *
    reshape(B @ A, K.shape)`` with ``A: [rank, in / groups * kh * kw]`` and ``B: [out,
    rank]``: a rank-``r`` update of the matrix ``[out, in / groups * kh * kw]`` that the
    convolution applies to every unfolded patch (the LoRA of `LoRALinear` on the im2col
    form of the layer). The merged kernel is formed on every call: for Conv4's 3x3 layers
    that is ``out * in * 9 * r`` multiply-adds, far below the convolution itself, and
    one convolution runs instead of two. Initialisation as `LoRALinear`: ``B = 0``, ``A``
    Kaiming-uniform as `nn.Conv2d` initialises a kernel of that fan-in. The base layer's
    ``weight`` and ``bias``, stride, padding, dilation and groups are kept.

    Args:
        base: the convolution to adapt (``padding_mode="zeros"``).
        rank: ``r``, the rank of the update (>= 1).
        alpha: the scale numerator; the update is multiplied by ``alpha / rank``.

    Shape:
        ``[N, in_channels, H, W] -> [N, out_channels, H', W']`` as ``base``.
    """

    def __init__(self, base: nn.Conv2d, rank: int, alpha: float = 1.0) -> None:
        super().__init__()
        if not isinstance(base, nn.Conv2d):
            raise ValueError(f"LoRAConv2d wraps an nn.Conv2d, got {type(base).__name__}")
        if base.padding_mode != "zeros":
            raise ValueError(
                f"LoRAConv2d supports padding_mode='zeros', got {base.padding_mode!r}; "
                "leave this layer out of add_lora's target"
            )
        _check_rank(rank)
        self.in_channels, self.out_channels = base.in_channels, base.out_channels
        self.kernel_size, self.stride, self.padding = base.kernel_size, base.stride, base.padding
        self.dilation, self.groups = base.dilation, base.groups
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        self.weight = base.weight
        self.bias = base.bias
        self.lora_A, self.lora_B = _adapters(base.weight, rank, base.weight[0].numel())

    def merged_weight(self) -> Tensor:
        """The kernel applied, ``K + (alpha / r) * reshape(B A)``: ``[out, in/groups, kh, kw]``."""
        update = (self.lora_B @ self.lora_A).reshape(self.weight.shape)
        return self.weight + self.scaling * update

    def forward(self, x: Tensor) -> Tensor:
        return F.conv2d(
            x, self.merged_weight(), self.bias, self.stride, self.padding, self.dilation,
            self.groups,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, rank={self.rank}, alpha={self.alpha}"
        )


_WRAPPERS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: LoRALinear,
    nn.Conv2d: LoRAConv2d,
}
_ADAPTED = (LoRALinear, LoRAConv2d)


def add_lora(
    model: nn.Module,
    rank: int,
    alpha: float = 1.0,
    target: Target = None,
    layers: Collection[type[nn.Module]] = (nn.Linear,),
) -> nn.Module:
    """A copy of ``model`` whose chosen layers carry low-rank adapters.

    The original model is not touched: the copy is a ``deepcopy`` whose chosen children are
    replaced on their parents. At initialisation the copy computes the same function.

    Args:
        model: the network.
        rank: the adapters' rank.
        alpha: the adapters' scale numerator (see `LoRALinear`).
        target: which layers of the kinds in ``layers`` to adapt: None for all of them, a
            collection of module names (``"head"``, ``"features.0.conv"``), or
            ``f(name, layer) -> bool``.
        layers: the kinds of layer that may be adapted, among ``nn.Linear`` (as
            `LoRALinear`) and ``nn.Conv2d`` (as `LoRAConv2d`). Linear only by default.

    Returns:
        The adapted copy; its parameter names are the original ones plus ``<layer>.lora_A``
        and ``<layer>.lora_B`` per adapted layer (see `lora_keys`).
    """
    kinds = tuple(layers)
    if not kinds or any(k not in _WRAPPERS for k in kinds):
        raise ValueError(
            f"layers={[getattr(k, '__name__', k) for k in kinds]} cannot be adapted; pass a "
            "non-empty subset of (nn.Linear, nn.Conv2d)"
        )
    _check_rank(rank)
    new = copy.deepcopy(model)
    for name in _targets(new, target, kinds):
        if name == "":  # the model is itself a layer to adapt
            return _wrap(new, rank, alpha)
        parent, _, child = name.rpartition(".")
        owner = new.get_submodule(parent) if parent else new
        setattr(owner, child, _wrap(getattr(owner, child), rank, alpha))
    return new


def lora_keys(model: nn.Module) -> list[str]:
    """Names of the adapter parameters (``*.lora_A``, ``*.lora_B``): pass them as adapt_keys."""
    keys = [
        f"{name}.{p}" if name else p
        for name, module in model.named_modules()
        if isinstance(module, _ADAPTED)
        for p in ("lora_A", "lora_B")
    ]
    if not keys:
        raise ValueError("the model has no LoRA layers; build it with add_lora(model, rank)")
    return keys


def _wrap(layer: nn.Module, rank: int, alpha: float) -> nn.Module:
    wrapper = next(w for kind, w in _WRAPPERS.items() if isinstance(layer, kind))
    return wrapper(layer, rank, alpha)


def _check_rank(rank: int) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be an int >= 1, got {rank!r}")


def _adapters(weight: Tensor, rank: int, fan_in: int) -> tuple[nn.Parameter, nn.Parameter]:
    """``lora_A`` ``[rank, fan_in]`` (Kaiming-uniform, as nn.Linear/nn.Conv2d initialise a
    weight of that fan-in) and ``lora_B`` ``[out, rank]`` (zeros), on ``weight``'s device."""
    like = dict(dtype=weight.dtype, device=weight.device)
    lora_a = nn.Parameter(torch.empty(rank, fan_in, **like))
    nn.init.kaiming_uniform_(lora_a, a=math.sqrt(5))
    return lora_a, nn.Parameter(torch.zeros(weight.shape[0], rank, **like))


def _targets(model: nn.Module, target: Target, kinds: tuple[type[nn.Module], ...]) -> list[str]:
    candidates = {n: m for n, m in model.named_modules() if isinstance(m, kinds)}
    what = " or ".join(f"nn.{k.__name__}" for k in kinds)
    if target is None:
        names = list(candidates)
    elif callable(target):
        names = [n for n, m in candidates.items() if target(n, m)]
    else:
        if isinstance(target, str):
            raise ValueError(
                f"target must be a collection of names, got the string {target!r}; "
                f"pass [{target!r}]"
            )
        if wrong := [n for n in target if n not in candidates]:
            raise ValueError(
                f"target names {wrong} are not {what} layers of the model; "
                f"its {what} layers are {list(candidates)}"
            )
        names = list(target)
    if not names:
        raise ValueError(
            f"target selects no {what} layer; the model's {what} layers are {list(candidates)}"
        )
    return names
