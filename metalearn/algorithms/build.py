"""Build a learner by algorithm name from a run's recorded arguments."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from metalearn.algorithms.base import MetaLearner
from metalearn.algorithms.imaml import IMAML
from metalearn.algorithms.maml import ANIL, FOMAML, MAML
from metalearn.algorithms.mamlpp import MAMLpp
from metalearn.algorithms.metasgd import MetaSGD
from metalearn.algorithms.reptile import Reptile
from metalearn.models import Conv4

__all__ = ["build_learner"]

_LEARNERS = {"maml": MAML, "fomaml": FOMAML, "anil": ANIL, "metasgd": MetaSGD, "mamlpp": MAMLpp}
_ARG_KEYS = ("algorithm", "ways", "hidden", "inner_lr", "inner_steps", "vectorize")


# --------------------------------------------------------------------------- the learner


def build_learner(args: Mapping[str, Any]) -> MetaLearner:
    """The learner ``experiments/omniglot_maml.py`` trains, built from its ``args``.

    The experiment's ``make_learner`` calls this (after seeding), so a checkpoint's
    ``learner`` state loads into it. Weights are freshly initialised: load a state next.

    Args:
        args: the experiment's ``Args`` as a dict (a checkpoint's ``"args"``).

    Raises:
        ValueError: a needed key is missing, or the algorithm is unknown.
    """
    if missing := [k for k in _ARG_KEYS if k not in args]:
        raise ValueError(
            f"the checkpoint's args lack {missing}: it was not written by "
            "experiments/omniglot_maml.py; build the learner yourself and load_state_dict"
        )
    model = Conv4(ways=args["ways"], hidden=args["hidden"])
    algorithm, lr, steps = args["algorithm"], args["inner_lr"], args["inner_steps"]
    if algorithm == "imaml":  # conv4's adapted support Hessian has eigenvalues below -lambda
        return IMAML(model, inner_steps=max(steps, 5), cg_damping=10.0, inner_lr=min(lr, 0.1))
    if algorithm == "reptile":
        return Reptile(model, inner_lr=lr, inner_steps=max(steps, 5))
    if algorithm not in _LEARNERS:
        known = sorted([*_LEARNERS, "imaml", "reptile"])
        raise ValueError(f"unknown algorithm {algorithm!r} in the checkpoint; known: {known}")
    return _LEARNERS[algorithm](model, inner_lr=lr, inner_steps=steps, vectorize=args["vectorize"])
