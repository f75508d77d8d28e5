"""Safe custom autograd Functions: finite values, finite (optionally clipped) gradients.

Each Function here is written in the ``setup_context`` style, so it works under the
``torch.func`` transforms (``grad``, ``vmap``, ``jvp`` and compositions such as the
forward-over-reverse HVP ``jvp(grad(f))``), and its ``backward`` is built from ordinary
differentiable torch ops, so it can be differentiated again (``gradgradcheck``, MAML-style
second-order meta-gradients). Call them through the lowercase functions:

* `safe_sigmoid`: sigmoid from ``exp(-|x|)`` only, an accurate derivative in the tails and
  an elementwise gradient clip.
* `clip_grad`: identity forward, backward rescales the incoming gradient to a maximum norm.
* `safe_log`: ``log(max(x, eps))`` whose gradient ``1 / max(x, eps)`` does not vanish below
  ``eps``.
* `safe_log_softmax`: log-softmax saturated at ``-finfo.max`` instead of ``-inf``, with the
  exact (finite) log-softmax gradient.
* `safe_cross_entropy`: cross entropy on top of it, finite where ``F.cross_entropy`` gives
  ``nan``/``inf`` (a zero target probability on a ``-inf`` logit, label smoothing onto a
  masked class, logits at float max).

Two conventions hold throughout. Forward-mode derivatives (``jvp``) are those of the forward
function as computed (clipping is a reverse-mode intervention and does not apply to
tangents). A value saturated to stay finite keeps the gradient of the unsaturated function.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor
from torch.autograd import Function

__all__ = [
    "clip_grad",
    "safe_cross_entropy",
    "safe_log",
    "safe_log_softmax",
    "safe_sigmoid",
]


def _check_positive(name: str, value: float, fix: str, *, allow_inf: bool = False) -> float:
    """`value` as a float if it is > 0 (and finite unless `allow_inf`), else a ValueError."""
    value = float(value)
    # `not value > 0` also rejects nan, which `value <= 0` would let through.
    if not value > 0 or (math.isinf(value) and not allow_inf):
        kind = "a positive number" if allow_inf else "a positive finite number"
        raise ValueError(f"{name} must be {kind}, got {value}; {fix}")
    return value


# --------------------------------------------------------------------------- sigmoid


def _sigmoid_derivative(x: Tensor) -> Tensor:
    """s(x)(1 - s(x)) = e / (1 + e)^2 with e = exp(-|x|): accurate to the last bit at any x.

    ``s * (1 - s)`` from the output is 0 once ``s`` rounds to 1 (x >= 37 in float64), though
    the true value is about exp(-x). The form in ``|x|`` is exact because the derivative is
    even, and it stays differentiable at 0 (``abs``'s subgradient 0 matches d'(0) = 0).
    """
    e = torch.exp(-x.abs())
    return e / (1 + e) ** 2


class _SafeSigmoid(Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, grad_clip: float) -> Tensor:
        # exp(-|x|) lies in [0, 1], so nothing overflows even at |x| = float max.
        e = torch.exp(-x.abs())
        return torch.where(x >= 0, 1.0, e) / (1 + e)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, float], output: Tensor) -> None:
        x, grad_clip = inputs
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)
        ctx.grad_clip = grad_clip

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None]:
        (x,) = ctx.saved_tensors
        c = ctx.grad_clip
        return (grad_out * _sigmoid_derivative(x)).clamp(-c, c), None

    @staticmethod
    def jvp(ctx: Any, x_t: Tensor, _grad_clip_t: None) -> Tensor:
        (x,) = ctx.saved_tensors
        return x_t * _sigmoid_derivative(x)


def safe_sigmoid(x: Tensor, grad_clip: float | None = 1.0) -> Tensor:
    """Sigmoid ``1 / (1 + exp(-x))`` with an elementwise-clipped, twice-differentiable gradient.

    Values equal ``torch.sigmoid`` (which is already overflow-free); what this adds is the
    backward:

    * **Clipping.** The gradient passed to ``x`` is
      ``clamp(grad_out * s(x) * (1 - s(x)), -grad_clip, grad_clip)``: the clamp applies to
      the *product* of the incoming gradient and the local derivative, i.e. to exactly what
      reaches ``x``, element by element. (The local derivative alone is at most 1/4, so
      clipping it would do nothing.)
    * **Second order.** The backward is that formula in differentiable ops, so a double
      backward differentiates the clipped gradient as computed: where the clip is inactive
      this is the exact second derivative; where it is active the clipped gradient is the
      constant ``±grad_clip`` and its derivatives (in ``x`` and in ``grad_out``) are 0.
    * **Forward mode.** ``jvp`` is the exact, unclipped ``tangent * s (1 - s)``. So
      ``jvp(grad(f))`` is the exact Jacobian of the clipped-gradient map ``x -> grad f``;
      a double backward clips again in its second pass, so the two HVPs agree wherever
      neither pass clips (always, for a large enough ``grad_clip``).
    * **Tails.** ``s (1 - s)`` is computed as ``exp(-|x|) / (1 + exp(-|x|))^2``, accurate
      where ``torch.sigmoid``'s gradient rounds to 0 (x >= 37 in float64, x >= 17 in float32).

    Args:
        x: input of any shape ``[*]``; any finite or infinite value (nan stays nan).
        grad_clip: elementwise bound on the gradient reaching ``x``; ``None`` for no clip.

    Returns:
        ``s(x)``, shape ``[*]``, in ``[0, 1]``.
    """
    if grad_clip is None:
        grad_clip = math.inf
    grad_clip = _check_positive(
        "grad_clip",
        grad_clip,
        "pass a positive bound, or grad_clip=None for no clipping",
        allow_inf=True,
    )
    return _SafeSigmoid.apply(x, grad_clip)


# --------------------------------------------------------------------------- clip_grad


def _rescale_to_norm(g: Tensor, max_norm: float) -> Tensor:
    """``g * min(1, max_norm / ||g||)``, exact ``g`` when unclipped, and no overflow.

    ``||g||`` computed directly squares the entries, which overflows from about 1e19 in
    float32 (``linalg.vector_norm`` gives inf there, and the rescaled gradient would be 0).
    So ``g`` is first divided by its largest magnitude ``a``: ``d = g / a`` has entries in
    [-1, 1], ``u = ||d|| = ||g|| / a`` lies in [1, sqrt(n)], and the clipped gradient is
    ``d * (max_norm / u)``. Mathematically ``d / u = g / ||g||`` does not depend on ``a``,
    so its derivatives (for a double backward) are those of the plain formula.
    """
    if g.numel() == 0:  # amax has no identity; an empty gradient has nothing to clip
        return g
    # The clamp_mins only act on zero or subnormal g, which is never clipped; they keep the
    # clipped branch finite there, because `where` differentiates both branches and a nan
    # in the unused one would still reach the gradient (0 * nan).
    a = g.abs().amax().clamp_min(torch.finfo(g.dtype).tiny)
    d = g / a
    u = torch.linalg.vector_norm(d)
    clipped = d * (max_norm / u.clamp_min(1.0))
    # a * u may overflow to inf, which still compares correctly.
    return torch.where(a * u > max_norm, clipped, g)


class _ClipGrad(Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, max_norm: float) -> Tensor:
        # A copy, not `x.view_as(x)`: with a view output, torch (2.13) requires the jvp to
        # return a view too, which fails when forward-mode AD is batched by vmap
        # (gradcheck's check_batched_forward_grad); one copy costs far less than the backward.
        return x.clone()

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, float], output: Tensor) -> None:
        ctx.max_norm = inputs[1]

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None]:
        return _rescale_to_norm(grad_out, ctx.max_norm), None

    @staticmethod
    def jvp(ctx: Any, x_t: Tensor, _max_norm_t: None) -> Tensor:
        return x_t.clone()


def clip_grad(x: Tensor, max_norm: float) -> Tensor:
    """Identity on ``x`` whose backward rescales the incoming gradient to norm <= max_norm.

    The gradient reaching ``x`` is ``g * min(1, max_norm / ||g||)``, with ``||g||`` the
    Euclidean norm over *all* elements of ``g`` (the whole tensor, like
    ``torch.nn.utils.clip_grad_norm_`` on a single tensor): its direction is kept, only its
    length is capped. Under ``torch.func.vmap`` the backward runs per batch element, so the
    norm is per example (what per-example clipping, e.g. DP-SGD, wants); without vmap a
    ``[B, D]`` tensor is clipped as one vector of ``B * D`` numbers.

    A gradient within the bound passes unchanged (bit for bit). The norm is computed without
    overflow, so a float32 gradient of 1e30 is still rescaled along its direction rather
    than zeroed; a gradient holding inf or nan passes through unchanged, so a
    finiteness check downstream still fires. The backward is differentiable (a double backward
    differentiates the map ``g -> g * min(1, max_norm / ||g||)``). Forward mode is the
    identity: clipping applies to gradients, not tangents.

    Args:
        x: any tensor ``[*]``.
        max_norm: the largest gradient norm let through, positive and finite.

    Returns:
        A copy of ``x``, shape ``[*]``.
    """
    max_norm = _check_positive(
        "max_norm",
        max_norm,
        "pass the largest gradient norm to allow (e.g. 1.0); "
        "to leave the gradient unclipped, do not wrap x in clip_grad",
    )
    return _ClipGrad.apply(x, max_norm)


# --------------------------------------------------------------------------- log


class _SafeLog(Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor, eps: float) -> Tensor:
        return torch.log(x.clamp_min(eps))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, float], output: Tensor) -> None:
        x, eps = inputs
        ctx.save_for_backward(x)
        ctx.save_for_forward(x)
        ctx.eps = eps

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None]:
        (x,) = ctx.saved_tensors
        return grad_out / x.clamp_min(ctx.eps), None

    @staticmethod
    def jvp(ctx: Any, x_t: Tensor, _eps_t: None) -> Tensor:
        (x,) = ctx.saved_tensors
        return x_t / x.clamp_min(ctx.eps)


def safe_log(x: Tensor, eps: float = 1e-12) -> Tensor:
    """``log(max(x, eps))`` with the gradient ``1 / max(x, eps)`` everywhere.

    For ``x >= eps`` this is ``torch.log`` with its exact gradient ``1 / x``. Below ``eps``
    (including 0 and small negative round-off in probabilities) the value is ``log(eps)``
    and the gradient is ``1 / eps``: finite, unlike ``torch.log`` (``-inf`` value, ``inf``
    gradient at 0), and not zero, unlike ``torch.log(x.clamp_min(eps))``, whose gradient
    vanishes exactly where a loss ``-log p`` most needs to push ``p`` up. It is a surrogate
    gradient there (the value is flat), so ``gradcheck`` holds only for ``x > eps``.
    Forward mode uses the same ``1 / max(x, eps)``, so ``jvp`` and ``vjp`` agree.

    Args:
        x: input ``[*]``; nan stays nan.
        eps: the floor, positive and at least ``torch.finfo(x.dtype).tiny`` so that it is a
            normal number in ``x``'s dtype and ``1 / eps`` is finite.

    Returns:
        ``log(max(x, eps))``, shape ``[*]``, at least ``log(eps)``.
    """
    eps = _check_positive("eps", eps, "pass a small positive floor such as 1e-12")
    tiny = torch.finfo(x.dtype).tiny
    if eps < tiny:
        raise ValueError(
            f"eps={eps} is below the smallest normal {x.dtype} ({tiny}), so it would round to "
            f"0 or lose precision; pass eps >= {tiny}"
        )
    return _SafeLog.apply(x, eps)


# --------------------------------------------------------------------------- log-softmax


class _SafeLogSoftmax(Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(logits: Tensor, dim: int) -> Tensor:
        out = torch.log_softmax(logits, dim)
        return out.clamp_min(torch.finfo(out.dtype).min)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor, int], output: Tensor) -> None:
        logits, dim = inputs
        ctx.save_for_backward(logits)
        ctx.save_for_forward(logits)
        ctx.dim = dim

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None]:
        (logits,) = ctx.saved_tensors
        # Softmax is recomputed from the logits rather than exp(output): the graph of this
        # backward (used by a double backward) then never holds a saturated or -inf value.
        p = torch.softmax(logits, ctx.dim)
        return grad_out - p * grad_out.sum(ctx.dim, keepdim=True), None

    @staticmethod
    def jvp(ctx: Any, logits_t: Tensor, _dim_t: None) -> Tensor:
        (logits,) = ctx.saved_tensors
        p = torch.softmax(logits, ctx.dim)
        return logits_t - (p * logits_t).sum(ctx.dim, keepdim=True)


def safe_log_softmax(logits: Tensor, dim: int = -1) -> Tensor:
    """``log_softmax`` saturated at ``-finfo.max`` instead of ``-inf``, with its exact gradient.

    ``torch.log_softmax`` is already finite for finite logits whose gaps fit in the dtype
    (e.g. ±1e30), and its gradient is finite even at a ``-inf`` logit. Its *value* is
    ``-inf`` at a ``-inf`` (masked) logit, or when a gap overflows (logits ±float max in
    float32), and ``0 * -inf`` is nan in anything downstream, e.g. ``(q * log_p).sum()``
    with ``q = 0`` there. Here that value is ``-torch.finfo(dtype).max`` (the most negative
    finite number), so ``0 * log_p = 0``; everywhere else the values equal
    ``torch.log_softmax``. The gradient (and jvp) is the exact log-softmax one,
    ``g - softmax * sum(g)``, finite for any finite ``g``.

    Args:
        logits: ``[..., K, ...]``, finite or ``-inf``; a ``+inf`` logit, or a slice with every
            logit ``-inf``, has no distribution and gives nan (as in torch).
        dim: the class dimension.

    Returns:
        Log-probabilities shaped like ``logits``, each in ``[-finfo.max, 0]``.
    """
    return _SafeLogSoftmax.apply(logits, dim)


# --------------------------------------------------------------------------- cross entropy


class _Saturate(Function):
    """Clamp to the finite range of the dtype; the gradient passes straight through."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: Tensor) -> Tensor:
        info = torch.finfo(x.dtype)
        return x.clamp(info.min, info.max)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Tensor], output: Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> Tensor:
        return grad_out

    @staticmethod
    def jvp(ctx: Any, x_t: Tensor) -> Tensor:
        return x_t.clone()


