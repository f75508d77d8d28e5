"""An experiment's arguments: checked, resolved once, named, and resumed as the saved run.

What differs between experiments (their own argument groups, presets and refusals) is an
`Experiment`; what every experiment does with its arguments is here, once:

- `parse_args`: the command line (`metalearn.runs.cli`), under a preset; with ``--resume``,
  the flags not given take the saved run's values;
- `check_args`: values that would fail later, refused before any data loads (`UserError`),
  tasks the data set cannot give among them (`metalearn.data.check_task_sizes`, from its
  published sizes);
- `resolve_args`: the open values filled once (the learner's from its constructor,
  `metalearn.runs.recipe.resolve_learner_args`), the learner built once on the ``meta``
  device so that whatever its constructor refuses is refused here (`check_learner`), and a
  run not named by the user given a unique name (`run_name`, `new_run_identity`): the
  resolved arguments are the recipe;
- `start_from`: the run's arguments, its `metalearn.runs.recipe.Recipe` and its checkpoint,
  a resume refused where it would change what the saved run computes (`RESUMABLE`).

`metalearn.runs.run.Run` calls these at the start of a run.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from metalearn.algorithms.registry import ALGORITHMS, algorithms_that, can, make_learner
from metalearn.checkpoint import load_checkpoint
from metalearn.data import check_task_sizes
from metalearn.runs.cli import flag, flag_value, flatten, parse_dataclass, unflatten
from metalearn.runs.lifecycle import UserError, merge_resumed_args, require
from metalearn.runs.outer_loop import check_outer_loop
from metalearn.runs.recipe import (
    LEARNER_FLAGS,
    Recipe,
    build_model,
    read_recipe,
    recipe_from_args,
    resolve_learner_args,
    with_resumed,
)
from metalearn.runs.tracking import check_mode

__all__ = [
    "RESUMABLE",
    "Experiment",
    "check_args",
    "check_learner",
    "checkpoint_owner",
    "checkpoint_path",
    "make_recipe",
    "new_run_identity",
    "parse_args",
    "require_at_least_one",
    "require_owner",
    "require_positive_finite",
    "resolve_args",
    "run_name",
    "saved_run_args",
    "start_from",
]

# What --resume may change: how long, where, how fast and with how much memory the run goes
# on (compiling, checkpointing and chunking compute the same meta-gradient), not what it
# computes.
RESUMABLE = (
    "iterations", "checkpoint_every", "gradient_checkpointing", "chunk_size", "compile",
    "device", "threads", "tune_malloc", "track", "wandb_mode", "wandb_group", "log_model",
    "dist_timeout", "data_root", "out_dir", "resume",
)  # fmt: skip
_AT_LEAST_ONE = (
    "ways", "train_ways", "shots", "train_shots", "train_min_shots", "query", "eval_query",
    "meta_batch", "iterations", "hidden", "val_every", "val_tasks", "test_tasks",
    "checkpoint_every", "inner_steps", "curvature_tasks", "chunk_size", "msl_steps", "lora_rank",
    "ensemble_top_k",
)  # fmt: skip


def _no_check(args: Any) -> None:
    """No refusals of the experiment's own."""


def _unchanged(args: Any) -> Any:
    return args


