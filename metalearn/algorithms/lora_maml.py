"""LoRA-MAML: MAML whose inner loop adapts low-rank adapters and the head, not the weights.

Every convolution, linear and attention layer outside the head gets a LoRA adapter
(`metalearn.models.lora`: ``W + (alpha / r) B A``, Hu et al., 2021, Eq. 3; an
`nn.MultiheadAttention` one on its input and one on its output projection). The inner loop
(Finn et al., 2017, Eq. 1) runs over the adapted set only::

    phi = {A_l, B_l for every adapted layer l} + {head weight, head bias}
    phi' = phi - alpha_inner * grad_phi L_support(theta_rest, phi)

and the outer loop differentiates the query loss through it (second order, as MAML) with
respect to everything: the base weights, batch norm, the head's initialisation and the
adapters' initialisation ``A_l, B_l``. The head adapts in full, as in ANIL (Raghu et al.,
2020): each few-shot task relabels its classes, which a low-rank change of a 5-row head
cannot express any better than the head itself.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from metalearn.algorithms.base import MetaLossLearner
from metalearn.models.lora import add_lora, lora_keys

__all__ = ["LoRAMAML"]


class LoRAMAML(MetaLossLearner):
    """MAML with low-rank adapters (rank ``lora_rank``) as the fast weights, plus the head.

    The learner holds a LoRA copy of ``model`` (`metalearn.models.lora.add_lora` on every
    ``nn.Conv2d``, ``nn.Linear`` and ``nn.MultiheadAttention`` outside ``head``); ``model``
    itself is not changed. At initialisation (``B = 0``) the copy computes what ``model`` does.

    The scale ``alpha`` defaults to ``lora_rank`` (a scaling ``alpha / rank`` of 1) because the
    inner loop takes plain gradient steps: from ``B = 0`` one step of rate ``lr`` on ``B``
    moves a layer's merged weight by ``-lr * s**2 * G A^T A`` (``G`` its gradient, ``s``
    the scaling), and Kaiming-uniform rows of ``A`` give ``A A^T ~ I / 3``; at ``s = 1`` the
    adapters then step at about a third of MAML's rate within their ``r`` directions, while
    ``alpha = 1`` at rank 4 would make that 16 times smaller.

    Args:
        model: the network (e.g. `metalearn.models.Conv4`).
        lora_rank: the adapters' rank ``r`` (>= 1).
        alpha: the adapters' scale numerator; None: ``lora_rank``.
        head: the prefix of the head's parameter names (``"head"`` for `Conv4`): adapted in
            full and given no adapter. None: every linear layer gets an adapter and only
            adapters are adapted.
        **kwargs: as for `metalearn.algorithms.base.MetaLearner` (not ``adapt_keys``: the
            adapted set is this algorithm's definition).

    Raises:
        ValueError: ``adapt_keys`` is given, ``lora_rank`` is not an int >= 1, or no parameter
            is named ``head`` or starts with ``head + "."``.
    """

    fixed_arguments = ("adapt_keys",)

    def __init__(
        self,
        model: nn.Module,
        lora_rank: int = 4,
        alpha: float | None = None,
        head: str | None = "head",
        **kwargs: Any,
    ) -> None:
        if "adapt_keys" in kwargs:
            raise ValueError(
                "LoRAMAML adapts the adapters and the head by definition; drop adapt_keys "
                "(or use MAML with adapt_keys=lora_keys(model) for another set)"
            )
        rank = lora_rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"lora_rank={rank!r}: the adapters' rank must be an int >= 1, e.g. 4")

        def in_head(name: str) -> bool:
            return head is not None and (name == head or name.startswith(head + "."))

        head_keys = [n for n, _ in model.named_parameters() if in_head(n)]
        if head is not None and not head_keys:
            raise ValueError(
                f"no parameter of the model is named {head!r} or starts with {head + '.'!r}; "
                "pass head= the prefix of the classifier's parameters, or head=None"
            )
        scale = float(rank) if alpha is None else float(alpha)
        lora_model = add_lora(
            model, rank, scale, target=lambda name, _: not in_head(name),
            layers=(nn.Linear, nn.Conv2d, nn.MultiheadAttention),
        )  # fmt: skip
        super().__init__(lora_model, adapt_keys=[*lora_keys(lora_model), *head_keys], **kwargs)
        self.rank, self.alpha, self.head = rank, scale, head
