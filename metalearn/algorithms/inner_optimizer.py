"""MAML-family learners whose inner loop runs a differentiable optimizer of `metalearn.optim`.

MAML's inner update is SGD (Finn et al., 2017, Eq. 1). `InnerOptimizerLearner` lets MAML,
FOMAML and ANIL take SGD with momentum or Nesterov momentum, Adam or RMSprop instead
(``inner_optimizer``), with their hyperparameters fixed, or meta-learned with theta by the
outer optimiser (``learn_inner_hyperparameters``): one value per adapted parameter tensor
(``"tensor"``) or one per parameter tensor and inner step (``"step"``, as MAML++'s rates).
The learned values are the step size and the optimizer's decay rates (momentum; Adam's
beta1 and beta2; RMSprop's alpha), never ``eps``; like Meta-SGD's rates they are not
constrained. They start at the fixed values and live in ``learner.inner_hyperparameters``,
so ``learner.parameters()`` yields them. A task with more inner steps than ``inner_steps``
(evaluation) repeats the last step's values.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn

from metalearn.algorithms.base import MetaLossLearner
from metalearn.algorithms.metasgd import adapted_names, keyed_names
from metalearn.optim import SGD, Adam, Hyperparameter, InnerOptimizer, RMSprop, check_hyperparameter

__all__ = ["INNER_OPTIMIZERS", "LEARNABLE", "InnerOptimizerLearner", "optimizer_hyperparameters"]

INNER_OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "rmsprop")
"""The inner optimizers by name (``--inner-optimizer``)."""
LEARNABLE = ("none", "tensor", "step")
"""How the inner hyperparameters are meta-learned (``--learn-inner-hyperparameters``)."""

_USES = {
    "sgd": (), "momentum": ("inner_momentum",), "nesterov": ("inner_momentum",),
    "adam": ("inner_beta1", "inner_beta2", "inner_eps"), "rmsprop": ("inner_alpha", "inner_eps"),
}  # fmt: skip


def optimizer_hyperparameters(name: str) -> tuple[str, ...]:
    """The learner arguments inner optimizer ``name`` reads (``inner_beta1``, ...)."""
    if name not in _USES:
        raise ValueError(f"inner_optimizer {name!r}; choose one of {', '.join(INNER_OPTIMIZERS)}")
    return _USES[name]


class InnerOptimizerLearner(MetaLossLearner):
    """A `MetaLossLearner` whose inner loop is a chosen `metalearn.optim` optimizer.

    Args:
        model: the network; its parameters are theta.
        inner_optimizer: ``"sgd"`` (MAML's update), ``"momentum"``, ``"nesterov"``,
            ``"adam"`` or ``"rmsprop"``; ``inner_lr`` is its step size.
        inner_momentum: SGD's momentum (momentum, nesterov).
        inner_beta1, inner_beta2: Adam's decay rates.
        inner_eps: Adam's and RMSprop's ``eps``.
        inner_alpha: RMSprop's decay rate.
        learn_inner_hyperparameters: ``"none"`` (fixed), ``"tensor"`` (one learnable value
            per adapted parameter tensor) or ``"step"`` (one per tensor and inner step).
        **kwargs: as for `metalearn.algorithms.base.MetaLearner`.
    """

    takes_inner_optimizer = True

    def __init__(
        self,
        model: nn.Module,
        *,
        inner_optimizer: str = "sgd",
        inner_momentum: float = 0.9,
        inner_beta1: float = 0.9,
        inner_beta2: float = 0.999,
        inner_eps: float = 1e-8,
        inner_alpha: float = 0.99,
        learn_inner_hyperparameters: Literal["none", "tensor", "step"] = "none",
        **kwargs: Any,
    ) -> None:
        super().__init__(model, **kwargs)
        optimizer_hyperparameters(inner_optimizer)
        if learn_inner_hyperparameters not in LEARNABLE:
            raise ValueError(f"learn_inner_hyperparameters {learn_inner_hyperparameters!r}; "
                             f"choose one of {', '.join(LEARNABLE)}")  # fmt: skip
        if learn_inner_hyperparameters == "step" and self.inner_steps < 1:
            raise ValueError("learn_inner_hyperparameters='step' needs inner_steps >= 1")
        self.inner_optimizer = inner_optimizer
        self.learn_inner_hyperparameters = learn_inner_hyperparameters
        self._fixed: dict[str, float] = {
            "momentum": inner_momentum, "beta1": inner_beta1, "beta2": inner_beta2,
            "eps": inner_eps, "alpha": inner_alpha,
        }  # fmt: skip
        # Checked here, by the arguments' names, so a bad setting is refused before any step.
        for kind, value in self._fixed.items():
            check_hyperparameter(kind, value, f"inner_{kind}")
        self._keys = keyed_names(adapted_names(model, self.adapt_keys))
        if learn_inner_hyperparameters != "none":
            self.inner_hyperparameters = self._learnable(model)

    def _optimizer_class(self) -> type[InnerOptimizer]:
        return {"sgd": SGD, "momentum": SGD, "nesterov": SGD, "adam": Adam,
                "rmsprop": RMSprop}[self.inner_optimizer]  # fmt: skip

    def _learned(self) -> tuple[str, ...]:
        """The hyperparameters meta-learned: the step size, then the optimizer's own."""
        own = () if self.inner_optimizer == "sgd" else self._optimizer_class().hyperparameters
        return ("lr", *own)

    def _learnable(self, model: nn.Module) -> nn.ModuleDict:
        params = dict(model.named_parameters())
        shape = (self.inner_steps,) if self.learn_inner_hyperparameters == "step" else ()
        start = {**self._fixed, "lr": float(self.inner_lr)}
        return nn.ModuleDict({
            h: nn.ParameterDict({
                key: torch.full(shape, start[h], dtype=params[n].dtype, device=params[n].device)
                for n, key in self._keys.items()
            })
            for h in self._learned()
        })  # fmt: skip

    def _value(self, h: str) -> Hyperparameter:
        """Hyperparameter ``h`` as the inner loop reads it (`metalearn.optim.Hyperparameter`)."""
        if self.learn_inner_hyperparameters == "none" or h not in self._learned():
            return self.inner_lr if h == "lr" else self._fixed[h]
        values: nn.ParameterDict = self.inner_hyperparameters[h]  # type: ignore[assignment]
        if self.learn_inner_hyperparameters == "tensor":
            return {n: values[key] for n, key in self._keys.items()}
        return [
            {n: values[key][s] for n, key in self._keys.items()} for s in range(self.inner_steps)
        ]

    def learning_rate(self) -> Hyperparameter:
        """The step size: ``inner_lr``, or the learned values (per tensor, or by step)."""
        return self._value("lr")

    def inner_update(self) -> InnerOptimizer:
        """The inner optimizer, with the current (fixed or learned) hyperparameters."""
        name = self.inner_optimizer
        if name == "sgd":
            return SGD()
        if name in ("momentum", "nesterov"):
            return SGD(momentum=self._value("momentum"), nesterov=name == "nesterov")
        if name == "adam":
            return Adam(self._value("beta1"), self._value("beta2"), self._fixed["eps"])
        return RMSprop(self._value("alpha"), self._fixed["eps"])

    def learned_hyperparameters(self) -> dict[str, Tensor]:
        """The learned values, ``"lr/conv1.weight"`` -> tensor (``[]`` or ``[inner_steps]``),
        for logging; empty when nothing is learned."""
        if self.learn_inner_hyperparameters == "none":
            return {}
        return {
            f"{h}/{n}": self.inner_hyperparameters[h][key].detach()  # type: ignore[index]
            for h in self._learned()
            for n, key in self._keys.items()
        }
