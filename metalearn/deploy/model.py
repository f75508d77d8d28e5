"""The adapted network as a standalone module, with batch norm frozen or transductive.

Conv4's `MetaBatchNorm` is transductive: it normalises with the statistics of the batch
it is given, in training and in evaluation alike, so an image's logits depend on the
other images in its batch. `adapted_model` offers both readings: ``norm="support"``
freezes each batch norm at the support set's statistics (`FrozenBatchNorm`), so each
image is classified on its own; ``norm="transductive"`` keeps the training behaviour.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Literal

import torch
from torch import Tensor, nn

from metalearn.algorithms import MetaLearner
from metalearn.models import MetaBatchNorm

__all__ = ["FrozenBatchNorm", "adapted_model"]


class FrozenBatchNorm(nn.Module):
    """`MetaBatchNorm` with fixed statistics: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    Built by `adapted_model(norm="support")` from the support set's statistics, so each
    example is normalised on its own, whatever else is in its batch.

    Shape:
        ``[N, C, *]`` in and out; ``mean``, ``var``, ``weight``, ``bias`` are ``[C]``.
    """

    def __init__(self, mean: Tensor, var: Tensor, weight: Tensor, bias: Tensor, eps: float):
        super().__init__()
        self.register_buffer("mean", mean.detach().clone())
        self.register_buffer("var", var.detach().clone())
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        scale = torch.rsqrt(self.var + self.eps) * self.weight
        return (x - self.mean.reshape(shape)) * scale.reshape(shape) + self.bias.reshape(shape)


def adapted_model(
    learner: MetaLearner | nn.Module,
    params: Mapping[str, Tensor],
    *,
    norm: Literal["support", "transductive"] = "support",
    support_x: Tensor | None = None,
) -> nn.Module:
    """A standalone copy of the network with the adapted weights, in eval mode, no grads.

    Args:
        learner: the learner (or its model) that was adapted.
        params: the adapted weights (`adapt_to_support`), every parameter of the model.
        norm: ``"support"``: every `MetaBatchNorm` becomes a `FrozenBatchNorm` with the
            statistics of ``support_x`` through the adapted network (each image is then
            classified on its own); ``"transductive"``: batch norm uses each call's batch
            statistics, as in training (see the module docstring for the trade-off).
        support_x: the support images ``[N, C, H, W]`` (needed for ``norm="support"``).

    Returns:
        An ``nn.Module`` ``[B, C, H, W] -> [B, ways]`` (logits).

    Raises:
        ValueError: ``params`` lacks a parameter, ``norm`` is unknown, or ``support_x`` is
            missing for ``norm="support"``.
    """
    model = copy.deepcopy(learner.model if isinstance(learner, MetaLearner) else learner)
    names = [n for n, _ in model.named_parameters()]
    if missing := [n for n in names if n not in params]:
        raise ValueError(f"params lack {missing[:4]}: pass the full dict adapt_to_support returns")
    model.load_state_dict({**dict(model.named_buffers()), **params}, strict=False)
    model.eval().requires_grad_(False)
    if norm == "support":
        if support_x is None:
            raise ValueError("norm='support' needs support_x, the support images [N, C, H, W]")
        _freeze_batch_norm(model, support_x)
    elif norm != "transductive":
        raise ValueError(f"norm={norm!r}; choose 'transductive' or 'support'")
    return model


def _freeze_batch_norm(model: nn.Module, support_x: Tensor) -> None:
    """Replace each `MetaBatchNorm` by a `FrozenBatchNorm` holding its support statistics."""
    stats: dict[str, tuple[Tensor, Tensor]] = {}

    def record(name: str):
        def hook(module: nn.Module, inputs: tuple[Tensor, ...]) -> None:
            (x,) = inputs
            dims = (0, *range(2, x.dim()))
            mean = x.mean(dims)  # biased variance, as `metalearn.models.batch_norm`
            stats[name] = (
                mean,
                ((x - mean.reshape((1, -1) + (1,) * (x.dim() - 2))) ** 2).mean(dims),
            )

        return hook

    norms = {n: m for n, m in model.named_modules() if isinstance(m, MetaBatchNorm)}
    if not norms:
        raise ValueError("norm='support' found no MetaBatchNorm in the model; use 'transductive'")
    handles = [m.register_forward_pre_hook(record(n)) for n, m in norms.items()]
    try:
        with torch.no_grad():
            model(support_x)
    finally:
        for handle in handles:
            handle.remove()
    for name, module in norms.items():
        frozen = FrozenBatchNorm(*stats[name], module.weight, module.bias, module.eps)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, frozen)
