"""What every differentiable inner optimizer shares: hyperparameters, state, one update.

An inner optimizer is a pure function of (params, grads, state, hyperparameters) returning
(new_params, new_state). Parameters, gradients and state are dicts name -> tensor; nothing is
updated in place and nothing is detached, so the new parameters stay in the autograd graph
of the old ones, of the gradients and of every hyperparameter that is a tensor (second
order, and meta-learned hyperparameters, come for free). The same function runs per task
under ``torch.func.vmap`` and in a Python loop.

A hyperparameter (`Hyperparameter`) is, as the engine's inner learning rate:

* a float (fixed);
* a tensor (learnable; 0-dim, or of the parameter's shape for elementwise values);
* a dict name -> float or tensor (per parameter tensor; a name it lacks is not adapted when
  the dict is the learning rate);
* a list or tuple of those indexed by inner step (per step); a list shorter than the number
  of steps repeats its last entry.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import fields, replace
from typing import ClassVar

import torch
from torch import Tensor

from metalearn.functional import detached

__all__ = [
    "Hyperparameter",
    "InnerOptimizer",
    "State",
    "check_hyperparameter",
    "hyper_at",
    "safe_sqrt",
]

_Value = float | Tensor | Mapping[str, float | Tensor]
Hyperparameter = _Value | Sequence[_Value]
"""A float, a tensor, a dict name -> value, or a list of those by inner step."""
State = dict[str, tuple[Tensor, ...]]
"""An optimizer's state: parameter name -> its slots (momentum buffer, Adam's moments)."""


def hyper_at(value: Hyperparameter, name: str, step: int) -> float | Tensor | None:
    """The value of a hyperparameter for parameter ``name`` at inner step ``step`` (0-based).

    None when ``value`` is a dict that lacks ``name``.
    """
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"the per-step list of a hyperparameter is empty (for {name!r})")
        value = value[min(step, len(value) - 1)]
    if isinstance(value, Mapping):
        return value.get(name)
    return value


def check_hyperparameter(kind: str, value: Hyperparameter, name: str | None = None) -> None:
    """Refuse a fixed value of a hyperparameter outside the range where its update is defined.

    Decay rates (``momentum``, ``beta1``, ``beta2``, ``alpha``) must lie in [0, 1): Adam's
    bias correction ``1 - beta1^t`` is 0 at ``beta1 = 1`` and ``sqrt(1 - beta2^t)`` is
    imaginary above 1, and a rate at or above 1 lets the state grow without bound. ``eps``
    must be finite and >= 0 (``torch.optim``'s rule; 0 is the form higher's Adam shares with
    this one), ``lr`` finite. Every float of a dict or per-step list is checked; tensors are
    not (learned values move during training).

    Args:
        kind: ``"lr"``, ``"eps"``, or a decay rate's name.
        value: the hyperparameter (a `Hyperparameter`).
        name: the name to report (a learner's ``inner_beta1``); None: ``kind``.

    Raises:
        ValueError: one line naming the argument, the value and the valid range.
    """
    if kind == "lr":
        valid, rule = math.isfinite, "a finite number"
    elif kind == "eps":
        valid, rule = (lambda v: math.isfinite(v) and v >= 0), "finite and >= 0"
    else:
        valid, rule = (lambda v: 0 <= v < 1), "in [0, 1)"
    for number in _numbers(value):
        if not valid(number):
            raise ValueError(f"{name or kind}={number!r} is out of range: it must be {rule}")


def _numbers(value: Hyperparameter) -> Iterator[float]:
    """The Python numbers of a hyperparameter (its dicts and per-step lists walked)."""
    if isinstance(value, Mapping):
        for v in value.values():
            yield from _numbers(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _numbers(v)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield float(value)


def safe_sqrt(v: Tensor) -> Tensor:
    """``sqrt(v)`` for ``v >= 0`` whose derivative at 0 is 0 instead of infinite.

    Adam's and RMSprop's second moment is 0 where a gradient entry is exactly 0 (a dead
    ReLU's bias); there ``d sqrt(v) / dv`` is infinite and its product with ``dv/dg = 0``
    NaN. As a function of the gradient, ``sqrt((1 - beta2) g^2)`` has derivative
    ``sqrt(1 - beta2) sign(g)``, whose subgradient at 0 is 0: that is what flows here (as
    higher's optimizers mask the same entries). Values equal ``torch.sqrt``'s.
    """
    positive = v > 0
    # The inner where keeps sqrt's derivative finite where v is 0 (its 1 is never used).
    return torch.where(positive, torch.where(positive, v, 1.0).sqrt(), 0.0)


class InnerOptimizer(abc.ABC):
    """A differentiable optimizer of a parameter dict: `init` its state, then `update`.

    Subclasses are frozen dataclasses whose fields are their hyperparameters (each a
    `Hyperparameter`); they define `slots` (tensors of state per parameter) and
    `update_tensor`, the update of one parameter tensor. The learning rate is not a field:
    the inner loop owns it (its rates decide which parameters are adapted) and passes it to
    `update`.
    """

    def slots(self) -> int:
        """How many state tensors each parameter carries."""
        return 0

    def init(self, params: Mapping[str, Tensor]) -> State:
        """The state before the first step: zeros of each parameter's shape, per slot."""
        return {
            k: tuple(torch.zeros_like(p) for _ in range(self.slots())) for k, p in params.items()
        }

    def __post_init__(self) -> None:
        """Check every fixed hyperparameter (`check_hyperparameter`)."""
        for kind in (f.name for f in fields(self)):  # type: ignore[arg-type]
            if kind != "nesterov":
                check_hyperparameter(kind, getattr(self, kind))

    def update(
        self,
        params: Mapping[str, Tensor],
        grads: Mapping[str, Tensor],
        state: Mapping[str, tuple[Tensor, ...]],
        *,
        lr: Hyperparameter,
        step: int,
    ) -> tuple[dict[str, Tensor], State]:
        """One step on every parameter of ``params``.

        Args:
            params: name -> tensor, the parameters to update.
            grads: name -> gradient, the shape of each parameter.
            state: name -> slots, as `init` made them or the last `update` returned.
            lr: the step size (a `Hyperparameter`).
            step: the inner step, 0-based (Adam's bias correction uses ``step + 1``).

        Returns:
            ``(new_params, new_state)`` for the names of ``params``.
        """
        new_params, new_state = {}, {}
        for k in params:
            rate = hyper_at(lr, k, step)
            if rate is None:
                raise ValueError(f"the learning rate has no entry for parameter {k!r}")
            new_params[k], new_state[k] = self.update_tensor(
                params[k], grads[k], tuple(state[k]), rate, name=k, step=step
            )
        return new_params, new_state

    @abc.abstractmethod
    def update_tensor(
        self,
        p: Tensor,
        g: Tensor,
        slots: tuple[Tensor, ...],
        lr: float | Tensor,
        *,
        name: str,
        step: int,
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """One parameter tensor's step: ``(p_new, slots_new)``."""

    def hyper(self, field_name: str, name: str, step: int) -> float | Tensor:
        """This optimizer's hyperparameter ``field_name`` for parameter ``name`` at ``step``."""
        value = hyper_at(getattr(self, field_name), name, step)
        if value is None:
            raise ValueError(f"{type(self).__name__}.{field_name} has no entry for {name!r}")
        return value

    def detached(self) -> InnerOptimizer:
        """This optimizer with its tensor hyperparameters detached (evaluation builds no
        graph to them)."""
        return replace(self, **{f.name: detached(getattr(self, f.name)) for f in fields(self)})  # type: ignore[arg-type]

    hyperparameters: ClassVar[tuple[str, ...]] = ()
    """The fields a learner may meta-learn (all but ``eps`` and switches)."""
