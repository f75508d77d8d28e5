"""MAML, first-order MAML and ANIL: `MetaLossLearner` with different inner-loop settings.

All three take an inner optimizer (`metalearn.algorithms.inner_optimizer`): SGD by default.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from metalearn.algorithms.inner_optimizer import InnerOptimizerLearner

__all__ = ["ANIL", "FOMAML", "MAML"]


class MAML(InnerOptimizerLearner):
    """Model-Agnostic Meta-Learning (Finn et al., 2017), exact second order by default."""


class FOMAML(InnerOptimizerLearner):
    """First-order MAML (Finn et al., 2017, Sec. 5.2): inner gradients treated as constants."""

    fixed_arguments = ("first_order",)

    def __init__(self, model: nn.Module, **kwargs: Any) -> None:
        if kwargs.pop("first_order", True) is not True:
            raise ValueError("FOMAML is first order by definition; use MAML for second order")
        super().__init__(model, first_order=True, **kwargs)


class ANIL(InnerOptimizerLearner):
    """Almost No Inner Loop (Raghu et al., 2020): adapt only the head, meta-learn all.

    Args:
        model: the network.
        head: the prefix of the adapted parameters' names (``"head"`` for `Conv4`).
        **kwargs: as for `metalearn.algorithms.base.MetaLearner`.
    """

    fixed_arguments = ("adapt_keys",)

    def __init__(self, model: nn.Module, head: str = "head", **kwargs: Any) -> None:
        keys = [n for n, _ in model.named_parameters() if n == head or n.startswith(head + ".")]
        if not keys:
            raise ValueError(
                f"no parameter of the model is named {head!r} or starts with {head + '.'!r}; "
                "pass head= the prefix of the classifier's parameters"
            )
        super().__init__(model, adapt_keys=keys, **kwargs)