def _no_tags(args: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class Experiment:
    """What one experiment adds to the shared arguments.

    Attributes:
        name: the experiment's name (``experiments/<name>.py``), recorded in its recipes.
        args_type: its arguments (a subclass of `metalearn.runs.arguments.ExperimentArgs`).
        description: ``--help``'s opening text.
        presets: named groups of flat argument values (``--preset NAME``).
        check: the experiment's own refusals, run after the shared ones (`UserError`).
        resolve: fills the experiment's own open values (before the learner's are filled).
        tags: ``args -> extra W&B tags`` (after algorithm, dataset and NwKs).
    """

    name: str
    args_type: type
    description: str
    presets: Mapping[str, Mapping[str, Any]]
    check: Callable[[Any], None] = _no_check
    resolve: Callable[[Any], Any] = _unchanged
    tags: Callable[[Any], list[str]] = _no_tags


# --------------------------------------------------------------------------- names


def run_name(args: Any) -> str:
    """The descriptive part of the name of a run the user did not name (the one place run
    names are made; `new_run_identity` makes it unique).

    ``algorithm-NwKs-lrLR-stepsS-seedS``: the values a grid usually varies (no lr and steps
    for a learner without an inner loop; ``-trainMw`` when training tasks are wider,
    ``-trainJs`` when they have other shots, ``-trainI-Js`` when random ones), after
    ``dataset-backbone-`` for an experiment with a choice of data set.
    """
    a = flatten(args)
    inner = "" if a["inner_lr"] is None else f"-lr{a['inner_lr']:g}-steps{a['inner_steps']}"
    wide, more = a.get("train_ways"), a.get("train_shots")
    train = f"-train{wide}w" if wide not in (None, a["ways"]) else ""
    low = a.get("train_min_shots")
    if low is not None:
        train += f"-train{low}-{a['shots'] if more is None else more}s"
    elif more not in (None, a["shots"]):
        train += f"-train{more}s"
    name = f"{a['algorithm']}-{a['ways']}w{a['shots']}s{train}{inner}-seed{a['seed']}"
    return f"{a['dataset']}-{a['backbone']}-{name}" if "dataset" in a else name


_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


def new_run_identity(description: str, environ: Mapping[str, str] = os.environ) -> tuple[str, str]:
    """The name and W&B run id of a run the user did not name.

    The W&B id is 8 random characters (36**8 ids: two runs meet with probability about
    n**2 / 5.6e12) and the name is ``description-ID``, so two runs with the same settings
    (a grid cell and a sweep cell, two sweeps of one file, the same command twice) never
    share a folder or a W&B run. Under a W&B agent (``WANDB_SWEEP_ID`` and
    ``WANDB_RUN_ID`` set) the run must take the agent's run id, and the name
    ``description-SWEEP-ID`` also says which sweep it belongs to.
    """
    sweep, agent_run = environ.get("WANDB_SWEEP_ID"), environ.get("WANDB_RUN_ID")
    if sweep and agent_run:
        return f"{description}-{sweep}-{agent_run}", agent_run
    run_id = "".join(secrets.choice(_ID_ALPHABET) for _ in range(8))
    return f"{description}-{run_id}", run_id


def checkpoint_path(args: Any) -> Path:
    """Where a run of (resolved) ``args`` keeps its checkpoint."""
    return Path(args.tracking.out_dir) / str(args.tracking.run_name) / "checkpoint.pt"


# --------------------------------------------------------------------------- checks


def check_args(exp: Experiment, args: Any) -> None:
    """Refuse values that would fail later (or silently do nothing), before any data loads."""
    a = flatten(args)
    require_at_least_one(a, _AT_LEAST_ONE)
    for name in ("ways", "train_ways"):
        require(a.get(name) is None or a[name] >= 2,
                f"{flag(name)} {a.get(name)}: a task needs at least 2 classes")  # fmt: skip
    require_positive_finite(a, ("inner_lr", "outer_lr", "dist_timeout"))
    require(a["cg_damping"] is None or (math.isfinite(a["cg_damping"]) and a["cg_damping"] >= 0),
            f"--cg-damping {a['cg_damping']}: must be >= 0 and finite")  # fmt: skip
    for name in ("eval_inner_steps", "curvature_every", "first_order_steps"):
        require(a[name] is None or a[name] >= 0, f"{flag(name)} {a[name]}: must be >= 0")
    require(a["threads"] >= 0,
            f"--threads {a['threads']}: must be at least 1, or 0 for torch's default")  # fmt: skip
    require(0 <= a["seed"] < 2**32, f"--seed {a['seed']}: must be in [0, 2**32)")
    require(a.get("inner_eps") != 0,
            "--inner-eps 0: Adam and RMSprop divide by sqrt(v) + eps, 0 / 0 where a gradient "
            "entry is 0 (a dead ReLU's); pass a positive --inner-eps, e.g. 1e-8")  # fmt: skip
    if a["track"]:
        check_mode(a["wandb_mode"])  # online needs a key: refused now, not after the data
    _check_ensemble(a)
    _check_device(a["device"])
    _check_run_folder(a["out_dir"], a["run_name"], a["resume"])
    exp.check(args)
    _check_task_sizes(a)
    _check_random_shots(a)


def _check_random_shots(a: Mapping[str, Any]) -> None:
    """Random shots need a range and episodic training tasks (the within-alphabet sampler
    has no random shots)."""
    low = a.get("train_min_shots")
    if low is None:
        return
    top = a["shots"] if a.get("train_shots") is None else a["train_shots"]
    require(low <= top, f"--train-min-shots {low}: must be at most --train-shots "
                        f"{top}, the most support examples a training task draws")  # fmt: skip
    train_tasks = a.get("train_tasks", "episodic")
    require(train_tasks == "episodic", f"--train-min-shots with --train-tasks {train_tasks}: "
                                       "random shots need --train-tasks episodic")  # fmt: skip


def require_at_least_one(values: Mapping[str, Any], names: Iterable[str]) -> None:
    """Refuse (`UserError`, one line naming the flag) the first of ``names`` whose value in
    ``values`` (flat arguments, name -> value) is below 1; an absent or None value is unset."""
    for name in names:
        value = values.get(name)
        require(value is None or value >= 1, f"{flag(name)} {value}: must be at least 1")


def require_positive_finite(values: Mapping[str, Any], names: Iterable[str]) -> None:
    """Refuse (`UserError`, one line naming the flag) the first of ``names`` whose value in
    ``values`` is not a positive finite number (NaN, infinite, 0 or below); None is unset."""
    for name in names:
        value = values.get(name)
        require(value is None or (math.isfinite(value) and value > 0),
                f"{flag(name)} {value}: must be a positive finite number")  # fmt: skip


def _check_ensemble(a: Mapping[str, Any]) -> None:
    """Refuse an ensemble larger than the run's validations (each ranks one set of weights)
    or of a learner whose query predictions are not the network's (`MetaLearner.query_logits`)."""
    k = a.get("ensemble_top_k", 1)
    if k is None or k <= 1:
        return
    iterations, every = a["iterations"], a["val_every"]
    validations = math.ceil(iterations / every) if iterations >= 1 and every >= 1 else 0
    require(k <= validations,
            f"--ensemble-top-k {k} is more than the {validations} validations the run does "
            f"(--iterations {iterations}, --val-every {every}); pass at most {validations} or "
            "validate more often")  # fmt: skip
    algorithm = a["algorithm"]
    require(algorithm not in ALGORITHMS or can(algorithm, "query_logits"),
            f"--ensemble-top-k {k} averages the query logits of the network at adapted "
            f"weights; {algorithm} scores queries otherwise: drop --ensemble-top-k or use one "
            f"of {', '.join(algorithms_that('query_logits'))}")  # fmt: skip


def _check_task_sizes(a: Mapping[str, Any]) -> None:
    """Refuse tasks the data set cannot give (its published classes per split and examples
    per class), before minutes of decoding."""
    try:
        check_task_sizes(
            a.get("dataset", "omniglot"), ways=a["ways"], shots=a["shots"], query=a["query"],
            eval_query=a["eval_query"], train_ways=a.get("train_ways"),
            train_shots=a.get("train_shots"),
            split=a.get("split", "maml"), train_tasks=a.get("train_tasks", "episodic"),
            eval_protocol=a.get("eval_protocol", "episodic"),
        )  # fmt: skip
    except ValueError as err:
        raise UserError(str(err)) from None


def _check_device(device: str) -> None:
    """Refuse a device this torch cannot use, before anything loads (torch would raise an
    AssertionError at the first tensor moved there)."""
    try:
        kind = torch.device(device).type
    except (RuntimeError, ValueError):
        raise UserError(f"--device {device}: not a torch device; e.g. cpu, cuda, cuda:1") from None
    if kind == "cuda" and not torch.cuda.is_available():
        build = "built without CUDA" if torch.version.cuda is None else "seeing no CUDA device"
        raise UserError(f"--device {device}: this torch ({torch.__version__}) is {build}; "
                        "pass --device cpu")  # fmt: skip


def _check_run_folder(out_dir: str, run_name: str | None, resume: bool) -> None:
    """Refuse a resume without a run name, a run name that is not one folder name, and an
    --out-dir that cannot be written, before anything runs (a run that cannot checkpoint
    would lose its work)."""
    require(not resume or run_name is not None,
            "--resume continues the run named by --run-name: pass --run-name NAME (its "
            "folder under --out-dir)")  # fmt: skip
    if run_name is not None:
        require(run_name not in ("", ".", "..") and "/" not in run_name
                and "\\" not in run_name and "\0" not in run_name,
                f"--run-name {run_name!r}: a run's name is one folder name under --out-dir "
                "(no '/', not empty, '.' or '..')")  # fmt: skip
    out = Path(out_dir).expanduser()
    existing = next(p for p in (out, *out.parents) if p.exists())
    require(existing.is_dir(),
            f"--out-dir {out_dir}: {existing} is a file, not a folder; give a folder")  # fmt: skip
    require(
        os.access(existing, os.W_OK | os.X_OK),
        f"--out-dir {out_dir}: {existing} is not writable; give a folder you can write to",
    )


def resolve_args(exp: Experiment, args: Any) -> Any:
    """Checked ``args`` with the open values filled in, and a run not named by the user
    given a new unique name and W&B id (`new_run_identity`): resolve once, then pass the
    result on (resolving resolved arguments changes nothing)."""
    check_args(exp, args)
    try:
        flat = resolve_learner_args(flatten(exp.resolve(args)))
        check_outer_loop(flat)  # after resolving: the learner's outer lr and optimizer
    except ValueError as err:
        raise UserError(str(err)) from None
    resolved = unflatten(exp.args_type, flat)
    check_learner(make_recipe(exp, resolved), flat)
    tracking = resolved.tracking
    if tracking.run_name is None:
        tracking.run_name, chosen_id = new_run_identity(run_name(resolved))
        tracking.wandb_id = tracking.wandb_id or chosen_id
    elif tracking.wandb_id is None and not tracking.resume and os.environ.get("WANDB_SWEEP_ID"):
        tracking.wandb_id = os.environ.get("WANDB_RUN_ID")  # the agent's run, named by the user
    return resolved


def make_recipe(exp: Experiment, args: Any) -> Recipe:
    """The recipe of resolved ``args``.

    Raises:
        UserError: a data set, algorithm or shape the recipe refuses.
    """
    try:
        return recipe_from_args(exp.name, flatten(args))
    except ValueError as err:
        raise UserError(str(err)) from None


def check_learner(recipe: Recipe, flags: Mapping[str, Any]) -> None:
    """Build the recipe's learner on the ``meta`` device (no memory, no data) so that a value
    its constructor refuses (an inner optimizer's ``inner_beta1=1.0``, ...) is refused before
    anything loads.

    Args:
        recipe: the run's recipe.
        flags: the run's flat arguments; an argument named in the refusal that is one of them
            is named as its flag (a flag is named after the argument it sets).

    Raises:
        UserError: the learner's refusal, in one line.
    """
    try:
        with torch.device("meta"):
            make_learner(recipe.learner.algorithm, build_model(recipe), recipe.learner.arguments)
    except ValueError as err:
        message = str(err)
        named = re.match(r"(\w+)=(\S+) (.*)", message)
        if named and named[1] in flags:
            message = f"{flag(named[1])} {named[2]} {named[3]}"
        raise UserError(message) from None


def _read(path: Path) -> dict:
    """A run's checkpoint, or a one-line `UserError` naming why it cannot be resumed."""
    try:
        saved = load_checkpoint(path)
    except FileNotFoundError as err:
        raise UserError(str(err)) from None
    except Exception as err:  # truncated, empty, or not a checkpoint at all
        raise UserError(f"{path} cannot be read as a checkpoint ({type(err).__name__}); it is "
                        "damaged or not a metalearn run: start a new run with another "
                        "--run-name") from None  # fmt: skip
    if not isinstance(saved, dict) or "args" not in saved:
        raise UserError(f"{path} is not a metalearn run's checkpoint (no 'args' entry)")
    return saved


def checkpoint_owner(saved: Mapping[str, Any]) -> str | None:
    """The experiment that wrote a run's checkpoint: its recipe's, or a meta-RL run's own
    entry (`metalearn.runs.policy_run`); None when it names none (then
    `metalearn.runs.recipe.read_recipe` refuses it: no recipe)."""
    recipe = saved.get("recipe")
    if isinstance(recipe, Mapping) and isinstance(recipe.get("experiment"), str):
        return recipe["experiment"]
    if isinstance(saved.get("experiment"), str):
        return saved["experiment"]
    return None


def require_owner(exp: Experiment, path: Path, saved: Mapping[str, Any]) -> None:
    """Refuse to resume a checkpoint another experiment wrote, naming the one that did.

    Raises:
        UserError: its owner (`checkpoint_owner`) is not ``exp``.
    """
    owner = checkpoint_owner(saved)
    require(owner in (None, exp.name),
            f"{path} is a run of experiments/{owner}.py, not of experiments/{exp.name}.py; "
            "resume it with that script")  # fmt: skip


def _saved_recipe(exp: Experiment, path: Path, saved: Mapping[str, Any]) -> Recipe:
    """The recipe a checkpoint holds, refused unless this experiment wrote it."""
    require_owner(exp, path, saved)
    try:
        recipe = read_recipe(saved)
    except ValueError as err:
        raise UserError(f"{path}: {err}") from None
    require(recipe.experiment == exp.name,
            f"{path} is a run of experiments/{recipe.experiment}.py, not of "
            f"experiments/{exp.name}.py; resume it with that script")  # fmt: skip
    return recipe


def start_from(exp: Experiment, args: Any) -> tuple[Any, Recipe, dict | None]:
    """The run's arguments, its recipe and its checkpoint (None for a fresh run). Writes
    nothing.

    Raises:
        UserError: resuming a run that does not exist or that another experiment wrote, a
            resume that changes a fixed argument, or a fresh run whose name is taken.
    """
    args = resolve_args(exp, args)
    path = checkpoint_path(args)
    if not args.tracking.resume:
        require(not path.exists(), _taken(path))
        return args, make_recipe(exp, args), None
    saved = _read(path)
    recipe = _saved_recipe(exp, path, saved)
    # The saved arguments over the experiment's defaults: a resume that sets a fixed one
    # otherwise is refused, not dropped (the recipe's format was checked above).
    recorded = {**flatten(exp.args_type()), **saved["args"]}
    merged = merge_resumed_args(recorded, flatten(args), RESUMABLE)
    require(merged["iterations"] >= saved["iteration"],
            f"--iterations {merged['iterations']} is below the {saved['iteration']} steps "
            f"{path} already holds; pass at least {saved['iteration']}")  # fmt: skip
    schedule = recipe.training.lr_schedule
    require(merged["iterations"] == recipe.training.iterations
            or schedule not in ("cosine", "linear"),
            f"--iterations {merged['iterations']}: --lr-schedule {schedule} anneals over the "
            f"run's {recipe.training.iterations} steps; resume without --iterations")  # fmt: skip
    known = {k: v for k, v in merged.items() if k in flatten(exp.args_type())}
    return unflatten(exp.args_type, known), with_resumed(recipe, merged), saved


def _taken(path: Path) -> str:
    """The refusal of a new run whose folder holds a run: nothing is overwritten, so it
    names the two ways on and a folder that is free (runs have no ``--overwrite``)."""
    name, out = path.parent.name, path.parent.parent
    free = next(f"{name}-{i}" for i in range(2, 10**6) if not (out / f"{name}-{i}").exists())
    return (f"{path} exists and is never overwritten: pass --resume to continue that run, or "
            f"--run-name {free} (a new run in {out / free}); to start it again, delete "
            f"{path.parent} first")  # fmt: skip


SavedArgs = Callable[[Experiment, Path], Mapping[str, Any]]
"""``saved_args(exp, path)``: a saved run's flat arguments, read from its checkpoint and
checked to be a run of ``exp`` (a one-line `UserError` otherwise)."""


def presets_for(exp: Experiment, argv: Sequence[str]) -> Mapping[str, Mapping[str, Any]]:
    """``exp.presets``, less the default preset's learner settings (`LEARNER_FLAGS`) when
    ``argv`` names another ``--algorithm`` than that preset's: they are the learner its
    documented result was measured with (the Omniglot ``cpu`` preset's Proto-MAML), so
    ``--algorithm maml`` with no preset trains MAML at its own defaults, as a preset of
    another algorithm would not change them."""
    default = flatten(exp.args_type()).get("preset")
    if default is None:
        return exp.presets
    preset = exp.presets.get(default, {})
    named = flag_value(argv, "--algorithm")
    if "algorithm" not in preset or named in (None, preset["algorithm"]):
        return exp.presets
    kept = {k: v for k, v in preset.items() if k not in LEARNER_FLAGS}
    return {**exp.presets, default: kept}


def saved_run_args(exp: Experiment, path: Path) -> dict[str, Any]:
    """A supervised run's saved flat arguments, refused unless its checkpoint holds a recipe
    of this format (`metalearn.runs.recipe.check_version`) that ``exp`` wrote."""
    saved = _read(path)
    _saved_recipe(exp, path, saved)
    return dict(saved["args"])


def parse_args(
    exp: Experiment, argv: Sequence[str] | None = None, *, saved_args: SavedArgs = saved_run_args
) -> Any:
    """The command line as ``exp.args_type``; with ``--resume``, unspecified flags take the
    saved run's values (so ``--resume --run-name NAME`` alone continues that run).

    Args:
        exp: the experiment.
        argv: the arguments (None: ``sys.argv``).
        saved_args: reads and checks the resumed run's arguments: `saved_run_args` (a
            supervised run, whose checkpoint holds its recipe), or a meta-RL run's
            (`metalearn.runs.policy_run.saved_args`: no recipe to check).
    """
    description = exp.description.split("\n\n")[0]
    argv = list(sys.argv[1:] if argv is None else argv)
    presets = presets_for(exp, argv)
    args = parse_dataclass(exp.args_type, argv, description=description, presets=presets)
    if not args.tracking.resume:
        return args
    # Only the run's folder is checked here: the other checks need the saved values
    # (a MAML run resumed with --inner-momentum is not the default preset's Proto-MAML).
    _check_run_folder(args.tracking.out_dir, args.tracking.run_name, resume=True)
    path = checkpoint_path(args)
    if not path.is_file():  # the run names it (start_from, PolicyRun; torchrun: rank 0 has it)
        return args
    flat = saved_args(exp, path)
    fields = flatten(exp.args_type())
    known = {k: v for k, v in flat.items() if k in fields}
    base = unflatten(exp.args_type, {**known, "resume": True})
    return parse_dataclass(exp.args_type, argv, description=description, base=base)