def safe_cross_entropy(
    logits: Tensor,
    targets: Tensor,
    *,
    label_smoothing: float = 0.0,
    reduction: Literal["mean", "sum", "none"] = "mean",
) -> Tensor:
    """Cross entropy ``-sum_k q_k log softmax(logits)_k`` that is finite for any finite input.

    Equals ``F.cross_entropy`` (class dimension last) wherever that is finite. It adds:

    * **Zero target probability.** A soft target ``q_k = 0`` contributes exactly 0, even on
      a ``-inf`` (masked) logit, where ``F.cross_entropy`` gives nan (``0 * -inf``). So a
      batch of tasks padded to a common number of classes, with ``-inf`` logits and zero
      target mass on the padding, gives the exact loss of the unpadded tasks. (To smooth
      labels over the real classes only, build such soft targets; ``label_smoothing``
      spreads mass over all ``K`` classes, as in torch.)
    * **Saturation.** Where the true loss is infinite or beyond the dtype (target mass on a
      ``-inf`` logit, label smoothing onto one, logits ±float max in float32) the value is
      at most ``finfo.max`` instead of ``inf`` (read it as "infinite"), and the gradient is
      that of the exact loss: ``softmax(logits) * sum(q) - q`` per example, finite.

    Args:
        logits: ``[..., K]``, finite or ``-inf`` (see `safe_log_softmax`).
        targets: class indices ``[...]`` (an integer tensor), or class probabilities
            ``[..., K]`` (a float tensor; may require grad, its gradient is ``-log_p``).
        label_smoothing: ``eps`` in ``[0, 1]``; targets become ``(1 - eps) q + eps / K``.
        reduction: ``"mean"`` over examples, ``"sum"``, or ``"none"`` for the ``[...]``
            per-example losses.

    Returns:
        The loss: a scalar, or ``[...]`` with ``reduction="none"``.
    """
    _check_targets(logits, targets)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}; 0 disables it")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"unknown reduction {reduction!r}; choose 'mean', 'sum' or 'none'")
    log_p = safe_log_softmax(logits, dim=-1)
    if targets.is_floating_point():
        loss = -(targets * log_p).sum(-1)
    else:
        loss = -log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if label_smoothing:
        loss = (1 - label_smoothing) * loss - label_smoothing * log_p.mean(-1)
    # Each term is finite, but a sum of terms near float max may round past it.
    loss = _Saturate.apply(loss)
    if reduction == "none":
        return loss
    return _Saturate.apply(loss.mean() if reduction == "mean" else loss.sum())


def _check_targets(logits: Tensor, targets: Tensor) -> None:
    if logits.dim() < 1:
        raise ValueError("logits must have a class dimension (last); got a 0-dim tensor")
    if targets.is_floating_point():
        if targets.shape != logits.shape:
            raise ValueError(
                f"probability targets have shape {tuple(targets.shape)} but logits "
                f"{tuple(logits.shape)}; pass one probability per logit, or class indices"
            )
    elif targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"class-index targets have shape {tuple(targets.shape)}, expected "
            f"{tuple(logits.shape[:-1])} (logits without the last, class, dimension)"
        )
