"""Transductive batch norm (`batch_norm`, `MetaBatchNorm`), safe under vmapped second order.

Which parameters of a network are normalisation weights is read from its forward
(`metalearn.normalisation.read_normalisation`); `batch_norm` is marked
`metalearn.normalisation.normalising` so that reading sees it as it sees ``F.batch_norm``.
`norm_parameter_names` (by module type) only sizes the per-parameter state some learners build
before they see an input."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from metalearn.normalisation import normalising

__all__ = ["NORM_TYPES", "MetaBatchNorm", "batch_norm", "norm_parameter_names", "normalise"]


@normalising(statistics="batch")
def batch_norm(
    x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5, stats_rows: int | None = None
) -> Tensor:
    """Transductive batch norm: normalise with the statistics of this batch, always.

    This is MAML's batch norm (Finn et al., 2017): no running statistics, the same in
    training and evaluation, so query examples are normalised with their own batch's
    statistics. It equals ``F.batch_norm(x, None, None, weight, bias, training=True,
    eps=eps)`` (biased variance) but is built from sums and elementwise ops, always, so its
    second derivatives are right under ``vmap``. The fused kernel's are not: its vmapped
    mixed second derivative (the outer derivative through the inner gradient of the norm's
    weight, w.r.t. a weight upstream of it) is wrong: on torch 2.13 in float64, a vmapped
    second-order Conv4 meta-gradient through ``F.batch_norm`` missed finite differences by
    10-72% along three random directions, where this form and the looped kernel agreed to
    1e-8 (``tests/models/test_models.py``). There is no switch to the fused kernel: one form
    serves the vmapped and the looped paths, and nothing global decides between them.

    Args:
        x: input ``[N, C]``, ``[N, C, L]`` or ``[N, C, H, W]``; statistics are taken per
            channel ``C`` over every other dimension (``N``; ``N, L``; ``N, H, W``).
        weight: per-channel scale ``[C]``.
        bias: per-channel shift ``[C]``.
        eps: added to the variance before the square root.
        stats_rows: normalise every row of ``x`` with the statistics of its first
            ``stats_rows`` rows alone (a support set's moments, for the query rows after
            it: meta-dataset's ``transductive_batch_norm = False``); None: of all of them.

    Returns:
        Tensor shaped like ``x``.

    Raises:
        ValueError: ``x`` has no channel dimension, the affine shapes do not match it, or
            ``stats_rows`` is not in ``1..N``.
    """
    if x.dim() < 2:
        raise ValueError(
            f"batch_norm expects input [N, C, *], got shape {tuple(x.shape)}; "
            "add a batch dimension (x.unsqueeze(0)) or a channel dimension"
        )
    channels = x.shape[1]
    if weight.shape != (channels,) or bias.shape != (channels,):
        raise ValueError(
            f"weight {tuple(weight.shape)} and bias {tuple(bias.shape)} must both have shape "
            f"({channels},) to match the input's channel dimension (dim 1 of {tuple(x.shape)})"
        )
    if stats_rows is not None and not 1 <= stats_rows <= x.shape[0]:
        raise ValueError(f"stats_rows={stats_rows} must be in 1..{x.shape[0]}, the batch's rows")
    dims = (0, *range(2, x.dim()))
    shape = (1, channels) + (1,) * (x.dim() - 2)
    ref = x if stats_rows is None else x[:stats_rows]  # the rows the statistics come from
    # Means as sums times 1/N: a mean's backward divides a full-size tensor by N (once in
    # the inner gradient, again in its derivative), a sum's backward only expands, and the
    # 1/N lands on the [1, C, 1, 1] statistics. A vmapped second-order conv4 meta-step was
    # 3-7% faster for it (1 query: 165 -> 154 ms, 15 query: 782 -> 724 ms; 2 threads).
    # torch.var_mean, addcmul or square() gained nothing more.
    inv_n = 1.0 / max(ref.numel() // channels, 1)  # an empty batch gives an empty output
    centred = x - ref.sum(dims, keepdim=True) * inv_n
    own = centred if stats_rows is None else centred[:stats_rows]
    var = (own * own).sum(dims, keepdim=True) * inv_n
    # Fold the scale into one per-channel factor ([1, C, 1, 1]) before touching the big
    # tensor: two full-size ops (mul, add) instead of three.
    scale = torch.rsqrt(var + eps) * weight.reshape(shape)
    return centred * scale + bias.reshape(shape)


class MetaBatchNorm(nn.Module):
    """`batch_norm` as a module: learnable per-channel ``weight``/``bias``, no buffers.

    Args:
        num_features: number of channels ``C``.
        eps: added to the variance before the square root.

    Shape:
        ``[N, C]``, ``[N, C, L]`` or ``[N, C, H, W]`` in and out.
    """

    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__()
        if num_features < 1:
            raise ValueError(f"num_features must be >= 1, got {num_features}")
        self.num_features = num_features
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))

    def forward(self, x: Tensor, stats_rows: int | None = None) -> Tensor:
        return batch_norm(x, self.weight, self.bias, self.eps, stats_rows)

    def extra_repr(self) -> str:
        return f"{self.num_features}, eps={self.eps}"


NORM_TYPES: tuple[type[nn.Module], ...] = (
    MetaBatchNorm,
    nn.modules.batchnorm._NormBase,  # BatchNorm1d/2d/3d, SyncBatchNorm, InstanceNorm, lazy ones
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
)
"""The normalisation layers `norm_parameter_names` recognises, by module type: before any
input is seen, the only guess there is (what the inner loop adapts is read from the forward)."""


def normalise(norm: nn.Module, x: Tensor, stats_rows: int | None) -> Tensor:
    """``norm(x)``, with the statistics of ``x``'s first ``stats_rows`` rows when set (the
    ``norm_rows`` of the backbones' forward, threaded to each of their norm layers).

    Raises:
        ValueError: ``stats_rows`` set for a layer other than `MetaBatchNorm` (only it
            takes its statistics from part of the batch).
    """
    if stats_rows is None:
        return norm(x)
    if not isinstance(norm, MetaBatchNorm):
        raise ValueError(f"norm_rows normalises with the first rows' statistics, which only "
                         f"MetaBatchNorm computes; this network's {type(norm).__name__} "
                         "does not: build it with MetaBatchNorm or drop norm_rows")  # fmt: skip
    return norm(x, stats_rows)


def norm_parameter_names(model: nn.Module) -> list[str]:
    """Names of the parameters (scale and shift) of every normalisation layer of ``model``,
    by module type (`NORM_TYPES`), in ``named_parameters`` order.

    A guess made before any input is seen, used only to size the per-parameter state a
    learner builds at construction (Meta-SGD's and MAML++'s rates, learned inner
    hyperparameters) as it was sized before. What the inner loop holds out is read from the
    forward (`metalearn.algorithms.base.MetaLearner.fast_weight_names`): a rate built for a
    parameter the forward shows to be a normalisation weight is left unused.
    """
    norms = set()
    for prefix, module in model.named_modules():
        if isinstance(module, NORM_TYPES):
            norms |= {f"{prefix}.{p}" if prefix else p for p, _ in module.named_parameters()}
    return [name for name, _ in model.named_parameters() if name in norms]
