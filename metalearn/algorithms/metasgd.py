"""Meta-SGD (Li et al., 2017): MAML with a learned learning rate for every parameter entry.

The inner update (Li et al., 2017, Eq. 3) is elementwise::

    phi = theta - alpha ∘ grad_theta L_support(theta)

where ``alpha`` has theta's shape and is meta-learned with theta by the outer optimiser
(Eq. 4 differentiates the query loss w.r.t. both). Here ``alpha`` is one tensor per adapted
parameter, held in an ``nn.ParameterDict`` so ``learner.parameters()`` yields it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from metalearn.algorithms.base import MetaLossLearner, adapted_keys

__all__ = ["MetaSGD", "parameter_dict_key"]


def parameter_dict_key(name: str) -> str:
    """A parameter name as an ``nn.ParameterDict`` key: ``'.'`` (forbidden there) -> ``'__'``."""
    return name.replace(".", "__")


def keyed_names(names: Iterable[str]) -> dict[str, str]:
    """Map each name to its `parameter_dict_key`; raise if two names map to the same key."""
    keys: dict[str, str] = {}
    for name in names:
        key = parameter_dict_key(name)
        if key in keys.values():
            other = next(n for n, k in keys.items() if k == key)
            raise ValueError(
                f"parameters {other!r} and {name!r} both map to the ParameterDict key "
                f"{key!r}; rename one so that '.' -> '__' keeps names distinct"
            )
        keys[name] = key
    return keys


def adapted_names(model: nn.Module, adapt_keys: Iterable[str] | None) -> list[str]:
    """Names of the parameters the inner loop adapts, in the model's order."""
    chosen = None if adapt_keys is None else set(adapt_keys)
    return [n for n, _ in model.named_parameters() if chosen is None or n in chosen]


class MetaSGD(MetaLossLearner):
    """Meta-SGD (Li et al., 2017): elementwise learnable inner learning rates.

    Each adapted parameter ``p`` gets a rate tensor of ``p``'s shape, initialised to
    ``inner_lr`` (Li et al. draw it at random; a constant start makes Meta-SGD begin as
    MAML). The rates live in ``self.lrs`` (keys: parameter names with ``'.'`` -> ``'__'``),
    so an optimiser over ``learner.parameters()`` meta-learns them with theta. They are not
    constrained to be positive, as in the paper.

    The normalisation layers stay out of the inner loop (no rate) unless ``adapt_norm``, as
    in MAML (`metalearn.algorithms.maml`): Li et al. (2017) train MAML's networks with no
    code of their own, so MAML's references decide it.

    Args:
        model: the network; its parameters are theta.
        adapt_norm: give the normalisation layers' weights rates too (adapt them); False:
            meta-learned only.
        **kwargs: as for `MetaLearner`. ``inner_lr`` is the initial rate; ``adapt_keys``
            limits which parameters get a rate (and so are adapted).
    """

    def __init__(self, model: nn.Module, *, adapt_norm: bool = False, **kwargs: Any) -> None:
        named = kwargs.get("adapt_keys")
        kwargs["adapt_keys"] = adapted_keys(model, named, adapt_norm, sized_now=True)
        super().__init__(model, **kwargs)
        self.adapt_norm, self._named_keys = adapt_norm, None if named is None else list(named)
        if not isinstance(self.inner_lr, (int, float)):
            raise ValueError(
                f"inner_lr must be a number (the initial rate of every entry), got "
                f"{type(self.inner_lr).__name__}; set learner.lrs afterwards for other starts"
            )
        params = dict(model.named_parameters())
        self._keys = keyed_names(adapted_names(model, self.adapt_keys))
        self.lrs = nn.ParameterDict(
            {
                key: torch.full_like(params[n].detach(), float(self.inner_lr))
                for n, key in self._keys.items()
            }
        )

    def learning_rate(self) -> dict[str, Tensor]:
        """Parameter name -> rate tensor of the parameter's shape (the ParameterDict's own)."""
        return {name: self.lrs[key] for name, key in self._keys.items()}
