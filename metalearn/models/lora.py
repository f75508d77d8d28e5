"""Low-rank adapters (LoRA, Hu et al., 2021) as the fast weights of the inner loop.

A `LoRALinear` computes (Hu et al., 2021, Eq. 3, with the scaling of their Sec. 4.1)::

    h = W x + b + (alpha / r) * B A x,    A: [r, in], B: [out, r], B = 0 at the start

so at initialisation it computes exactly what the wrapped linear layer does. A `LoRAConv2d`
applies the same update to a convolution's kernel seen as the ``[out, in * kh * kw]``
matrix it multiplies each (unfolded) input patch by::

    K' = K + (alpha / r) * reshape(B A, K.shape),    A: [r, in * kh * kw], B: [out, r]

so the update has rank at most ``r`` as that matrix, whatever the kernel size. A
`LoRAMultiheadAttention` gives `nn.MultiheadAttention`'s packed input projection
(``in_proj_weight``, ``[3 E, E]``: queries, keys and values) and its output projection
(``out_proj.weight``, ``[E, E]``) one rank-``r`` update each, merged into the weights the
attention reads. For
meta-learning, adapt only the adapters in the inner loop (the base weights are frozen by
convention, not by ``requires_grad``)::

    model = add_lora(Conv4(), rank=4, alpha=4.0, layers=(nn.Linear, nn.Conv2d))
    model = add_lora(encoder, rank=4, layers=(nn.Linear, nn.MultiheadAttention))
    learner = MAML(model, adapt_keys=lora_keys(model))

The outer loop then meta-learns everything it is given: pass the optimiser only
``lora_keys``' parameters to freeze the base in the outer loop as well.
`metalearn.algorithms.LoRAMAML` is this recipe as an algorithm.

Everything runs through ``functional_call``: the adapters are ordinary parameters named
``<layer>.lora_A`` and ``<layer>.lora_B`` beside the layer's own ``weight`` and ``bias``
(an attention layer's: ``<layer>.in_proj_lora_A``, ``in_proj_lora_B``, ``out_proj_lora_A``,
``out_proj_lora_B``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Collection

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LoRAConv2d", "LoRALinear", "LoRAMultiheadAttention", "add_lora", "lora_keys"]

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


class LoRAMultiheadAttention(nn.Module):
    """`nn.MultiheadAttention` whose two projections carry trainable low-rank updates.

    ``F.multi_head_attention_forward`` runs with the merged weights::

        W_in'  = W_in  + (alpha / r) B_in A_in,    A_in:  [r, E], B_in:  [3 E, r]
        W_out' = W_out + (alpha / r) B_out A_out,  A_out: [r, E], B_out: [E, r]

    (Hu et al., 2021, Sec. 4.2 adapt the attention's projection matrices; the packed ``W_in``
    holds the query, key and value projections, so one update of rank ``r`` spans all three.)
    The base layer's ``in_proj_weight``, ``in_proj_bias`` and ``out_proj`` (its ``weight``
    and ``bias``) are kept under their names, shared, not copied; initialisation as
    `LoRALinear`: ``B = 0``, so the copy computes what the base layer does.

    `nn.TransformerEncoderLayer`'s fused inference path (``torch._transformer_encoder_layer_fwd``)
    reads ``self_attn.in_proj_weight`` itself and would skip the update: the wrapper reports
    ``_qkv_same_embed_dim = False``, one of the conditions that path checks, so the layer always
    calls this module's forward.

    Args:
        base: the attention layer (one packed input projection: ``kdim = vdim = embed_dim``).
        rank: ``r``, the rank of each update (>= 1).
        alpha: the scale numerator; each update is multiplied by ``alpha / rank``.

    Shape:
        as ``base``: ``query [N, L, E]`` (``[L, N, E]`` unless ``batch_first``) to
        ``(output [N, L, E], weights [N, L, S] or None)``.
    """

    ADAPTERS = ("in_proj_lora_A", "in_proj_lora_B", "out_proj_lora_A", "out_proj_lora_B")

    def __init__(self, base: nn.MultiheadAttention, rank: int, alpha: float = 1.0) -> None:
        super().__init__()
        if not isinstance(base, nn.MultiheadAttention):
            raise ValueError(
                f"LoRAMultiheadAttention wraps an nn.MultiheadAttention, got {type(base).__name__}"
            )
        if base.in_proj_weight is None:
            raise ValueError(
                "LoRAMultiheadAttention needs one packed input projection (kdim = vdim = "
                "embed_dim); leave this layer out of add_lora's target"
            )
        _check_rank(rank)
        self.embed_dim, self.num_heads = base.embed_dim, base.num_heads
        self.dropout, self.batch_first = base.dropout, base.batch_first
        self.add_zero_attn, self.rank, self.alpha = base.add_zero_attn, rank, alpha
        self.scaling = alpha / rank
        self._qkv_same_embed_dim = False  # keeps the encoder layer's fused path off (above)
        self.in_proj_weight, self.in_proj_bias = base.in_proj_weight, base.in_proj_bias
        self.bias_k, self.bias_v, self.out_proj = base.bias_k, base.bias_v, base.out_proj
        self.in_proj_lora_A, self.in_proj_lora_B = _adapters(
            base.in_proj_weight, rank, self.embed_dim
        )
        self.out_proj_lora_A, self.out_proj_lora_B = _adapters(
            base.out_proj.weight, rank, self.embed_dim
        )

    def merged_weights(self) -> tuple[Tensor, Tensor]:
        """``(W_in' [3 E, E], W_out' [E, E])``, the projections the attention applies."""
        w_in = self.in_proj_weight + self.scaling * (self.in_proj_lora_B @ self.in_proj_lora_A)
        update = self.out_proj_lora_B @ self.out_proj_lora_A
        return w_in, self.out_proj.weight + self.scaling * update

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """`nn.MultiheadAttention.forward` at the merged weights (same arguments)."""
        if self.batch_first:  # F.multi_head_attention_forward takes [L, N, E]
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        w_in, w_out = self.merged_weights()
        out, weights = F.multi_head_attention_forward(
            query, key, value, self.embed_dim, self.num_heads, w_in, self.in_proj_bias,
            self.bias_k, self.bias_v, self.add_zero_attn, self.dropout, w_out,
            self.out_proj.bias, training=self.training, key_padding_mask=key_padding_mask,
            need_weights=need_weights, attn_mask=attn_mask,
            average_attn_weights=average_attn_weights, is_causal=is_causal,
        )  # fmt: skip
        return (out.transpose(0, 1) if self.batch_first else out), weights

    def extra_repr(self) -> str:
        return f"{self.embed_dim}, num_heads={self.num_heads}, rank={self.rank}, alpha={self.alpha}"


_WRAPPERS: dict[type[nn.Module], type[nn.Module]] = {
    nn.Linear: LoRALinear,
    nn.Conv2d: LoRAConv2d,
    nn.MultiheadAttention: LoRAMultiheadAttention,
}
_ADAPTED = (LoRALinear, LoRAConv2d, LoRAMultiheadAttention)


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
            `LoRALinear`), ``nn.Conv2d`` (as `LoRAConv2d`) and ``nn.MultiheadAttention`` (as
            `LoRAMultiheadAttention`). Linear only by default. An attention layer's
            ``out_proj`` is never adapted as a linear layer: the attention reads its weight
            without calling it, so an adapter there would change nothing.

    Returns:
        The adapted copy; its parameter names are the original ones plus ``<layer>.lora_A``
        and ``<layer>.lora_B`` per adapted layer (see `lora_keys`).
    """
    kinds = tuple(layers)
    if not kinds or any(k not in _WRAPPERS for k in kinds):
        raise ValueError(
            f"layers={[getattr(k, '__name__', k) for k in kinds]} cannot be adapted; pass a "
            "non-empty subset of (nn.Linear, nn.Conv2d, nn.MultiheadAttention)"
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
        for p in getattr(module, "ADAPTERS", ("lora_A", "lora_B"))
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
    # An attention layer's out_proj is an nn.Linear its forward never calls (it reads the
    # weight): not a candidate, the attention layer itself is.
    unused = {
        f"{n}.out_proj" if n else "out_proj"
        for n, m in model.named_modules()
        if isinstance(m, nn.MultiheadAttention)
    }
    candidates = {
        n: m for n, m in model.named_modules() if isinstance(m, kinds) and n not in unused
    }
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
