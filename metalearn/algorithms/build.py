"""Build a learner by algorithm name from a run's recorded arguments.

Two steps, so that what runs is what is recorded: `resolve_learner_args` fills the
arguments a run left open (``None``) from one per-algorithm table, once, before the run is
logged or checkpointed; `build_learner` then builds exactly what the resolved arguments
say, and refuses arguments that are missing or still open.
"""

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

__all__ = ["ALGORITHM_DEFAULTS", "build_learner", "learner_config", "resolve_learner_args"]

_LEARNERS: dict[str, type[MetaLearner]] = {
    "maml": MAML, "fomaml": FOMAML, "anil": ANIL, "metasgd": MetaSGD, "mamlpp": MAMLpp,
    "imaml": IMAML, "reptile": Reptile,
}  # fmt: skip

# The learner arguments an Omniglot run may leave open, per algorithm. iMAML: conv4's
# adapted support Hessian has eigenvalues below -lambda, so the CG system (Rajeswaran et al.,
# 2019, Eq. 7) needs damping 10 and a smaller, longer inner loop; Reptile (Nichol et al.,
# 2018) needs several inner steps to differ from joint training.
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    "maml": {"inner_lr": 0.4, "inner_steps": 1},
    "fomaml": {"inner_lr": 0.4, "inner_steps": 1},
    "anil": {"inner_lr": 0.4, "inner_steps": 1},
    "metasgd": {"inner_lr": 0.4, "inner_steps": 1},
    "mamlpp": {"inner_lr": 0.4, "inner_steps": 1},
    "imaml": {"inner_lr": 0.1, "inner_steps": 5, "cg_damping": 10.0},
    "reptile": {"inner_lr": 0.4, "inner_steps": 5},
}
_ARG_KEYS = ("algorithm", "ways", "hidden", "inner_lr", "inner_steps", "vectorize")


def _check_algorithm(algorithm: Any) -> None:
    if algorithm not in _LEARNERS:
        raise ValueError(f"unknown algorithm {algorithm!r}; known: {sorted(_LEARNERS)}")


def resolve_learner_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` with its open (``None`` or absent) learner arguments set from the table.

    Values already given win over the table; ``cg_damping`` is ``None`` for every algorithm
    but iMAML (it has no such argument), so the record never shows a setting that did nothing.

    Args:
        args: the experiment's arguments as a dict.

    Returns:
        A new dict, ready for `build_learner` and for logging.
    """
    _check_algorithm(args.get("algorithm"))
    resolved = dict(args)
    table = ALGORITHM_DEFAULTS[args["algorithm"]]
    for key in ("inner_lr", "inner_steps", "cg_damping"):
        if resolved.get(key) is None:
            resolved[key] = table.get(key)
    if "cg_damping" not in table and resolved["cg_damping"] is not None:
        raise ValueError(
            f"cg_damping={resolved['cg_damping']} is an iMAML setting; drop --cg-damping for "
            f"{args['algorithm']}"
        )
    return resolved


def learner_config(args: Mapping[str, Any]) -> dict[str, Any]:
    """The learner class and every keyword `build_learner` passes it (the rest: its defaults).

    Raises:
        ValueError: a needed key is missing or unresolved, or the algorithm is unknown.
    """
    keys = [*_ARG_KEYS, *(("cg_damping",) if args.get("algorithm") == "imaml" else ())]
    if missing := [k for k in keys if k not in args]:
        raise ValueError(
            f"the learner arguments lack {missing}: they were not written by "
            "experiments/omniglot_maml.py; build the learner yourself and load_state_dict"
        )
    _check_algorithm(args["algorithm"])
    if unresolved := [k for k in keys if args[k] is None]:
        raise ValueError(
            f"learner arguments {unresolved} are None; pass the args through "
            "metalearn.algorithms.resolve_learner_args first"
        )
    kwargs = {k: args[k] for k in ("inner_lr", "inner_steps", "vectorize")}
    if args["algorithm"] == "imaml":
        kwargs["cg_damping"] = float(args["cg_damping"])
    return {"class": _LEARNERS[args["algorithm"]].__name__, "ways": args["ways"],
            "hidden": args["hidden"], **kwargs}  # fmt: skip


def build_learner(args: Mapping[str, Any]) -> MetaLearner:
    """The learner ``experiments/omniglot_maml.py`` trains, built from its resolved ``args``.

    Builds exactly what ``args`` say (see `learner_config`); weights are freshly initialised
    from torch's global generator: seed first, or load a state next.

    Args:
        args: the experiment's ``Args`` as a dict, resolved (a checkpoint's ``"args"``).

    Raises:
        ValueError: a needed key is missing or None, or the algorithm is unknown.
    """
    config = learner_config(args)
    kwargs = {k: v for k, v in config.items() if k not in ("class", "ways", "hidden")}
    model = Conv4(ways=config["ways"], hidden=config["hidden"])
    return _LEARNERS[args["algorithm"]](model, **kwargs)
