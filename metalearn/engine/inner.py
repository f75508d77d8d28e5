"""The differentiable inner loop: adapt a parameter dict to one task's support set.

MAML's inner update (Finn et al., 2017, Eq. 1), repeated ``steps`` times::

    phi_{s+1} = phi_s - alpha_s * grad_phi L_support(phi_s)

with ``phi_0 = theta``; ``InnerLoop.optimizer`` replaces this update by another
differentiable optimizer's (`metalearn.optim`: momentum, Nesterov, Adam, RMSprop), whose
state is carried from step to step. By default the update is kept in the autograd graph, so
the outer loss differentiates through it exactly (second order). ``first_order=True`` treats each
inner gradient as a constant (FOMAML). Nothing is updated in place: each step returns a new
dict, so ``theta`` is untouched and the graph from ``theta`` to ``phi`` is explicit.

Each step is ``torch.func.grad_and_value`` of the support loss, the same function in a Python
loop over tasks and under ``torch.func.vmap`` over a batch of tasks. ``checkpoint=True``
takes the one other step, `_checkpointed_step`, because torch.func.grad refuses
checkpointing's saved-tensor hooks. The support forward's attention runs the kernel
`metalearn.attention.attention_kernel` names: the math kernel when second order, whose
inner gradient is differentiated again, or under vmap; the fused one for first order.
Arguments that need Python-level control flow on data (``stop``, ``check_finite``) are for
the loop path only.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from metalearn.attention import attention_kernel
from metalearn.optim import SGD, Hyperparameter, InnerOptimizer, State, hyper_at
from metalearn.task import NonFiniteLossError, StopRule

__all__ = ["InnerLoop", "LossFn", "Regularizer", "adapt", "run_inner_loop"]

LossFn = Callable[[Tensor, Tensor], Tensor]
"""``loss_fn(outputs, targets) -> Tensor[]``."""
Regularizer = Callable[[Mapping[str, Tensor]], Tensor]
"""``reg(fast_params) -> Tensor[]``, added to the support loss (iMAML's proximal term)."""

StepFn = Callable[..., tuple[dict[str, Tensor], State, Tensor]]


@dataclass
class InnerLoop:
    """Inner-loop settings shared by the tasks of a meta-batch.

    Attributes:
        steps: inner gradient steps (a `Task` may override it).
        lr: the inner learning rate(s), a `metalearn.optim.Hyperparameter`: a float; a 0-dim
            tensor (learnable); a dict name -> scalar (per parameter tensor) or name ->
            tensor of the parameter's shape (Meta-SGD, elementwise), a name it lacks being
            a parameter not adapted; or a list of those by inner step (MAML++'s LSLR).
        first_order: drop second-order terms (FOMAML): inner gradients are constants.
        adapt_keys: names of the parameters to adapt (ANIL: the head only); the others stay
            theta. None: all parameters the learning rate covers.
        loss_fn: ``loss_fn(outputs, y) -> Tensor[]``.
        checkpoint: recompute each inner step in the backward pass instead of storing its
            activations (loop path only), so memory does not grow with steps.
        optimizer: the inner update (`metalearn.optim`); ``SGD()`` is Eq. 1 and carries no
            state. ``lr`` is its step size.
    """

    steps: int = 1
    lr: Hyperparameter = 0.4
    first_order: bool = False
    adapt_keys: Collection[str] | None = None
    loss_fn: LossFn = F.cross_entropy
    checkpoint: bool = False
    optimizer: InnerOptimizer = field(default_factory=SGD)


def adapt(
    model: nn.Module,
    params: Mapping[str, Tensor],
    support: tuple[Tensor, Tensor],
    *,
    steps: int = 1,
    lr: Hyperparameter = 0.4,
    loss_fn: LossFn = F.cross_entropy,
    first_order: bool = False,
    adapt_keys: Collection[str] | None = None,
    checkpoint: bool = False,
    optimizer: InnerOptimizer | None = None,
    **per_task: Any,
) -> dict[str, Tensor]:
    """Adapt ``params`` to one task's support set; returns the new (fast) parameter dict.

    `run_inner_loop` with its `InnerLoop` given as keywords; `run_inner_loop` also returns
    the support loss before each step.

    Args:
        model: the network, called as ``functional_call(model, {**buffers, **params}, x)``.
        params: theta, a dict name -> tensor (typically ``dict(model.named_parameters())``).
        support: ``(x [N_s, ...], y [N_s, ...])``, the task's support set.
        steps, lr, loss_fn, first_order, adapt_keys, checkpoint: the `InnerLoop` settings.
        optimizer: the inner update (`metalearn.optim`); None: ``SGD()``, Eq. 1.
        **per_task: ``buffers``, ``model_kwargs``, ``regularizer``, ``stop``,
            ``check_finite``, ``task_index``, as for `run_inner_loop`.

    Returns:
        A new dict with every key of ``params`` (adapted where a learning rate applies).
    """
    inner = InnerLoop(steps, lr, first_order, adapt_keys, loss_fn, checkpoint, optimizer or SGD())
    return run_inner_loop(model, params, support, inner, **per_task)[0]


def run_inner_loop(
    model: nn.Module,
    params: Mapping[str, Tensor],
    support: tuple[Tensor, Tensor],
    inner: InnerLoop,
    *,
    buffers: Mapping[str, Tensor] | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    regularizer: Regularizer | None = None,
    stop: StopRule | None = None,
    check_finite: bool = False,
    task_index: int | None = None,
) -> tuple[dict[str, Tensor], Tensor]:
    """Run the inner loop on one task and return the fast weights and the support losses.

    Args:
        model: the network, called as ``functional_call(model, {**buffers, **params}, x)``.
        params: theta, a dict name -> tensor (typically ``dict(model.named_parameters())``).
        support: ``(x [N_s, ...], y [N_s, ...])``, the task's support set.
        inner: the inner-loop settings (``inner.steps`` steps are taken).
        buffers: extra tensors for ``functional_call`` (not adapted).
        model_kwargs: keyword arguments for the model's forward (e.g. a per-task branch).
        regularizer: a term added to the support loss (iMAML's proximal penalty).
        stop: ``stop(step, support_loss) -> bool``, checked before each step; True ends this
            task's inner loop early (loop path only: it reads the loss as a Python float).
        check_finite: raise `NonFiniteLossError` as soon as a support loss is not finite
            (loop path only; under vmap the caller checks the returned losses).
        task_index: the task's index in its meta-batch, for error messages.

    Returns:
        ``(fast_params, support_losses)``: a new dict with every key of ``params`` (adapted
        where a learning rate applies) and the support loss before each step taken,
        ``Tensor[steps_taken]`` (empty when no step was taken).
    """
    if inner.steps < 0:
        raise ValueError(f"steps must be >= 0, got {inner.steps}")
    fast = dict(params)
    keys = [k for k in fast if inner.adapt_keys is None or k in inner.adapt_keys]
    if inner.adapt_keys is not None and (missing := set(inner.adapt_keys) - set(fast)):
        raise ValueError(f"adapt_keys names parameters the model lacks: {sorted(missing)}")
    x, y = support
    fixed = dict(buffers or {})
    kwargs = dict(model_kwargs or {})

    def support_loss(adapted: dict[str, Tensor], rest: dict[str, Tensor]) -> Tensor:
        # The inner gradient is differentiated again unless first order (Eq. 1 inside Eq. 2):
        # then attention runs the math kernel, the fused one having no double backward.
        with attention_kernel(twice_differentiated=not inner.first_order, inputs=x):
            out = functional_call(model, {**fixed, **rest, **adapted}, (x,), kwargs)
        loss = inner.loss_fn(out, y)
        if regularizer is not None:
            loss = loss + regularizer({**rest, **adapted})
        return loss

    step_fn: StepFn = _checkpointed_step if inner.checkpoint else _step
    losses: list[Tensor] = []
    # The optimizer's state (momentum, Adam's moments) of every adaptable parameter, carried
    # from step to step; a parameter not adapted at a step keeps its state.
    state = inner.optimizer.init({k: fast[k] for k in keys})
    for step in range(inner.steps):
        active = [k for k in keys if hyper_at(inner.lr, k, step) is not None]
        adapted = {k: fast[k] for k in active}
        rest = {k: v for k, v in fast.items() if k not in adapted}
        rates = {k: hyper_at(inner.lr, k, step) for k in active}
        own = {k: state[k] for k in active}
        new, new_state, loss = step_fn(support_loss, adapted, rest, inner, rates, own, step)
        if check_finite or stop is not None:
            value = float(loss.detach())  # a sync point: loop path only
            if check_finite and not torch.isfinite(loss):
                raise NonFiniteLossError("support", task_index, step, value)
            if stop is not None and stop(step, value):
                break
        losses.append(loss)
        fast.update(new)
        state.update(new_state)
    if not losses:  # no step taken: an empty loss record on the task's device and dtype
        return fast, x.new_zeros(0, dtype=_float_dtype(x))
    return fast, torch.stack(losses)


def _float_dtype(x: Tensor) -> torch.dtype:
    """``torch.result_type(x, 1.0)``: x's dtype if floating (or complex), else the default.

    Written out because Dynamo cannot put ``torch.result_type`` in a graph, which kept a
    task with no inner step (MAML++'s query passes) from compiling as one.
    """
    return x.dtype if x.is_floating_point() or x.is_complex() else torch.get_default_dtype()


def _step(
    support_loss: Callable[[dict[str, Tensor], dict[str, Tensor]], Tensor],
    adapted: dict[str, Tensor],
    rest: dict[str, Tensor],
    inner: InnerLoop,
    rates: dict[str, float | Tensor],
    state: State,
    step: int,
) -> tuple[dict[str, Tensor], State, Tensor]:
    """One optimizer step on the adapted subset: (new subset, its new state, loss before)."""
    if inner.first_order:
        # FOMAML: the gradient at phi_s is a constant for the outer loss (Finn et al., Sec 5.2).
        adapted_in = {k: v.detach() for k, v in adapted.items()}
        grads, loss = grad_and_value(support_loss)(adapted_in, rest)
        grads = {k: g.detach() for k, g in grads.items()}
    else:
        grads, loss = grad_and_value(support_loss)(adapted, rest)
    new, new_state = inner.optimizer.update(adapted, grads, state, lr=rates, step=step)
    return new, new_state, loss


def _grads_or_zeros(loss: Tensor, inputs: list[Tensor], create_graph: bool) -> list[Tensor]:
    """``torch.autograd.grad`` of ``loss``, zeros for inputs it does not use (as torch.func's)."""
    grads = torch.autograd.grad(loss, inputs, create_graph=create_graph, allow_unused=True)
    return [torch.zeros_like(v) if g is None else g for g, v in zip(grads, inputs)]


def _checkpointed_step(
    support_loss: Callable[[dict[str, Tensor], dict[str, Tensor]], Tensor],
    adapted: dict[str, Tensor],
    rest: dict[str, Tensor],
    inner: InnerLoop,
    rates: dict[str, float | Tensor],
    state: State,
    step: int,
) -> tuple[dict[str, Tensor], State, Tensor]:
    """`_step` under activation checkpointing (``checkpoint=True``, the memory feature).

    torch.func.grad refuses saved-tensor hooks (which checkpointing installs), so the inner
    gradient here comes from ``torch.autograd.grad(create_graph=True)``; the maths is the same.
    The optimizer's state goes in and out of the checkpointed function as tensors.
    """
    names, rest_names = list(adapted), list(rest)
    slots = inner.optimizer.slots()
    n, first_order = len(names), inner.first_order
    flat_state = [t for k in names for t in state[k]]

    def run(*tensors: Tensor) -> tuple[Tensor, ...]:
        a = dict(zip(names, tensors[:n]))
        r = dict(zip(rest_names, tensors[n : n + len(rest_names)]))
        flat = tensors[n + len(rest_names) :]
        s = {k: tuple(flat[i * slots : (i + 1) * slots]) for i, k in enumerate(names)}
        inputs = {k: v.detach().requires_grad_() for k, v in a.items()} if first_order else a
        with torch.enable_grad():
            loss = support_loss(inputs, r)
            grads = _grads_or_zeros(loss, list(inputs.values()), not first_order)
        if first_order:
            grads = [g.detach() for g in grads]
        new, new_s = inner.optimizer.update(a, dict(zip(names, grads)), s, lr=rates, step=step)
        return (*new.values(), *(t for k in names for t in new_s[k]), loss)

    *out, loss = torch_checkpoint(
        run, *adapted.values(), *rest.values(), *flat_state, use_reentrant=False
    )
    new_state = {k: tuple(out[n + i * slots : n + (i + 1) * slots]) for i, k in enumerate(names)}
    return dict(zip(names, out[:n])), new_state, loss
