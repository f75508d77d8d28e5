"""A run's recipe: one typed record of what it trains, and the functions that rebuild it.

A `Recipe` holds everything that decides a run's numbers: the data (data set, folder,
split, task protocol, ways, shots, queries, augmentation, and how an image file is decoded:
`metalearn.data.ImageFormat`), the model (backbone and its arguments), the learner (the
algorithm and every argument its constructor takes, schedules included, see
`metalearn.algorithms.registry`) and the training settings. Runs write it into their
checkpoint and their W&B config; whoever uses a run afterwards rebuilds from it alone:

* `build_model` / `build_learner`: the network and the learner (fresh weights; load a
  state next);
* `build_samplers`: the task samplers of the run's splits and protocols;
* ``recipe.data.image``: how a file becomes an input (`metalearn.deploy` decodes a support
  folder with it).

The experiments (`metalearn.runs.run`), ``--resume``, ``scripts/evaluate.py``,
``scripts/transfer_check.py``, ``scripts/grid.py`` and `metalearn.deploy` all go through
`read_recipe`. A record states its format (`RECIPE_VERSION`) and the metalearn version that
wrote it (``metalearn_version``); one of another format, or a checkpoint with no recipe, is
refused in one line naming the version that wrote it (`check_version`), never upgraded: it
is read by that metalearn, or its run trained again.

`recipe_from_args` is the one mapping from an experiment's flat arguments (the names of
its flags) to a recipe, and `resolve_learner_args` fills the learner values a run left open
(``None``) once, before anything is recorded.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import metalearn
from metalearn.algorithms import MetaLearner
from metalearn.algorithms.inner_optimizer import optimizer_hyperparameters
from metalearn.algorithms.registry import (
    LEARNERS,
    algorithms_taking,
    algorithms_that,
    can,
    complete_arguments,
    make_learner,
)
from metalearn.data import (
    IMAGE_SET_NAMES,
    MAX_IMAGE_SIZE,
    EpisodicSampler,
    ImageFormat,
    image_format,
    image_set_samplers,
    load_omniglot,
    omniglot_samplers,
    standard_augmentation,
)
from metalearn.data.omniglot import root_is_default
from metalearn.data.within_alphabet import within_alphabet_samplers
from metalearn.models import build_backbone, sized_by_image

__all__ = [
    "EXPERIMENTS",
    "RECIPE_VERSION",
    "DataRecipe",
    "LearnerRecipe",
    "ModelRecipe",
    "Recipe",
    "TrainingRecipe",
    "build_learner",
    "build_model",
    "build_samplers",
    "check_version",
    "flag_arguments",
    "read_recipe",
    "recipe_from_args",
    "resolve_learner_args",
    "with_resumed",
]

RECIPE_VERSION = 2
"""The format of the records this metalearn writes and reads (1: before records named the
metalearn version that wrote them; its readers upgraded older records, which went with it)."""
EXPERIMENTS = ("omniglot_maml", "fewshot_maml")
"""The experiments that write recipes (``experiments/<name>.py``)."""

# The outer loop's fields of `TrainingRecipe`, each set by the flag of its name.
_OUTER_FIELDS = ("outer_optimizer", "outer_momentum", "nesterov", "weight_decay",
                 "weight_decay_on", "lr_schedule", "eta_min", "step_size", "gamma",
                 "schedule_every", "lr_milestones", "lr_factors", "grad_clamp")  # fmt: skip
# The flags that set a learner argument, each named after the argument it sets, in three
# groups, each flag written once. A value left at None sets nothing: the learner's default
# stands (and is recorded); a resolved False is passed on (Proto-MAML's ``first_order``
# defaults to True).
# `MetaLearner`'s own arguments, which every learner takes:
_SHARED_FLAGS = ("inner_lr", "inner_steps", "first_order", "vectorize", "chunk_size",
                 "gradient_checkpointing", "on_nonfinite")  # fmt: skip
# The inner optimizer's flags (`metalearn.algorithms.inner_optimizer`), for the refusals.
_OPTIMIZER_FLAGS = ("inner_optimizer", "inner_momentum", "inner_beta1", "inner_beta2",
                    "inner_eps", "inner_alpha", "learn_inner_hyperparameters")  # fmt: skip
# Flags that belong to the algorithms whose learner takes them (`algorithms_taking`): recorded
# resolved for those, refused for the others.
_OWN_FLAGS = ("cg_damping", "cg_negative_curvature", "lora_rank", "msl_steps",
              "msl_epoch_length", "first_order_steps", "label_smoothing", "adapt_norm",
              "inner_batch", "eval_inner_batch", "inner_loss", "ridge_form", "lam", "eval_lam",
              "scale", "inner_state", "transductive", "train_on_query")  # fmt: skip
LEARNER_FLAGS = _SHARED_FLAGS + _OPTIMIZER_FLAGS + _OWN_FLAGS


@dataclass(frozen=True)
class DataRecipe:
    """What tasks a run draws, and how its image files are decoded.

    Attributes:
        dataset: ``"omniglot"`` or one of `metalearn.data.IMAGE_SET_NAMES`.
        root: the data set's folder (None: Omniglot's ``$METALEARN_DATA`` or cache).
        split: Omniglot's class split (``"maml"`` or ``"alphabet"``); ``"published"`` for
            the data sets with one.
        train_tasks: how training tasks are drawn (``"episodic"``, ``"within-alphabet"``).
        eval_protocol: how validation and test tasks are drawn (the same choices).
        ways, shots, query, eval_query: N, K, training and evaluation queries per class.
        augment: training images are augmented (the set's standard augmentation).
        image: how an image file becomes an input.
        train_ways: classes per training task (``ways`` unless the run trains wider).
        train_shots: support examples per class of a training task (``shots`` unless the
            run trains with others).
        train_min_shots: set: each training task's support examples a class are drawn
            uniformly from ``[train_min_shots, train_shots]``, the rest of its
            ``train_shots + query`` examples a class its queries (None: ``train_shots``).
        trainval: Omniglot only: the training tasks draw from the training and validation
            classes together and there is no validation (`metalearn.data.omniglot_splits`).
    """

    dataset: str
    root: str | None
    split: str
    train_tasks: str
    eval_protocol: str
    ways: int
    shots: int
    query: int
    eval_query: int
    augment: bool
    image: ImageFormat
    train_ways: int | None = None
    train_shots: int | None = None
    train_min_shots: int | None = None
    trainval: bool = False


@dataclass(frozen=True)
class ModelRecipe:
    """The backbone (`metalearn.models.build_backbone`'s arguments)."""

    backbone: str
    in_channels: int
    ways: int
    hidden: int
    pool: str = "stride"
    head: str = "mean"
    image_size: int | None = None
    activation: str = "relu"
    dropout: float = 0.0


@dataclass(frozen=True)
class LearnerRecipe:
    """The algorithm and every argument its learner was built with."""

    algorithm: str
    arguments: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainingRecipe:
    """How the learner is meta-trained, validated and tested."""

    meta_batch: int
    iterations: int
    outer_lr: float
    eval_inner_steps: int
    seed: int
    val_every: int
    val_tasks: int
    test_tasks: int
    checkpoint_every: int
    curvature_every: int = 0
    curvature_tasks: int = 4
    # The outer loop (`metalearn.runs.outer_loop`).
    outer_optimizer: str | None = None  # None: the learner's own
    outer_momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    weight_decay_on: str = "all"
    lr_schedule: str = "constant"
    eta_min: float = 0.0
    step_size: int | None = None
    gamma: float = 0.1
    schedule_every: int = 1
    lr_milestones: tuple[int, ...] = ()
    lr_factors: tuple[float, ...] = ()
    grad_clamp: float | None = None  # the meta-gradient's bound (None: no clamp)
    ensemble_top_k: int = 1  # best-validation weights the test ensembles (1: the best)

    def __post_init__(self) -> None:
        # a W&B config or a JSON record holds lists: the same recipe either way
        object.__setattr__(self, "lr_milestones", tuple(self.lr_milestones))
        object.__setattr__(self, "lr_factors", tuple(self.lr_factors))


@dataclass(frozen=True)
class Recipe:
    """A run's data, model, learner and training settings (see the module docstring)."""

    experiment: str
    data: DataRecipe
    model: ModelRecipe
    learner: LearnerRecipe
    training: TrainingRecipe
    version: int = RECIPE_VERSION

    def to_dict(self) -> dict[str, Any]:
        """Plain containers (for a checkpoint and the W&B config), with the metalearn
        version writing them (``metalearn_version``)."""
        out = dataclasses.asdict(self)
        out["learner"]["arguments"] = dict(self.learner.arguments)
        out["metalearn_version"] = metalearn.__version__
        return out

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> Recipe:
        """The recipe a `to_dict` record holds.

        Raises:
            ValueError: a record of another format (`check_version`), an unknown experiment,
                data set or algorithm, or a part missing or malformed (one line naming it).
        """
        check_version(record)
        try:
            data = dict(record["data"])
            parts = {"data": data, "model": record["model"], "training": record["training"]}
            for (part, fields), kind in zip(parts.items(), (DataRecipe, ModelRecipe,
                                                            TrainingRecipe)):  # fmt: skip
                check_fields(kind, fields, f"the recipe's {part}.")
                _check_complete(kind, fields, f"the recipe's {part}.")
            recipe = cls(
                experiment=record["experiment"],
                data=DataRecipe(**{**data, "image": _image_format(data["image"])}),
                model=ModelRecipe(**record["model"]),
                learner=LearnerRecipe(**record["learner"]),
                training=TrainingRecipe(**record["training"]),
            )
        except (KeyError, TypeError) as err:
            raise ValueError(f"the recipe is malformed ({type(err).__name__}: {err})") from None
        recipe.check()
        return recipe

    def check(self) -> None:
        """Refuse a recipe this metalearn cannot rebuild, naming the part.

        Raises:
            ValueError: an unknown experiment, data set or algorithm.
        """
        if self.experiment not in EXPERIMENTS:
            raise ValueError(f"experiment {self.experiment!r} is not one of "
                             f"{', '.join(EXPERIMENTS)}")  # fmt: skip
        if self.data.dataset not in IMAGE_SET_NAMES:
            raise ValueError(f"data set {self.data.dataset!r} is unknown; known: "
                             f"{', '.join(IMAGE_SET_NAMES)}")  # fmt: skip
        if self.learner.algorithm not in LEARNERS:
            raise ValueError(f"algorithm {self.learner.algorithm!r} is unknown; known: "
                             f"{', '.join(LEARNERS)}")  # fmt: skip


def check_version(record: Any) -> None:
    """Refuse a record of another format than `RECIPE_VERSION`, in one line naming the
    metalearn version that wrote it and what to do: read it with that version, or train the
    run again. Nothing is upgraded.

    Raises:
        ValueError: ``record`` is not a mapping, or states another format (or none).
    """
    if not isinstance(record, Mapping):
        raise ValueError(f"the recipe is {type(record).__name__}, not a record; {_DAMAGED}")
    found = record.get("version")
    if found == RECIPE_VERSION and not isinstance(found, bool):
        return
    by = record.get("metalearn_version")
    known = isinstance(by, str)
    writer = f"metalearn {by}" if known else "a metalearn that did not record its version"
    how = f"pip install metalearn=={by} to read it" if known else "read it with that metalearn"
    # short enough that the tools' one-line errors (160 characters) keep the remedy
    raise ValueError(f"recipe format {found!r}, written by {writer}; metalearn "
                     f"{metalearn.__version__} reads format {RECIPE_VERSION} only: {how} or "
                     "train the run again")  # fmt: skip


def _check_complete(kind: type, record: Mapping[str, Any], where: str) -> None:
    """Refuse a record of ``kind`` that lacks a field: a record of this format has them all."""
    if missing := [f.name for f in dataclasses.fields(kind) if f.name not in record]:
        raise ValueError(f"{where}{missing[0]} is missing; {_DAMAGED}")


# --------------------------------------------------------------------------- field checks

# The bounds a recorded field must keep (beside its type): counts of classes, examples,
# steps and tasks; every other number need only be finite. A record outside them was edited
# or damaged, and is refused naming the field before anything is built from it.
_LOWEST = {
    **dict.fromkeys(("ways", "train_ways"), 2),
    **dict.fromkeys(("shots", "query", "eval_query", "train_shots", "train_min_shots", "hidden",
                     "meta_batch", "iterations", "val_every", "val_tasks", "test_tasks",
                     "checkpoint_every", "curvature_tasks", "schedule_every", "ensemble_top_k",
                     "step_size", "in_channels", "image_size"), 1),
    **dict.fromkeys(("eval_inner_steps", "curvature_every", "seed"), 0),
}  # fmt: skip
_HIGHEST = {"image_size": MAX_IMAGE_SIZE, "in_channels": 3, "seed": 2**32 - 1}
_DAMAGED = "the checkpoint was edited or damaged: use the one its run wrote"


def check_fields(kind: type, record: Any, where: str) -> None:
    """Refuse a record of dataclass ``kind`` whose fields do not have its fields' types, or
    leave their bounds (`_LOWEST`, `_HIGHEST`): one line naming the field.

    Args:
        kind: `DataRecipe`, `ModelRecipe` or `TrainingRecipe`.
        record: its fields as a mapping (a missing field is left to the constructor).
        where: how the message names the record (``"the recipe's data."``).

    Raises:
        ValueError: ``record`` is not a mapping, or a field's value is refused.
    """
    if not isinstance(record, Mapping):
        raise ValueError(f"{where.rstrip('.')} is {type(record).__name__}, not a record of fields")
    hints = typing.get_type_hints(kind)
    for name, value in record.items():
        if name in hints and (problem := _field_problem(name, hints[name], value)):
            raise ValueError(f"{where}{name}: {value!r} is not {problem}; {_DAMAGED}")


def _field_problem(name: str, hint: Any, value: Any) -> str | None:
    """What ``value`` lacks to be field ``name`` of type ``hint`` (None: nothing)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None
        hint = next(h for h in typing.get_args(hint) if h is not type(None))
    if typing.get_origin(hint) is tuple:
        items = typing.get_args(hint)[0]
        ok = isinstance(value, (list, tuple)) and not any(map(_number_problem(items), value))
        return None if ok else f"a list of {_WORDS[items].removeprefix('a ')}s"
    if hint in (int, float):
        problem = _number_problem(hint)(value)
        if problem is None and hint is int:
            low, high = _LOWEST.get(name), _HIGHEST.get(name)
            if (low is not None and value < low) or (high is not None and value > high):
                return f"in [{low}, {high}]" if high else f"at least {low}"
        return problem
    if hint in (bool, str) and not isinstance(value, hint):
        return _WORDS[hint]
    return None


_WORDS = {int: "a whole number", float: "a finite number", bool: "true or false", str: "a string"}


def _number_problem(hint: type) -> Any:
    """``value -> what it lacks to be a number of type hint`` (None: nothing)."""

    def problem(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float) if hint is float else int):
            return _WORDS[hint]
        return None if math.isfinite(value) else _WORDS[hint]

    return problem


def _image_format(record: Any) -> ImageFormat:
    """The recorded decoding (`ImageFormat`), a refused field named as the recipe's."""
    if not isinstance(record, Mapping):
        raise ValueError(f"the recipe's data.image is {type(record).__name__}, not a record")
    try:
        return ImageFormat(**record)
    except ValueError as err:
        raise ValueError(f"the recipe's data.image.{err}; {_DAMAGED}") from None


# --------------------------------------------------------------------------- from arguments


def resolve_learner_args(args: Mapping[str, Any]) -> dict[str, Any]:
    """Flat experiment arguments with the values a run left open filled in, once.

    Open values (None) of the learner's arguments that a run always records (``inner_lr``,
    ``inner_steps`` and the algorithm's own flags: iMAML's ``cg_damping``, MAML++'s
    ``msl_steps``, LoRA's rank ``lora_rank``, ...) take the learner constructor's defaults,
    the one place a learner's defaults live; ``outer_lr`` takes the learner's
    (`MetaLearner.default_outer_lr`: Adam's 1e-3, Reptile's 1.0), ``outer_optimizer`` the
    learner's (`MetaLearner.default_outer_optimizer`); ``train_ways`` takes
    ``ways``, ``train_shots`` ``shots``. A setting of another algorithm stays None.

    Raises:
        ValueError: an unknown algorithm, another algorithm's setting, or ``first_order``
            for an algorithm that sets its own derivative order.
    """
    algorithm = args.get("algorithm")
    if algorithm not in LEARNERS:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(LEARNERS)}")
    resolved = {**args}
    own = complete_arguments(algorithm, {})
    _check_head_flags(algorithm, resolved, own)
    _check_optimizer_flags(algorithm, resolved, own)
    for flag_name in ("inner_lr", "inner_steps", "first_order"):
        if flag_name in own and resolved.get(flag_name) is None:
            resolved[flag_name] = own[flag_name]
    for flag_name in _OWN_FLAGS:
        if flag_name not in resolved:
            continue
        if flag_name not in own and resolved[flag_name] is not None:
            owners = " or ".join(algorithms_taking(flag_name))
            raise ValueError(f"--{flag_name.replace('_', '-')} is a setting of {owners}; drop "
                             f"it for {algorithm}")  # fmt: skip
        if flag_name in own and resolved[flag_name] is None:
            resolved[flag_name] = own[flag_name]
    if resolved.get("first_order") is not None and "first_order" not in own:
        scheduled = "first_order_steps" in own
        hint = " (first order until --first-order-steps)" if scheduled else ""
        raise ValueError(f"{algorithm} sets its own derivative order{hint}; drop --first-order")
    if resolved.get("outer_lr") is None and "outer_lr" in resolved:
        resolved["outer_lr"] = LEARNERS[algorithm].default_outer_lr
    if resolved.get("outer_optimizer") is None and "outer_optimizer" in resolved:
        resolved["outer_optimizer"] = LEARNERS[algorithm].default_outer_optimizer
    if resolved.get("train_ways") is None and "ways" in resolved:
        resolved["train_ways"] = resolved["ways"]  # the one place train_ways defaults to ways
    if resolved.get("train_shots") is None and "shots" in resolved:
        resolved["train_shots"] = resolved["shots"]  # and train_shots to shots
    return resolved


def flag_arguments(algorithm: str) -> set[str]:
    """The arguments of ``algorithm``'s learner that a flag sets (the rest are recorded at
    their defaults)."""
    takes = complete_arguments(algorithm, {})
    return {argument for argument in LEARNER_FLAGS if argument in takes}


def _check_head_flags(algorithm: str, args: Mapping[str, Any], own: Mapping[str, Any]) -> None:
    """Refuse inner-loop flags for a learner with no inner loop, and ``--train-ways`` other
    than ``--ways`` for one that adapts the model's own head (sized ``--ways``)."""
    if not can(algorithm, "inner_loop"):
        inner = ("inner_lr", "inner_steps", "first_order", "gradient_checkpointing")
        given = [flag for flag in inner if args.get(flag) not in (None, False)]
        if given:
            flags = ", ".join("--" + flag.replace("_", "-") for flag in given)
            raise ValueError(f"{algorithm} solves its head per task, with no inner loop; drop "
                             f"{flags}")  # fmt: skip
    train_ways, ways = args.get("train_ways"), args.get("ways")
    if train_ways is not None and train_ways != ways and not can(algorithm, "head_sized_per_task"):
        sized = ", ".join(algorithms_that("head_sized_per_task"))
        raise ValueError(f"--train-ways {train_ways} with --algorithm {algorithm}: it adapts the "
                         f"model's {ways}-way head, so it trains {ways}-way; drop --train-ways or "
                         f"use an algorithm that sizes its head per task ({sized})")  # fmt: skip


def _check_optimizer_flags(algorithm: str, args: Mapping[str, Any], own: Mapping[str, Any]) -> None:
    """Refuse the inner optimizer's flags for a learner without one, and a hyperparameter
    flag the chosen optimizer does not read."""
    given = [flag for flag in _OPTIMIZER_FLAGS if args.get(flag) is not None]
    if not can(algorithm, "inner_optimizer"):
        if given:
            takers = ", ".join(algorithms_that("inner_optimizer"))
            raise ValueError(f"--{given[0].replace('_', '-')} is a setting of the inner "
                             f"optimizer of {takers}; drop it for {algorithm}")  # fmt: skip
        return
    name = args.get("inner_optimizer") or own["inner_optimizer"]
    reads = optimizer_hyperparameters(name)
    for flag in given:
        if flag not in own:  # Reptile's inner optimizer is fixed, never learned
            raise ValueError(f"--{flag.replace('_', '-')} is not a setting of {algorithm}; "
                             "drop it")  # fmt: skip
        if flag.startswith("inner_") and flag != "inner_optimizer" and flag not in reads:
            raise ValueError(f"--{flag.replace('_', '-')} is not a hyperparameter of "
                             f"--inner-optimizer {name}; drop it")  # fmt: skip


def learner_recipe(args: Mapping[str, Any]) -> LearnerRecipe:
    """The learner a run's (resolved) flat arguments describe, every argument recorded.

    Raises:
        ValueError: an unknown algorithm, or a value the learner does not take.
    """
    algorithm = args["algorithm"]
    takes = complete_arguments(algorithm, {})
    given = {}
    for argument in LEARNER_FLAGS:
        value = args.get(argument)
        if value is None or argument not in takes:
            continue
        given[argument] = value
    return LearnerRecipe(algorithm, complete_arguments(algorithm, given))


def recipe_from_args(experiment: str, args: Mapping[str, Any]) -> Recipe:
    """The recipe of a run from its resolved flat arguments (the names of its flags).

    A key an experiment has no flag for takes the value it always runs at (the Omniglot
    experiment's ``dataset`` Omniglot, its episodic protocols, Conv4 with stride-2 blocks
    and a mean head).

    Raises:
        ValueError: an unknown data set or algorithm, or a shape the data set cannot give.
    """
    dataset = args.get("dataset", "omniglot")
    ways = args["ways"]
    image = image_format(dataset, args.get("image_size"), args.get("channels"))
    data = DataRecipe(
        dataset=dataset, root=args.get("data_root"),
        split=args.get("split", "maml") if dataset == "omniglot" else "published",
        train_tasks=args.get("train_tasks", "episodic"),
        eval_protocol=args.get("eval_protocol", "episodic"), ways=ways, shots=args["shots"],
        query=args["query"], eval_query=args["eval_query"], augment=bool(args.get("augment")),
        image=image, train_ways=args["train_ways"], train_shots=args["train_shots"],
        train_min_shots=args.get("train_min_shots"), trainval=bool(args.get("trainval")),
    )  # fmt: skip
    backbone, head = args.get("backbone", "conv4"), args.get("head", "mean")
    side = args.get("image_size")  # Omniglot's experiment has no flag: its images' side
    model = ModelRecipe(
        backbone=backbone, in_channels=image.channels, ways=ways, hidden=args["hidden"],
        pool=args.get("pool", "stride"), head=head,
        image_size=image.size if side is None and sized_by_image(backbone, head) else side,
        activation=args.get("activation", "relu"), dropout=args.get("dropout", 0.0),
    )  # fmt: skip
    algorithm = args["algorithm"]
    outer_lr = args.get("outer_lr")
    training = TrainingRecipe(
        meta_batch=args["meta_batch"], iterations=args["iterations"],
        outer_lr=LEARNERS[algorithm].default_outer_lr if outer_lr is None else outer_lr,
        eval_inner_steps=args["eval_inner_steps"], seed=args["seed"],
        val_every=args["val_every"], val_tasks=args["val_tasks"],
        test_tasks=args["test_tasks"], checkpoint_every=args["checkpoint_every"],
        curvature_every=args.get("curvature_every", 0),
        curvature_tasks=args.get("curvature_tasks", 4),
        ensemble_top_k=args.get("ensemble_top_k", 1),
        **{name: args[name] for name in _OUTER_FIELDS if name in args},
    )  # fmt: skip
    recipe = Recipe(experiment, data, model, learner_recipe(args), training)
    recipe.check()
    return recipe


def read_recipe(saved: Mapping[str, Any]) -> Recipe:
    """The recipe of a checkpoint (`Recipe.from_dict` of its ``recipe``).

    Raises:
        ValueError: a checkpoint without a recipe (written before records had one), a
            record of another format (`check_version`), or a malformed or unknown recipe.
    """
    if "recipe" not in saved:
        raise ValueError("the checkpoint holds no recipe (a metalearn before records had one "
                         f"wrote it); metalearn {metalearn.__version__} reads format "
                         f"{RECIPE_VERSION} only: train the run again")  # fmt: skip
    return Recipe.from_dict(saved["recipe"])


def with_resumed(recipe: Recipe, args: Mapping[str, Any]) -> Recipe:
    """``recipe`` with what a resume may change taken from the merged flat ``args``: the
    iterations, the checkpoint interval, the data's folder, and the learner's memory
    settings (gradient checkpointing, chunk size), which change its cost, not its numbers."""
    training = dataclasses.replace(recipe.training, iterations=args["iterations"],
                                   checkpoint_every=args["checkpoint_every"])  # fmt: skip
    data = dataclasses.replace(recipe.data, root=args.get("data_root", recipe.data.root))
    defaults = complete_arguments(recipe.learner.algorithm, {})
    arguments = dict(recipe.learner.arguments)
    for argument in ("gradient_checkpointing", "chunk_size"):
        if argument in arguments and argument in args:
            value = args[argument]
            arguments[argument] = defaults[argument] if value in (None, False) else value
    learner = LearnerRecipe(recipe.learner.algorithm, arguments)
    return dataclasses.replace(recipe, training=training, data=data, learner=learner)


# --------------------------------------------------------------------------- rebuilding


def build_model(recipe: Recipe) -> nn.Module:
    """The run's backbone, freshly initialised (seed first, or load a state next)."""
    m = recipe.model
    return build_backbone(m.backbone, in_channels=m.in_channels, ways=m.ways, hidden=m.hidden,
                          pool=m.pool, head=m.head, image_size=m.image_size,
                          activation=m.activation, dropout=m.dropout)  # fmt: skip


def build_learner(recipe: Recipe, device: torch.device | str = "cpu") -> MetaLearner:
    """The run's learner around a fresh backbone, built with exactly the recorded arguments."""
    learner = make_learner(recipe.learner.algorithm, build_model(recipe), recipe.learner.arguments)
    return learner.to(device)


def build_samplers(
    data: DataRecipe,
    *,
    device: torch.device | str = "cpu",
    splits: Sequence[str] = ("train", "val", "test"),
    root: str | None = None,
) -> dict[str, EpisodicSampler]:
    """The task samplers a run trains (``train_ways`` classes, ``train_shots`` shots,
    ``query`` queries, augmented if recorded), validates and tests (``ways``, ``shots``,
    ``eval_query``) on, by its protocols.

    Args:
        data: the recipe's data.
        device: where the tasks' tensors live.
        splits: the splits wanted (a split the data lacks, Omniglot's alphabet ``val``, is
            left out).
        root: the data's folder here, when it moved (default: the recorded one).

    Raises:
        ValueError, FileNotFoundError: what the loaders refuse (missing or malformed data).
    """
    root = data.root if root is None else root
    if data.trainval and data.dataset != "omniglot":
        raise ValueError(f"trainval joins Omniglot's training and validation classes; "
                         f"{data.dataset} has no such option")  # fmt: skip
    if data.dataset != "omniglot":
        return image_set_samplers(
            data.dataset, root, ways=data.ways, shots=data.shots, queries=data.query,
            eval_queries=data.eval_query, augment=data.augment, image_size=data.image.size,
            channels=data.image.channels, splits=splits, device=device,
            train_ways=data.train_ways, train_shots=data.train_shots,
            train_min_shots=data.train_min_shots,
        )  # fmt: skip
    images = load_omniglot(
        root,
        download=root_is_default(root),
        image_size=data.image.size,
        resample=data.image.resample,
    )
    draw = {"episodic": omniglot_samplers, "within-alphabet": within_alphabet_samplers}
    common = dict(ways=data.ways, shots=data.shots, device=device, trainval=data.trainval)
    samplers: dict[str, EpisodicSampler] = {}
    if "train" in splits:
        augment = standard_augmentation("character") if data.augment else None
        wide = {**common, "ways": data.train_ways, "shots": data.train_shots}
        if data.train_min_shots is not None:  # episodic training tasks only (checked)
            wide["min_shots"] = data.train_min_shots
        train = draw[data.train_tasks](images, data.split, queries=data.query, augment=augment,
                                       **wide)  # fmt: skip
        samplers["train"] = train["train"]
    if set(splits) - {"train"}:
        evaluation = draw[data.eval_protocol](images, data.split, queries=data.eval_query,
                                              **common)  # fmt: skip
        samplers.update({s: v for s, v in evaluation.items() if s != "train" and s in splits})
    return samplers
