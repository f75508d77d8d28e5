"""The adapted network as a standalone module, in one of three batch-norm readings.

Conv4's `MetaBatchNorm` is transductive: it normalises with the statistics of the batch
it is given, in training and in evaluation alike, so an image's logits depend on the
other images in its batch. `adapted_model` offers three readings (`NORMS`):

* ``norm="support"`` freezes each batch norm at the support set's statistics
  (`FrozenBatchNorm`), so each image is classified on its own;
* ``norm="transductive"`` keeps the training behaviour: a call's images are normalised
  together (what most learners' `evaluate` does with a task's query set);
* ``norm="beside_support"`` classifies each image as the last row of a batch of the
  support set and that image (`BesideSupport`): batch norm sees the support set plus
  that one image, one forward of ``N + 1`` images per image, so each image is again
  classified on its own. This is Reptile's evaluation by default (``transductive=False``,
  after ``openai/supervised-reptile``'s ``_test_predictions``).

A learner names the reading its `evaluate` uses (`MetaLearner.evaluation_norm`);
`default_norm` is the reading a deployed learner gets unless one is asked for.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from typing import Literal, get_args

import torch
from torch import Tensor, nn

from metalearn.algorithms import MetaLearner
from metalearn.models import MetaBatchNorm
from metalearn.models.lora import LoRAConv2d, LoRALinear

__all__ = [
    "NORMS",
    "BesideSupport",
    "FrozenBatchNorm",
    "GroupBatchNorm",
    "Norm",
    "adapted_model",
    "check_norm",
    "default_norm",
    "merge_lora",
    "with_norm_reading",
]

Norm = Literal["support", "transductive", "beside_support"]
"""A batch-norm reading of the deployed network (see the module docstring)."""
NORMS: tuple[str, ...] = get_args(Norm)


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


class GroupBatchNorm(nn.Module):
    """`MetaBatchNorm` over consecutive groups of ``group`` examples: each group is
    normalised with its own statistics, as if it were a batch of its own.

    ``[B * group, C, *]`` is read as ``B`` batches of ``group`` examples; for each, ``(x -
    mean) / sqrt(var + eps) * weight + bias`` with the group's per-channel mean and biased
    variance (over its examples and every dimension after ``C``), as
    `metalearn.models.batch_norm` computes them for one batch.

    Shape:
        ``[B * group, C, *]`` in and out; ``weight``, ``bias`` are ``[C]``.
    """

    def __init__(self, group: int, weight: Tensor, bias: Tensor, eps: float):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        grouped = x.reshape(-1, self.group, *x.shape[1:])  # [B, group, C, *]
        dims = (1, *range(3, grouped.dim()))
        shape = (1, 1, -1) + (1,) * (x.dim() - 2)
        inv_n = 1.0 / (self.group * math.prod(x.shape[2:]))  # as `batch_norm`: sums times 1/n
        centred = grouped - grouped.sum(dims, keepdim=True) * inv_n
        var = (centred * centred).sum(dims, keepdim=True) * inv_n
        scale = torch.rsqrt(var + self.eps) * self.weight.reshape(shape)
        return (centred * scale + self.bias.reshape(shape)).reshape(x.shape)


class BesideSupport(nn.Module):
    """Each image classified as the last row of a batch of the support set and that image.

    The call on ``B`` images runs the network once on ``B`` stacked batches of ``N + 1``
    (the ``N`` support images, then one of the images), its batch norms (`GroupBatchNorm`)
    normalising each batch of ``N + 1`` alone: image ``b``'s logits are those of
    ``net(cat([support, x[b:b+1]]))[-1]`` with transductive batch norm, whatever else is
    in the call. The support images are a buffer, so they travel inside an exported program.

    Shape:
        ``[B, C, H, W] -> [B, ways]``; ``support`` is ``[N, C, H, W]``.
    """

    def __init__(self, net: nn.Module, support: Tensor):
        super().__init__()
        self.net = net
        self.register_buffer("support", support.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        n = self.support.shape[0]
        support = self.support.unsqueeze(0).expand(x.shape[0], *self.support.shape)
        batches = torch.cat([support, x.unsqueeze(1)], dim=1)  # [B, N + 1, C, H, W]
        out = self.net(batches.reshape(-1, *x.shape[1:]))
        return out.reshape(x.shape[0], n + 1, *out.shape[1:])[:, -1]


def check_norm(norm: str) -> None:
    """Refuse a reading that is none of `NORMS`.

    Raises:
        ValueError: ``norm`` unknown, named with the choices.
    """
    if norm not in NORMS:
        raise ValueError(f"norm={norm!r}; choose one of {', '.join(map(repr, NORMS))}")


def default_norm(learner: MetaLearner | nn.Module) -> Norm:
    """The reading a deployed learner gets unless one is asked for.

    The learner's own evaluation reading (`MetaLearner.evaluation_norm`) where that reading
    classifies each image on its own (``"beside_support"``: Reptile's default), so the
    deployed network reproduces `evaluate`; else ``"support"``: a learner evaluated with
    the whole query set in one batch (``"transductive"``) would, deployed so, classify an
    image by the other images of its call (one image per call: 18.3% on 5-way Omniglot,
    ``docs/deploy.md``), so it gets frozen support statistics, batch-independent.
    """
    if isinstance(learner, MetaLearner) and learner.evaluation_norm == "beside_support":
        return "beside_support"
    return "support"


def adapted_model(
    learner: MetaLearner | nn.Module,
    params: Mapping[str, Tensor],
    *,
    norm: Norm | None = None,
    support_x: Tensor | None = None,
) -> nn.Module:
    """A standalone copy of the network with the adapted weights, in eval mode, no grads.

    Args:
        learner: the learner (or its model) that was adapted.
        params: the adapted weights (`adapt_to_support`), every parameter of the model.
        norm: ``"support"``: every `MetaBatchNorm` becomes a `FrozenBatchNorm` with the
            statistics of ``support_x`` through the adapted network (each image is then
            classified on its own); ``"transductive"``: batch norm uses each call's batch
            statistics, as in training; ``"beside_support"``: each image is classified in a
            batch with ``support_x`` alone (`BesideSupport`). None: `default_norm`. See the
            module docstring for the trade-off.
        support_x: the support images ``[N, C, H, W]`` (needed for ``"support"`` and
            ``"beside_support"``).

    Returns:
        An ``nn.Module`` ``[B, C, H, W] -> [B, ways]`` (logits).

    Raises:
        ValueError: ``params`` lacks a parameter, ``norm`` is unknown, ``support_x`` is
            missing where needed, or the model has no `MetaBatchNorm` to freeze or group.
    """
    norm = default_norm(learner) if norm is None else norm
    check_norm(norm)
    model = copy.deepcopy(learner.model if isinstance(learner, MetaLearner) else learner)
    names = [n for n, _ in model.named_parameters()]
    if missing := [n for n in names if n not in params]:
        raise ValueError(f"params lack {missing[:4]}: pass the full dict adapt_to_support returns")
    model.load_state_dict({**dict(model.named_buffers()), **params}, strict=False)
    model.eval().requires_grad_(False)
    if norm != "transductive" and support_x is None:
        raise ValueError(f"norm={norm!r} needs support_x, the support images [N, C, H, W]")
    return with_norm_reading(model, norm, support_x)


def with_norm_reading(net: nn.Module, norm: Norm, support_x: Tensor | None) -> nn.Module:
    """``net`` (changed in place) in the batch-norm reading ``norm`` (see `adapted_model`).

    The one place the three readings are built: by `adapted_model` from an adapted network,
    and by `metalearn.deploy.package` on the ``meta`` device, to know what a package holds.

    Args:
        net: a network in evaluation mode.
        norm: one of `NORMS`.
        support_x: the support images ``[N, C, H, W]`` (unused by ``"transductive"``).

    Returns:
        ``net`` itself (``"transductive"``, ``"support"``: its `MetaBatchNorm` layers
        frozen at ``support_x``'s statistics) or a `BesideSupport` around it.
    """
    if norm == "transductive":
        return net
    if norm == "support":
        _freeze_batch_norm(net, support_x)
        return net
    _replace_batch_norm(net, norm, lambda m: GroupBatchNorm(len(support_x) + 1, m.weight,
                                                            m.bias, m.eps))  # fmt: skip
    return BesideSupport(net, support_x).eval()


def merge_lora(
    model: nn.Module, params: Mapping[str, Tensor]
) -> tuple[nn.Module, dict[str, Tensor]]:
    """``model`` with every low-rank adapter merged into its layer, and its parameters.

    A `metalearn.models.LoRALinear` or `LoRAConv2d` computes its layer with the weight
    ``W + (alpha / r) * reshape(B A, W.shape)`` (Hu et al., 2021, Eq. 3); merged, it is the
    plain ``nn.Linear``/``nn.Conv2d`` with that weight, under the same name, so the network
    is again the backbone it wraps (what a package names). Without adapters: ``model``
    and ``params`` unchanged.

    Args:
        model: the network (not changed).
        params: its parameters by name (``*.lora_A``, ``*.lora_B`` beside each layer's own).

    Returns:
        ``(plain_model, plain_params)``: a copy without adapters, and its parameters.
    """
    layers = {n: m for n, m in model.named_modules() if isinstance(m, (LoRALinear, LoRAConv2d))}
    if not layers:
        return model, dict(params)
    plain, merged = copy.deepcopy(model), dict(params)
    for name, layer in layers.items():
        a, b = merged.pop(f"{name}.lora_A"), merged.pop(f"{name}.lora_B")
        weight = merged[f"{name}.weight"]
        merged[f"{name}.weight"] = weight + layer.scaling * (b @ a).reshape(weight.shape)
        parent, _, child = name.rpartition(".")
        owner = plain.get_submodule(parent) if parent else plain
        setattr(owner, child, _plain_layer(layer))
    return plain, merged


def _plain_layer(layer: nn.Module) -> nn.Module:
    """The ``nn.Linear``/``nn.Conv2d`` a LoRA layer wraps (its configuration, new weights)."""
    like = dict(device=layer.weight.device, dtype=layer.weight.dtype)
    if isinstance(layer, LoRALinear):
        return nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                         **like)  # fmt: skip
    return nn.Conv2d(layer.in_channels, layer.out_channels, layer.kernel_size, layer.stride,
                     layer.padding, layer.dilation, layer.groups, bias=layer.bias is not None,
                     **like)  # fmt: skip


def _replace_batch_norm(
    model: nn.Module, norm: str, build: Callable[[MetaBatchNorm], nn.Module]
) -> None:
    """Put ``build(m)`` in place of every `MetaBatchNorm` ``m`` of ``model`` (`_batch_norms`)."""
    for name, module in _batch_norms(model, norm).items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, build(module))


def _batch_norms(model: nn.Module, norm: str) -> dict[str, MetaBatchNorm]:
    """Every `MetaBatchNorm` of ``model`` by name.

    Raises:
        ValueError: the model has none (``norm`` would have nothing to change).
    """
    norms = {n: m for n, m in model.named_modules() if isinstance(m, MetaBatchNorm)}
    if not norms:
        raise ValueError(f"norm={norm!r} found no MetaBatchNorm in the model; use 'transductive'")
    return norms


def _freeze_batch_norm(model: nn.Module, support_x: Tensor) -> None:
    """Replace each `MetaBatchNorm` by a `FrozenBatchNorm` holding its support statistics."""
    stats: dict[nn.Module, tuple[Tensor, Tensor]] = {}

    def record(module: nn.Module, inputs: tuple[Tensor, ...]) -> None:
        (x,) = inputs
        dims = (0, *range(2, x.dim()))
        mean = x.mean(dims)  # biased variance, as `metalearn.models.batch_norm`
        centred = x - mean.reshape((1, -1) + (1,) * (x.dim() - 2))
        stats[module] = (mean, (centred**2).mean(dims))

    handles = [m.register_forward_pre_hook(record) for m in _batch_norms(model, "support").values()]
    try:
        with torch.no_grad():
            model(support_x)
    finally:
        for handle in handles:
            handle.remove()
    _replace_batch_norm(model, "support", lambda m: FrozenBatchNorm(*stats[m], m.weight, m.bias,
                                                                    m.eps))  # fmt: skip
