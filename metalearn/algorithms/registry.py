"""The learners by name, and every argument each one takes.

`LEARNERS` is the one list of algorithms: the experiments' ``--algorithm`` choices come from
it. `learner_arguments` reads a learner's keyword arguments (its own, and the
`MetaLearner` ones it passes on) with their defaults from its signature, so a record made
by `complete_arguments` names every argument the learner was built with, not only those
a command line set; `make_learner` builds exactly that record.

What a learner can do is a class attribute of it (`MetaLearner`'s ``has_inner_loop``,
``takes_inner_optimizer``, ``measures_curvature``, ``head_sized_per_task``), read here and
nowhere else: `can` asks it of one algorithm, `algorithms_that` lists those that can, so no
list of algorithm names is written anywhere but `LEARNERS`. `algorithms_taking` lists the
algorithms whose learner takes an argument (``cg_damping``: iMAML's).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Literal

import torch.nn.functional as F
from torch import nn

from metalearn.algorithms.base import MetaLearner
from metalearn.algorithms.boil import BOIL
from metalearn.algorithms.imaml import IMAML
from metalearn.algorithms.lora_maml import LoRAMAML
from metalearn.algorithms.maml import ANIL, FOMAML, MAML
from metalearn.algorithms.mamlpp import MAMLpp
from metalearn.algorithms.metacurvature import MetaCurvatureMAML
from metalearn.algorithms.metaoptnet import MetaOptNet
from metalearn.algorithms.metaoptnet_lr import MetaOptNetLR
from metalearn.algorithms.metasgd import MetaSGD
from metalearn.algorithms.protomaml import ProtoMAML
from metalearn.algorithms.protonet import ProtoNet
from metalearn.algorithms.r2d2 import R2D2
from metalearn.algorithms.reptile import Reptile

__all__ = [
    "ALGORITHMS",
    "LEARNERS",
    "LOSSES",
    "Algorithm",
    "Capability",
    "algorithms_taking",
    "algorithms_that",
    "can",
    "complete_arguments",
    "learner_arguments",
    "make_learner",
]

LEARNERS: Mapping[str, type[MetaLearner]] = {
    "maml": MAML, "fomaml": FOMAML, "anil": ANIL, "metasgd": MetaSGD, "mamlpp": MAMLpp,
    "imaml": IMAML, "reptile": Reptile, "protomaml": ProtoMAML, "lora": LoRAMAML,
    "protonet": ProtoNet, "r2d2": R2D2,
    "metaoptnet": MetaOptNet,
    "metaoptnet-lr": MetaOptNetLR,
    "boil": BOIL,
    "metacurvature": MetaCurvatureMAML,
}  # fmt: skip
ALGORITHMS: tuple[str, ...] = tuple(LEARNERS)
Algorithm = Literal[ALGORITHMS]  # type: ignore[valid-type]
"""An algorithm's name, one of `ALGORITHMS` (a command line's choices)."""

LOSSES = {"cross_entropy": F.cross_entropy, "mse": F.mse_loss}
"""Loss functions a record names (``loss_fn`` is recorded by name)."""

Capability = Literal["inner_loop", "inner_optimizer", "curvature", "head_sized_per_task",
                     "query_logits", "omniglot_inner_defaults"]  # fmt: skip
"""What a learner may be able to do: an inner loop of gradient steps, a chosen inner
optimizer, curvature measured (`metalearn.algorithms.curvature`), a head sized per task,
query predictions of the network at adapted weights (`MetaLearner.query_logits`), inner
defaults that are its reference's Omniglot values (`MetaLearner.omniglot_inner_defaults`)."""

_ATTRIBUTES: Mapping[str, str] = {
    "inner_loop": "has_inner_loop", "inner_optimizer": "takes_inner_optimizer",
    "curvature": "measures_curvature", "head_sized_per_task": "head_sized_per_task",
    "query_logits": "scores_adapted_weights", "omniglot_inner_defaults": "omniglot_inner_defaults",
}  # fmt: skip


def _learner(name: str) -> type[MetaLearner]:
    if name not in LEARNERS:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}")
    return LEARNERS[name]


def can(name: str, capability: Capability) -> bool:
    """Whether algorithm ``name``'s learner has ``capability`` (its class attribute).

    Raises:
        ValueError: an unknown algorithm or capability.
    """
    if capability not in _ATTRIBUTES:
        raise ValueError(f"capability {capability!r}; choose one of {', '.join(_ATTRIBUTES)}")
    return bool(getattr(_learner(name), _ATTRIBUTES[capability]))


def algorithms_that(capability: Capability) -> tuple[str, ...]:
    """The algorithms whose learner has ``capability``, in `LEARNERS`' order."""
    return tuple(name for name in LEARNERS if can(name, capability))


def algorithms_taking(argument: str) -> tuple[str, ...]:
    """The algorithms whose learner takes ``argument`` (`learner_arguments`)."""
    return tuple(name for name in LEARNERS if argument in learner_arguments(name))


def learner_arguments(name: str) -> dict[str, Any]:
    """Every keyword argument of algorithm ``name``'s learner, with its default.

    The learner's own arguments, then, where it passes ``**kwargs`` on, its bases' (up to
    `MetaLearner`), less those it decides itself (`MetaLearner.fixed_arguments`: FOMAML's
    ``first_order``, ANIL's ``adapt_keys``, ...). ``loss_fn`` is given by its name in
    `LOSSES`.

    Raises:
        ValueError: an unknown algorithm.
    """
    cls = _learner(name)
    arguments: dict[str, Any] = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        params = inspect.signature(vars(klass)["__init__"]).parameters.values()
        for p in params:
            if p.kind is p.KEYWORD_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and p.name
                                             not in ("self", "model")):  # fmt: skip
                arguments.setdefault(p.name, p.default)
        if not any(p.kind is p.VAR_KEYWORD for p in params) or klass is MetaLearner:
            break
    for fixed in cls.fixed_arguments:
        arguments.pop(fixed, None)
    if arguments.get("loss_fn") is F.cross_entropy:
        arguments["loss_fn"] = "cross_entropy"
    return arguments


def complete_arguments(name: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` with every other argument of the learner at its default: a whole record.

    Raises:
        ValueError: an unknown algorithm, or an argument the learner does not take (named,
            with the ones it takes).
    """
    arguments = learner_arguments(name)
    if unknown := sorted(set(given) - set(arguments)):
        raise ValueError(
            f"{name} takes no argument {', '.join(unknown)}; it takes {', '.join(arguments)}"
        )
    return {**arguments, **given}


def make_learner(name: str, model: nn.Module, arguments: Mapping[str, Any]) -> MetaLearner:
    """Algorithm ``name``'s learner around ``model``, built with exactly ``arguments``
    (completed with the defaults, see `complete_arguments`).

    Raises:
        ValueError: an unknown algorithm, argument or loss name, or what the learner refuses.
    """
    kwargs = complete_arguments(name, arguments)
    loss = kwargs.get("loss_fn")
    if isinstance(loss, str):
        if loss not in LOSSES:
            raise ValueError(f"loss_fn {loss!r}; choose one of {', '.join(LOSSES)}")
        kwargs["loss_fn"] = LOSSES[loss]
    return _learner(name)(model, **kwargs)
