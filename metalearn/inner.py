"""The differentiable inner loop: `adapt` a parameter dict to one task's support set.

MAML's inner update (Finn et al., 2017, Eq. 1), repeated ``steps`` times::

    phi_{s+1} = phi_s - alpha_s * grad_phi L_support(phi_s)

with ``phi_0 = theta``. By default the update is kept in the autograd graph, so the outer
loss differentiates through it exactly (second order). ``first_order=True`` treats each
inner gradient as a constant (FOMAML). Nothing is updated in place: each step returns a new
dict, so ``theta`` is untouched and the graph from ``theta`` to ``phi`` is explicit.

The same function runs in a Python loop over tasks or under ``torch.func.vmap`` over a
batch of tasks; arguments that need Python-level control flow on data (``stop``,
``check_finite``) are for the loop path only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from metalearn.functional import transforms_active
from metalearn.models import fused_norm

__all__ = ["LearningRate", "NonFiniteLossError", "adapt", "adapt_with_losses", "lr_for"]

LossFn = Callable[[Tensor, Tensor], Tensor]
"""``loss_fn(outputs, targets) -> Tensor[]``."""
StopRule = Callable[[int, float], bool]
"""``stop(step, support_loss) -> bool``: stop before taking step ``step`` (0-based)."""
Regularizer = Callable[[Mapping[str, Tensor]], Tensor]
"""``reg(fast_params) -> Tensor[]``, added to the support loss (iMAML's proximal term)."""

_StepRate = float | Tensor | Mapping[str, float | Tensor]
LearningRate = _StepRate | Sequence[_StepRate]
"""A float; a 0-dim tensor (learnable); a dict name -> scalar (per parameter tensor) or name
-> tensor of the parameter's shape (Meta-SGD, elementwise); or a list/tuple of those indexed
by inner step (MAML++'s per-layer per-step rates, LSLR). A list shorter than the number of
steps repeats its last entry."""


class NonFiniteLossError(FloatingPointError):
    """A support or query loss became NaN or infinite; names the task and inner step."""

    def __init__(self, kind: str, task_index: int | None, step: int | None, value: float):
        self.kind, self.task_index, self.step, self.value = kind, task_index, step, value
        where = f"task {task_index}" if task_index is not None else "the task"
        at = f" at inner step {step}" if step is not None else ""
        super().__init__(
            f"non-finite {kind} loss ({value}) in {where}{at}; lower the inner learning rate, "
            "check the data for NaNs, or pass on_nonfinite='skip' to drop such tasks"
        )


def lr_for(lr: LearningRate, name: str, step: int) -> float | Tensor | None:
    """The learning rate of parameter ``name`` at inner step ``step``, or None if it has none.

    A dict that lacks ``name`` means that parameter is not adapted.
    """
    if isinstance(lr, (list, tuple)):
        if not lr:
            raise ValueError("the per-step learning-rate list is empty; give at least one entry")
        lr = lr[min(step, len(lr) - 1)]
    if isinstance(lr, Mapping):
        return lr.get(name)
    return lr


def adapt(
    model: nn.Module,
    params: Mapping[str, Tensor],
    support: tuple[Tensor, Tensor],
    **kwargs: Any,
) -> dict[str, Tensor]:
    """Adapt ``params`` to one task's support set; returns the new (fast) parameter dict.

    See `adapt_with_losses` for the arguments; this drops the per-step losses.
    """
    return adapt_with_losses(model, params, support, **kwargs)[0]


def adapt_with_losses(
    model: nn.Module,
    params: Mapping[str, Tensor],
    support: tuple[Tensor, Tensor],
    *,
    steps: int = 1,
    lr: LearningRate = 0.4,
    loss_fn: LossFn = F.cross_entropy,
    first_order: bool = False,
    adapt_keys: Collection[str] | None = None,
    buffers: Mapping[str, Tensor] | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    regularizer: Regularizer | None = None,
    stop: StopRule | None = None,
    checkpoint: bool = False,
    check_finite: bool = False,
    task_index: int | None = None,
) -> tuple[dict[str, Tensor], Tensor]:
    """Run the inner loop on one task and return the fast weights and the support losses.

    Args:
        model: the network, called as ``functional_call(model, {**buffers, **params}, x)``.
        params: theta, a dict name -> tensor (typically ``dict(model.named_parameters())``).
        support: ``(x [N_s, ...], y [N_s, ...])``, the task's support set.
        steps: number of inner gradient steps (may differ per task on the loop path).
        lr: the inner learning rate(s): see `LearningRate`.
        loss_fn: ``loss_fn(outputs, y) -> Tensor[]``.
        first_order: drop second-order terms (FOMAML): inner gradients are constants.
        adapt_keys: names of the parameters to adapt (ANIL: the head only); the others stay
            theta. By default all parameters the learning rate covers.
        buffers: extra tensors for ``functional_call`` (not adapted).
        model_kwargs: keyword arguments for the model's forward (e.g. a per-task branch).
        regularizer: a term added to the support loss (iMAML's proximal penalty).
        stop: ``stop(step, support_loss) -> bool``, checked before each step; True ends this
            task's inner loop early (loop path only: it reads the loss as a Python float).
        checkpoint: recompute each inner step in the backward pass instead of storing its
            activations (loop path only), so memory does not grow with steps.
        check_finite: raise `NonFiniteLossError` as soon as a support loss is not finite
            (loop path only; under vmap the caller checks the returned losses).
        task_index: the task's index in its meta-batch, for error messages.

    Returns:
        ``(fast_params, support_losses)``: a new dict with every key of ``params`` (adapted
        where a learning rate applies) and the support loss before each step taken,
        ``Tensor[steps_taken]`` (empty when no step was taken).
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    fast = dict(params)
    keys = [k for k in fast if adapt_keys is None or k in adapt_keys]
    if adapt_keys is not None and (missing := set(adapt_keys) - set(fast)):
        raise ValueError(f"adapt_keys names parameters the model lacks: {sorted(missing)}")
    x, y = support
    fixed = dict(buffers or {})
    kwargs = dict(model_kwargs or {})

    def support_loss(adapted: dict[str, Tensor], rest: dict[str, Tensor]) -> Tensor:
        out = functional_call(model, {**fixed, **rest, **adapted}, (x,), kwargs)
        loss = loss_fn(out, y)
        if regularizer is not None:
            loss = loss + regularizer({**rest, **adapted})
        return loss

    # Same maths each way; autograd.grad has less overhead where no transform runs.
    step_fn = _checkpointed_step if checkpoint else _step
    if not checkpoint and not transforms_active():
        step_fn = _autograd_step
    losses: list[Tensor] = []
    for step in range(steps):
        active = [k for k in keys if lr_for(lr, k, step) is not None]
        adapted = {k: fast[k] for k in active}
        rest = {k: v for k, v in fast.items() if k not in adapted}
        new, loss = step_fn(support_loss, adapted, rest, lr, step, first_order)
        if check_finite or stop is not None:
            value = float(loss.detach())  # a sync point: loop path only
            if check_finite and not torch.isfinite(loss):
                raise NonFiniteLossError("support", task_index, step, value)
            if stop is not None and stop(step, value):
                break
        losses.append(loss)
        fast.update(new)
    if not losses:  # no step taken: an empty loss record on the task's device and dtype
        return fast, x.new_zeros(0, dtype=torch.result_type(x, 1.0))
    return fast, torch.stack(losses)


def _step(
    support_loss: Callable[[dict[str, Tensor], dict[str, Tensor]], Tensor],
    adapted: dict[str, Tensor],
    rest: dict[str, Tensor],
    lr: LearningRate,
    step: int,
    first_order: bool,
) -> tuple[dict[str, Tensor], Tensor]:
    """One gradient step on the adapted subset; returns (new subset, loss before the step)."""
    if first_order:
        # FOMAML: the gradient at phi_s is a constant for the outer loss (Finn et al., Sec 5.2).
        adapted_in = {k: v.detach() for k, v in adapted.items()}
        grads, loss = grad_and_value(support_loss)(adapted_in, rest)
        grads = {k: g.detach() for k, g in grads.items()}
    else:
        grads, loss = grad_and_value(support_loss)(adapted, rest)
    new = {k: adapted[k] - lr_for(lr, k, step) * grads[k] for k in adapted}
    return new, loss


def _autograd_step(
    support_loss: Callable[[dict[str, Tensor], dict[str, Tensor]], Tensor],
    adapted: dict[str, Tensor],
    rest: dict[str, Tensor],
    lr: LearningRate,
    step: int,
    first_order: bool,
) -> tuple[dict[str, Tensor], Tensor]:
    """`_step` by ``torch.autograd.grad``, for the loop path where no transform runs.

    The same update as `_step`, without ``torch.func.grad``'s per-op wrapping: a loop
    meta-step at 15 query per class was about 6% faster (scripts/bench_maml.py). In a
    second-order step the support loss keeps the elementary batch norm: the fused kernel,
    differentiated twice, drifts further from float64 in float32 (see `fused_norm`); a
    first-order step differentiates it once, so it may take the fused kernel.
    """
    # The outer graph is built only when someone will differentiate it (not in evaluate).
    create = not first_order and torch.is_grad_enabled()
    inputs = {
        k: v if create and v.requires_grad else v.detach().requires_grad_()
        for k, v in adapted.items()
    }
    elementary_norm = fused_norm(False) if create else contextlib.nullcontext()
    with torch.enable_grad(), elementary_norm:
        loss = support_loss(inputs, rest)
        grads = _grads_or_zeros(loss, list(inputs.values()), create)
    new = {k: adapted[k] - lr_for(lr, k, step) * g for k, g in zip(inputs, grads)}
    return new, loss if create else loss.detach()


def _grads_or_zeros(loss: Tensor, inputs: list[Tensor], create_graph: bool) -> list[Tensor]:
    """``torch.autograd.grad`` of ``loss``, zeros for inputs it does not use (as torch.func's)."""
    grads = torch.autograd.grad(loss, inputs, create_graph=create_graph, allow_unused=True)
    return [torch.zeros_like(v) if g is None else g for g, v in zip(grads, inputs)]


def _checkpointed_step(
    support_loss: Callable[[dict[str, Tensor], dict[str, Tensor]], Tensor],
    adapted: dict[str, Tensor],
    rest: dict[str, Tensor],
    lr: LearningRate,
    step: int,
    first_order: bool,
) -> tuple[dict[str, Tensor], Tensor]:
    """`_step` under activation checkpointing.

    torch.func.grad refuses saved-tensor hooks (which checkpointing installs), so the inner
    gradient here comes from ``torch.autograd.grad(create_graph=True)``; the maths is the same.
    """
    names, rest_names = list(adapted), list(rest)
    rates = [lr_for(lr, k, step) for k in names]

    def run(*tensors: Tensor) -> tuple[Tensor, ...]:
        a = dict(zip(names, tensors[: len(names)]))
        r = dict(zip(rest_names, tensors[len(names) :]))
        inputs = {k: v.detach().requires_grad_() for k, v in a.items()} if first_order else a
        with torch.enable_grad():
            loss = support_loss(inputs, r)
            grads = _grads_or_zeros(loss, list(inputs.values()), not first_order)
        if first_order:
            grads = [g.detach() for g in grads]
        return (*(v - rate * g for v, rate, g in zip(a.values(), rates, grads)), loss)

    *new, loss = torch_checkpoint(run, *adapted.values(), *rest.values(), use_reentrant=False)
    return dict(zip(names, new)), loss
