"""Build a learner by algorithm name from a run's recorded arguments.

Two steps, so that what runs is what is recorded: `resolve_learner_args` fills the
arguments a run left open (``None``) from one per-algorithm table, once, before the run is
logged or checkpointed; `build_learner` then builds exactly what the resolved arguments
say, and refuses arguments that are missing or still open.

The network is part of the record too: ``backbone``, ``channels``, ``image_size``,
``hidden``, ``pool`` and ``head`` (written by ``experiments/fewshot_maml.py``). Checkpoints
without those keys are Omniglot runs (``experiments/omniglot_maml.py`` records none of
them), whose network is always MAML's Omniglot Conv4, so a missing key means that network.
An algorithm's own settings (``cg_damping`` for iMAML, ``lora_rank`` for LoRA-MAML) are
read only for that algorithm, so records from before a setting existed still build.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from metalearn.algorithms.base import MetaLearner
from metalearn.algorithms.imaml import IMAML
from metalearn.algorithms.lora_maml import LoRAMAML
from metalearn.algorithms.maml import ANIL, FOMAML, MAML
from metalearn.algorithms.mamlpp import MAMLpp
from metalearn.algorithms.metasgd import MetaSGD
from metalearn.algorithms.protomaml import ProtoMAML
from metalearn.algorithms.reptile import Reptile
from metalearn.models import Conv4, ResNet12

__all__ = [
    "ALGORITHM_DEFAULTS",
    "OMNIGLOT_NETWORK",
    "build_learner",
    "build_model",
    "learner_config",
    "resolve_learner_args",
]

_LEARNERS: dict[str, type[MetaLearner]] = {
    "maml": MAML, "fomaml": FOMAML, "anil": ANIL, "metasgd": MetaSGD, "mamlpp": MAMLpp,
    "imaml": IMAML, "reptile": Reptile, "protomaml": ProtoMAML, "lora": LoRAMAML,
}  # fmt: skip

# The learner arguments an Omniglot run may leave open, per algorithm. iMAML: conv4's
# adapted support Hessian has eigenvalues below -lambda, so the CG system (Rajeswaran et al.,
# 2019, Eq. 7) needs damping 10 and a smaller, longer inner loop; Reptile (Nichol et al.,
# 2018) needs several inner steps to differ from joint training. LoRA-MAML: rank 4, the
# rank Hu et al. (2021, Table 6) found enough for adaptation.
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    "maml": {"inner_lr": 0.4, "inner_steps": 1},
    "fomaml": {"inner_lr": 0.4, "inner_steps": 1},
    "anil": {"inner_lr": 0.4, "inner_steps": 1},
    "metasgd": {"inner_lr": 0.4, "inner_steps": 1},
    "mamlpp": {"inner_lr": 0.4, "inner_steps": 1},
    "imaml": {"inner_lr": 0.1, "inner_steps": 5, "cg_damping": 10.0},
    "reptile": {"inner_lr": 0.4, "inner_steps": 5},
    "protomaml": {"inner_lr": 0.4, "inner_steps": 1},
    "lora": {"inner_lr": 0.4, "inner_steps": 1, "lora_rank": 4},
}
_ARG_KEYS = ("algorithm", "ways", "hidden", "inner_lr", "inner_steps", "vectorize")
# The network of a run that records none of the network keys: MAML's Omniglot Conv4 (one
# input channel, strided blocks, mean head; any image size, 28 in practice).
OMNIGLOT_NETWORK: dict[str, Any] = {
    "backbone": "conv4", "channels": 1, "image_size": None, "pool": "stride", "head": "mean",
}  # fmt: skip
# Algorithms whose learner takes first_order (FOMAML is first order by definition).
_FIRST_ORDER = ("maml", "anil", "metasgd", "mamlpp", "protomaml", "lora")
# Settings of one algorithm: absent from its table, they must stay open (None) for the others.
_OWN_SETTINGS = {"cg_damping": ("an iMAML", "--cg-damping"), "lora_rank": ("a LoRA", "--lora-rank")}


def _check_algorithm(algorithm: Any) -> None:
    if algorithm not in _LEARNERS:
        raise ValueError(f"unknown algorithm {algorithm!r}; known: {sorted(_LEARNERS)}")


def resolve_learner_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """``args`` with its open (``None`` or absent) learner arguments set from the table.

    Values already given win over the table. ``cg_damping`` is ``None`` for every algorithm
    but iMAML and ``lora_rank`` for every one but LoRA-MAML (they have no such argument), so
    the record never shows a setting that did nothing.

    Args:
        args: the experiment's arguments as a dict.

    Returns:
        A new dict, ready for `build_learner` and for logging.

    Raises:
        ValueError: an unknown algorithm, another algorithm's setting, or a ``lora_rank``
            below 1.
    """
    _check_algorithm(args.get("algorithm"))
    resolved = dict(args)
    table = ALGORITHM_DEFAULTS[args["algorithm"]]
    for key in ("inner_lr", "inner_steps", "cg_damping"):
        if resolved.get(key) is None:
            resolved[key] = table.get(key)
    if "lora_rank" in table and resolved.get("lora_rank") is None:
        resolved["lora_rank"] = table["lora_rank"]
    for key, (owner, flag) in _OWN_SETTINGS.items():
        if key not in table and resolved.get(key) is not None:
            raise ValueError(
                f"{key}={resolved[key]} is {owner} setting; drop {flag} for {args['algorithm']}"
            )
    rank = resolved.get("lora_rank")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise ValueError(f"lora_rank={rank!r}: the adapters' rank must be an int >= 1, e.g. 4")
    if resolved.get("first_order") and args["algorithm"] not in (*_FIRST_ORDER, "fomaml"):
        raise ValueError(
            f"first_order applies to {', '.join(_FIRST_ORDER)} (fomaml is first order); "
            f"drop --first-order for {args['algorithm']}"
        )
    return resolved


def learner_config(args: Mapping[str, Any]) -> dict[str, Any]:
    """The learner class and every keyword `build_learner` passes it (the rest: its defaults).

    Raises:
        ValueError: a needed key is missing or unresolved, or the algorithm is unknown.
    """
    table = ALGORITHM_DEFAULTS.get(args.get("algorithm"), {})
    keys = [*_ARG_KEYS, *(k for k in _OWN_SETTINGS if k in table)]
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
    if args["algorithm"] == "lora":
        kwargs["rank"] = int(args["lora_rank"])
    # The switches that trade time for memory; absent from Omniglot records (their defaults).
    if args.get("checkpoint"):
        kwargs["checkpoint"] = True
    if args.get("chunk_size") is not None:
        kwargs["chunk_size"] = int(args["chunk_size"])
    if args.get("first_order") and args["algorithm"] in _FIRST_ORDER:
        kwargs["first_order"] = True
    network = {k: args.get(k, default) for k, default in OMNIGLOT_NETWORK.items()}
    return {"class": _LEARNERS[args["algorithm"]].__name__, "ways": args["ways"],
            "hidden": args["hidden"], "network": network, **kwargs}  # fmt: skip


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
    kwargs = {k: v for k, v in config.items() if k not in ("class", "ways", "hidden", "network")}
    model = build_model(config["network"], ways=config["ways"], hidden=config["hidden"])
    return _LEARNERS[args["algorithm"]](model, **kwargs)


def build_model(network: Mapping[str, Any], *, ways: int, hidden: int) -> nn.Module:
    """The backbone a run's ``network`` keys name (see `OMNIGLOT_NETWORK` for the keys).

    Args:
        network: ``backbone`` (``"conv4"`` or ``"resnet12"``), ``channels``,
            ``image_size``, ``pool`` and ``head`` (the last three: Conv4 only).
        ways: classes of the linear head.
        hidden: Conv4's filters per block; ResNet-12's first stage width, the stages being
            ``(h, 2.5h, 5h, 10h)`` (64 gives the usual 64-160-320-640).

    Returns:
        A model mapping ``[B, channels, S, S]`` to logits ``[B, ways]``.

    Raises:
        ValueError: an unknown backbone.
    """
    if network["backbone"] == "conv4":
        return Conv4(in_channels=network["channels"], ways=ways, hidden=hidden,
                     pool=network["pool"], head=network["head"],
                     image_size=network["image_size"])  # fmt: skip
    if network["backbone"] == "resnet12":
        widths = (hidden, hidden * 5 // 2, hidden * 5, hidden * 10)
        return ResNet12(in_channels=network["channels"], ways=ways, widths=widths)
    raise ValueError(f"backbone {network['backbone']!r}; choose conv4 or resnet12")
