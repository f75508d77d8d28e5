"""BOIL (Oh, Yoo, Kim & Yun, 2021, "BOIL: Towards Representation Change for Few-shot
Learning"): the body adapts in the inner loop, the head stays.

MAML's inner loop (Finn et al., 2017, Eq. 1) adapts every weight; ANIL (Raghu et al., 2020)
adapts only the head. BOIL is the converse of ANIL: with theta split into the body theta_b
(every layer before the classifier) and the head theta_h::

    phi_b = theta_b - alpha * grad_{theta_b} L_support(theta_b, theta_h)
    phi_h = theta_h

so a task can only be fitted by changing its representation, not the decision boundary.
The outer loop meta-learns both, through the inner loop (second order unless
``first_order``). The paper's reference code (github.com/HJ-Yoo/BOIL, ``maml/utils.py``)
writes the head's inner step size as 0 (``--classifier-step-size 0``); leaving the head
out of the adapted set is the same update. Its body includes the batch-norm layers'
weights and biases: ``update_parameters`` steps every parameter of
``model.meta_named_parameters()`` not named ``classifier``, and torchmeta's
``MetaBatchNorm2d`` is a ``MetaModule`` whose affine parameters are among them (its
``torchmeta/modules/module.py``, ``batchnorm.py``), so ``adapt_norm`` is True by default,
unlike MAML's references.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from metalearn.algorithms.inner_optimizer import InnerOptimizerLearner

__all__ = ["BOIL"]


class BOIL(InnerOptimizerLearner):
    """Body Only update in the Inner Loop: adapt everything but the head, meta-learn all.

    Args:
        model: the network.
        head: the prefix of the head's parameter names (``"head"`` for `Conv4`): these stay
            at theta in the inner loop.
        inner_lr: the body's inner step size; 0.5, the reference's ``--extractor-step-size``
            (``run_4conv.sh``).
        adapt_norm: the normalisation layers' weights are part of the adapted body; True,
            the reference's (its batch norm's affine parameters are meta-parameters).
        **kwargs: as for `metalearn.algorithms.inner_optimizer.InnerOptimizerLearner` (an
            inner optimizer other than SGD included).

    Raises:
        ValueError: no parameter is named ``head`` or starts with ``head + "."``, or every
            parameter does (no body is left to adapt).
    """

    fixed_arguments = ("adapt_keys",)
    omniglot_inner_defaults = False  # the reference's CIFAR-FS values, kept on other data

    def __init__(
        self,
        model: nn.Module,
        head: str = "head",
        *,
        inner_lr: float = 0.5,
        adapt_norm: bool = True,
        **kwargs: Any,
    ) -> None:
        names = [n for n, _ in model.named_parameters()]
        heads = {n for n in names if n == head or n.startswith(head + ".")}
        body = [n for n in names if n not in heads]  # less the norms, unless adapt_norm
        if not heads:
            raise ValueError(
                f"no parameter of the model is named {head!r} or starts with {head + '.'!r}; "
                "pass head= the prefix of the classifier's parameters"
            )
        if not body:
            raise ValueError(
                f"every parameter of the model is in the head {head!r}: BOIL has no body to "
                "adapt; pass head= the classifier's prefix"
            )
        super().__init__(model, adapt_keys=body, inner_lr=inner_lr, **kwargs)
        self.head = head
        self.adapt_norm = adapt_norm
