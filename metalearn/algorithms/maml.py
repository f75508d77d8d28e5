"""MAML, first-order MAML and ANIL: `MetaLossLearner` with different inner-loop settings.

All three take an inner optimizer (`metalearn.algorithms.inner_optimizer`): SGD by default.
MAML and FOMAML keep the normalisation layers out of the inner loop unless ``adapt_norm``:
their weights are meta-learned only, as in both references (cbfinn/maml's batch-norm
variables are not among its fast weights; HowToTrainYourMAMLPytorch drops the norm layers
from the inner-loop dict, ``get_inner_loop_parameter_dict``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from metalearn.algorithms.base import adapted_keys
from metalearn.algorithms.inner_optimizer import InnerOptimizerLearner

__all__ = ["ANIL", "FOMAML", "MAML"]


class MAML(InnerOptimizerLearner):
    """Model-Agnostic Meta-Learning (Finn et al., 2017), exact second order by default.

    Args:
        model: the network; its parameters are theta.
        inner_lr: the inner step size on the mean support loss. 2.0 is the reference's
            Omniglot step: cbfinn/maml (a7f45f1) steps ``update_lr`` 0.4 (5-way; 0.1 at
            20-way, ``main.py`` lines 11 and 14) on the per-example losses divided by ``K``
            (``utils.py`` line 58) and summed by ``tf.gradients`` (``maml.py`` line 90): the
            sum over ``N K`` examples over ``K``, ``N`` times the mean, so ``N`` x 0.4 = 2.0
            (20 x 0.1 = 2.0 at 20-way) on the mean loss.
        adapt_norm: adapt the normalisation layers' weights in the inner loop too
            (the parameters its forward feeds to a norm call's weight or bias,
            `metalearn.algorithms.base.MetaLearner.fast_weight_names`); False (the
            references'): they are meta-learned only, held at theta's values in every task's
            inner loop.
        **kwargs: as for `metalearn.algorithms.inner_optimizer.InnerOptimizerLearner`
            (``adapt_keys`` may not name a normalisation parameter unless ``adapt_norm``).
    """

    def __init__(
        self, model: nn.Module, *, inner_lr: float = 2.0, adapt_norm: bool = False, **kwargs: Any
    ) -> None:
        named = kwargs.get("adapt_keys")
        sized = kwargs.get("learn_inner_hyperparameters", "none") != "none"
        kwargs["adapt_keys"] = adapted_keys(model, named, adapt_norm, sized)
        super().__init__(model, inner_lr=inner_lr, **kwargs)
        self.adapt_norm, self._named_keys = adapt_norm, None if named is None else list(named)


class FOMAML(MAML):
    """First-order MAML (Finn et al., 2017, Sec. 5.2): inner gradients treated as constants.
    Arguments as for `MAML` (``first_order`` is always True)."""

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
