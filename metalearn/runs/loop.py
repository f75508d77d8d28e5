"""A meta-training experiment: arguments, recipe, resume, train loop, validation, test, W&B.

What differs between experiments (their own argument groups, presets and refusals) is an
`Experiment`; everything else is here, once, so every experiment resumes, logs, validates,
tests and refuses bad input the same way::

    EXPERIMENT = Experiment("omniglot_maml", Args, __doc__, PRESETS, check=check_args)
    run_cli(lambda args: main(EXPERIMENT, args), lambda: parse_args(EXPERIMENT))

A run is its arguments (`metalearn.runs.arguments`): they are checked before any data
loads, the open ones are resolved once (`resolve_args`), and the resolved arguments become
the run's `metalearn.runs.recipe.Recipe`, from which the data, the learner and its outer
optimiser are built. The checkpoint and the W&B config hold both the flat arguments and the
recipe; `metalearn.runs.lifecycle` says how no logged metric is lost across a kill and
resume. Before each meta-step the loop hands the learner the step (`MetaLearner.schedule`,
`MetaLearner.outer_lr_factor`), so whatever depends on training progress (MAML++'s loss
weights and derivative order, Reptile's annealed step) is a function of the step. With
``curvature_every`` N > 0, every N meta-steps the loop measures the curvature of the
support and meta losses on fixed probe tasks (`measure_curvature`). With ``compile``, the
training meta-steps compute the meta-gradient under ``torch.compile`` (`meta_gradient`);
validation and test stay eager.

Under ``torchrun`` each rank computes the meta-gradient of its share of every meta-batch
(`metalearn.distributed`); every rank draws the same global meta-batch, so N processes
train on exactly the tasks one process sees. Rank 0 alone logs, checkpoints and shows
progress; evaluation tasks are split across ranks.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from metalearn import distributed, tune_malloc
from metalearn.algorithms import HeadLearner, MetaLearner, MetaLossLearner, StepMetrics
from metalearn.algorithms.compiled import CompiledMetaGradient
from metalearn.algorithms.curvature import PROBE_SEED, meta_curvature, support_curvature
from metalearn.checkpoint import load_checkpoint, save_checkpoint
from metalearn.data import EpisodicSampler
from metalearn.engine import AllTasksSkippedError, NonFiniteLossError, Task
from metalearn.runs import lock
from metalearn.runs.cli import flag, flatten, parse_dataclass, unflatten
from metalearn.runs.evaluation import TEST_SEED, VAL_SEED, evaluate_tasks
from metalearn.runs.lifecycle import (
    NonFiniteGradientError,
    RunState,
    Stopped,
    UserError,
    diverged,
    merge_resumed_args,
    require,
    signals_held,
)
from metalearn.runs.recipe import (
    Recipe,
    build_learner,
    build_samplers,
    read_recipe,
    recipe_from_args,
    resolve_learner_args,
    upgrade_args,
    with_resumed,
)
from metalearn.runs.seeding import seed_everything
from metalearn.runs.tracking import (
    define_summaries,
    graceful_shutdown,
    init_run,
    log_model,
    run_group,
)

__all__ = [
    "RESUMABLE",
    "Experiment",
    "check_args",
    "checkpoint_path",
    "default_run_name",
    "main",
    "make_learner",
    "make_recipe",
    "make_samplers",
    "measure_curvature",
    "meta_gradient",
    "meta_step",
    "new_run_identity",
    "parse_args",
    "resolve_args",
    "start_from",
    "test",
    "train",
    "validate",
]

MetaGradient = Callable[[Sequence[Task]], StepMetrics]
"""Fills ``.grad`` of a learner's parameters with a meta-batch's meta-gradient."""

# What --resume may change: how long, where, how fast and with how much memory the run goes
# on (compiling, checkpointing and chunking compute the same meta-gradient), not what it
# computes.
RESUMABLE = (
    "iterations", "checkpoint_every", "gradient_checkpointing", "chunk_size", "compile",
    "device", "threads", "tune_malloc", "track", "wandb_mode", "wandb_group", "log_model",
    "dist_timeout", "data_root", "out_dir", "resume",
)  # fmt: skip
_AT_LEAST_ONE = (
    "ways", "train_ways", "shots", "query", "eval_query", "meta_batch", "iterations", "hidden",
    "val_every", "val_tasks", "test_tasks", "checkpoint_every", "inner_steps",
    "curvature_tasks", "chunk_size", "msl_steps", "lora_rank",
)  # fmt: skip


def default_run_name(args: Any) -> str:
    """``algorithm-NwKs-lrLR-stepsS-seedS``: the values a grid usually varies (no lr and
    steps for a learner without an inner loop; ``-trainMw`` when training tasks are wider);
    the descriptive part of a run's name, which `new_run_identity` makes unique."""
    a = flatten(args)
    inner = "" if a["inner_lr"] is None else f"-lr{a['inner_lr']:g}-steps{a['inner_steps']}"
    wide = a.get("train_ways")
    train = f"-train{wide}w" if wide not in (None, a["ways"]) else ""
    return f"{a['algorithm']}-{a['ways']}w{a['shots']}s{train}{inner}-seed{a['seed']}"


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


def _no_check(args: Any) -> None:
    """No refusals of the experiment's own."""


def _unchanged(args: Any) -> Any:
    return args


def _no_tags(args: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class Experiment:
    """What one experiment adds to the shared run.

    Attributes:
        name: the experiment's name (``experiments/<name>.py``), recorded in its recipes.
        args_type: its arguments (a subclass of `metalearn.runs.arguments.ExperimentArgs`).
        description: ``--help``'s opening text.
        presets: named groups of flat argument values (``--preset NAME``).
        check: the experiment's own refusals, run after the shared ones (`UserError`).
        resolve: fills the experiment's own open values (before the learner's are filled).
        run_name: ``args -> name`` of a run not given ``--run-name``.
        tags: ``args -> extra W&B tags`` (after algorithm, dataset and NwKs).
    """

    name: str
    args_type: type
    description: str
    presets: Mapping[str, Mapping[str, Any]]
    check: Callable[[Any], None] = _no_check
    resolve: Callable[[Any], Any] = _unchanged
    run_name: Callable[[Any], str] = default_run_name
    tags: Callable[[Any], list[str]] = _no_tags


# --------------------------------------------------------------------------- arguments


def check_args(exp: Experiment, args: Any) -> None:
    """Refuse values that would fail later (or silently do nothing), before any data loads."""
    a = flatten(args)
    for name in _AT_LEAST_ONE:
        value = a.get(name)
        require(value is None or value >= 1, f"{flag(name)} {value}: must be at least 1")
    for name in ("ways", "train_ways"):
        require(a.get(name) is None or a[name] >= 2,
                f"{flag(name)} {a.get(name)}: a task needs at least 2 classes")  # fmt: skip
    for name in ("inner_lr", "outer_lr", "dist_timeout"):
        value = a[name]
        require(value is None or (math.isfinite(value) and value > 0),
                f"{flag(name)} {value}: must be a positive finite number")  # fmt: skip
    require(a["cg_damping"] is None or (math.isfinite(a["cg_damping"]) and a["cg_damping"] >= 0),
            f"--cg-damping {a['cg_damping']}: must be >= 0 and finite")  # fmt: skip
    for name in ("eval_inner_steps", "curvature_every", "first_order_steps"):
        require(a[name] is None or a[name] >= 0, f"{flag(name)} {a[name]}: must be >= 0")
    require(a["threads"] >= 0,
            f"--threads {a['threads']}: must be at least 1, or 0 for torch's default")  # fmt: skip
    require(0 <= a["seed"] < 2**32, f"--seed {a['seed']}: must be in [0, 2**32)")
    _check_device(a["device"])
    _check_run_folder(a["out_dir"], a["run_name"], a["resume"])
    exp.check(args)


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
    except ValueError as err:
        raise UserError(str(err)) from None
    resolved = unflatten(exp.args_type, flat)
    tracking = resolved.tracking
    if tracking.run_name is None:
        tracking.run_name, chosen_id = new_run_identity(exp.run_name(resolved))
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


def checkpoint_path(args: Any) -> Path:
    return Path(args.tracking.out_dir) / str(args.tracking.run_name) / "checkpoint.pt"


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


def _saved_recipe(exp: Experiment, path: Path, saved: Mapping[str, Any]) -> Recipe:
    """The recipe a checkpoint holds, refused unless this experiment wrote it."""
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
        require(not path.exists(), f"{path} exists: pass --resume to continue that run, or "
                                   "--run-name NEW for a new one")  # fmt: skip
        return args, make_recipe(exp, args), None
    saved = _read(path)
    recipe = _saved_recipe(exp, path, saved)
    # A flag the record predates ran at its default: a resume that sets it otherwise is
    # refused like any other change, not dropped.
    recorded = {**flatten(exp.args_type()), **upgrade_args(saved["args"])}
    merged = merge_resumed_args(recorded, flatten(args), RESUMABLE)
    require(merged["iterations"] >= saved["iteration"],
            f"--iterations {merged['iterations']} is below the {saved['iteration']} steps "
            f"{path} already holds; pass at least {saved['iteration']}")  # fmt: skip
    known = {k: v for k, v in merged.items() if k in flatten(exp.args_type())}
    return unflatten(exp.args_type, known), with_resumed(recipe, merged), saved


def parse_args(exp: Experiment, argv: Sequence[str] | None = None) -> Any:
    """The command line as ``exp.args_type``; with ``--resume``, unspecified flags take the
    saved run's values (so ``--resume --run-name NAME`` alone continues that run)."""
    description = exp.description.split("\n\n")[0]
    args = parse_dataclass(exp.args_type, argv, description=description, presets=exp.presets)
    if not args.tracking.resume:
        return args
    # Only the run's folder is checked here: the other checks need the saved values
    # (a MAML run resumed with --inner-momentum is not the default preset's Proto-MAML).
    _check_run_folder(args.tracking.out_dir, args.tracking.run_name, resume=True)
    path = checkpoint_path(args)
    if not path.is_file():  # start_from names it (or rank 0 holds it, under torchrun)
        return args
    saved = _read(path)
    _saved_recipe(exp, path, saved)
    fields = flatten(exp.args_type())
    flat = {k: v for k, v in upgrade_args(saved["args"]).items() if k in fields}
    base = unflatten(exp.args_type, {**flat, "resume": True})
    return parse_dataclass(exp.args_type, argv, description=description, base=base)


# --------------------------------------------------------------------------- the pieces


def make_samplers(recipe: Recipe, device: str) -> dict[str, EpisodicSampler]:
    """The run's train, validation and test samplers (`build_samplers`), one process per
    machine filling the decoded cache first.

    Raises:
        UserError: missing or malformed data.
    """
    try:
        with distributed.main_first():
            return build_samplers(recipe.data, device=device)
    except (FileNotFoundError, ValueError, ImportError) as err:  # ImportError: h5py missing
        raise UserError(" ".join(str(err).split())) from None


def make_learner(recipe: Recipe, device: str) -> MetaLearner:
    """The recipe's learner around a fresh backbone, seeded by the recipe's seed."""
    seed_everything(recipe.training.seed)
    return build_learner(recipe, device)


def _make_run(exp: Experiment, args: Any, recipe: Recipe, state: RunState,
              learner: MetaLearner) -> Any:  # fmt: skip
    """The W&B run (None without tracking), continuing ``state.wandb_id`` on resume.

    A resumed run first re-logs the checkpoint's history (see `metalearn.runs.lifecycle`).
    """
    t = args.tracking
    if not t.track or not distributed.is_main():
        return None
    data = recipe.data
    run = init_run(
        {**flatten(args), "experiment": exp.name, "recipe": recipe.to_dict(),
         "dataset": data.dataset, "params": sum(p.numel() for p in learner.parameters()),
         "world_size": distributed.info().world_size},
        project=t.wandb_project, mode=t.wandb_mode, name=state.run_name,
        group=run_group(recipe.learner.algorithm, data.ways, data.shots, t.wandb_group),
        tags=[recipe.learner.algorithm, data.dataset, f"{data.ways}w{data.shots}s",
              *exp.tags(args)],
        dir=t.out_dir, run_id=state.wandb_id, job_type="train",
    )  # fmt: skip
    if run is not None:
        state.wandb_id = run.id
        define_summaries(run)
        for row in state.history:
            run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])
    return run


def _make_progress(recipe: Recipe, state: RunState, has_val: bool) -> tqdm:
    """One bar over every task left to run: training, validations and the test.

    Counting tasks (not steps) lets the ETA include validation and test; an evaluation
    task (more inner steps, no meta-gradient) costs roughly what a training task does.
    """
    t = recipe.training
    steps = range(state.iteration + 1, t.iterations + 1)
    validations = sum(1 for s in steps if s % t.val_every == 0 or s == t.iterations)
    total = len(steps) * t.meta_batch + validations * t.val_tasks * has_val
    return tqdm(total=total + t.test_tasks, initial=0, desc="train", unit="task",
                dynamic_ncols=True, disable=not distributed.is_main())  # fmt: skip


# --------------------------------------------------------------------------- train, evaluate


def train(
    recipe: Recipe,
    path: Path,
    learner: MetaLearner,
    samplers: dict,
    state: RunState,
    run: Any,
    bar: tqdm,
    saved: dict | None,
    backward: MetaGradient | None = None,
    record: Mapping[str, Any] | None = None,
) -> dict:
    """Meta-train from ``state`` (fresh or resumed); returns the last checkpoint written.

    Args:
        recipe: the run's recipe.
        path: its checkpoint file.
        learner, samplers, state, run, bar: the run's learner, samplers, state, W&B run
            (or None) and progress bar.
        saved: the checkpoint resumed from (None: a fresh run).
        backward: computes each step's meta-gradient (default ``learner.backward``).
        record: what every checkpoint also holds (the flat arguments, the recipe).
    """
    t = recipe.training
    opt = learner.outer_optimizer(t.outer_lr)
    gen = torch.Generator().manual_seed(t.seed)
    if saved is not None:
        opt.load_state_dict(saved["optimizer"])
        gen.set_state(saved["generator"])
    record = dict(record or {})
    snapshot = _snapshot(record, learner, opt, gen, state)
    probe = _curvature_probe(t, samplers["train"])
    try:
        for it in range(state.iteration, t.iterations):
            bar.set_description("train")
            row = meta_step(recipe, learner, opt, samplers["train"], gen, backward, it)
            bar.update(t.meta_batch)
            if probe is not None and (it + 1) % t.curvature_every == 0:
                bar.set_description("curvature")
                row.update(measure_curvature(learner, probe))
            if (it + 1) % t.val_every == 0 or it + 1 == t.iterations:
                row.update(validate(recipe, learner, samplers, state, it + 1, bar))
            state.iteration = it + 1
            state.history.append({"step": state.iteration, **row})
            # Everything a resumed run needs, taken only at step boundaries, so an interrupt
            # anywhere inside a step resumes from the last *completed* one.
            snapshot = _snapshot(record, learner, opt, gen, state)
            if run is not None:
                run.log(row, step=state.iteration)
            bar.set_postfix(_postfix(row, state), refresh=False)
            if state.iteration % t.checkpoint_every == 0:
                distributed.check_same(learner.parameters())  # a diverged rank fails loudly
                if distributed.is_main():
                    save_checkpoint(path, snapshot)
    except (NonFiniteLossError, AllTasksSkippedError, NonFiniteGradientError) as err:
        raise diverged(err, state.iteration + 1) from None
    finally:
        # Ctrl-C / SIGTERM / an error: keep the last completed step, so --resume continues.
        # No collective here: the other ranks may be gone.
        if distributed.is_main():
            with signals_held():
                save_checkpoint(path, snapshot)
    return snapshot


def meta_step(
    recipe: Recipe,
    learner: MetaLearner,
    opt: torch.optim.Optimizer,
    sampler: EpisodicSampler,
    gen: torch.Generator,
    backward: MetaGradient | None = None,
    step: int = 0,
) -> dict[str, float]:
    """Meta-step ``step`` (0-based) on this rank's share of a meta-batch; its logged metrics.

    The learner is first handed the step (`MetaLearner.schedule`) and the outer step size
    set from it (`MetaLearner.outer_lr_factor`). ``backward`` fills ``.grad`` with the
    meta-gradient of the tasks (default ``learner.backward``; `meta_gradient` gives the
    run's).
    """
    t = recipe.training
    start = time.perf_counter()
    scheduled = learner.schedule(step, t.iterations)
    lr = t.outer_lr * learner.outer_lr_factor(step, t.iterations)
    for group in opt.param_groups:
        group["lr"] = lr
    tasks = _my_tasks(sampler, t.meta_batch, gen)
    opt.zero_grad(set_to_none=True)
    metrics = (learner.backward if backward is None else backward)(tasks)
    metrics = distributed.average_meta_step(learner, metrics, len(tasks))
    _check_finite_gradient(learner)
    opt.step()
    seconds = time.perf_counter() - start
    return {
        "train/loss": metrics.loss, "train/acc": metrics.accuracy, "train/outer_lr": lr,
        **scheduled, "perf/step_s": seconds, "perf/tasks_per_s": t.meta_batch / seconds,
        "perf/vectorized_tasks": metrics.vectorized, "train/skipped": metrics.skipped,
    }  # fmt: skip


def _check_finite_gradient(learner: MetaLearner) -> None:
    """Raise `NonFiniteGradientError` before the optimizer writes NaN into the weights:
    finite losses can still give an overflowing meta-gradient (one sync for all tensors)."""
    named = [(name, p.grad) for name, p in learner.named_parameters() if p.grad is not None]
    if not named or bool(torch.stack([g.isfinite().all() for _, g in named]).all()):
        return
    raise NonFiniteGradientError([name for name, g in named if not g.isfinite().all()])


def meta_gradient(args: Any, learner: MetaLearner) -> MetaGradient:
    """What fills ``.grad`` in a training step: ``learner.backward``, compiled with
    ``--compile`` (`metalearn.algorithms.compiled.CompiledMetaGradient`).

    Raises:
        UserError: ``--compile`` for a learner whose meta-step cannot be compiled.
    """
    if not args.system.compile:
        return learner.backward
    try:
        return CompiledMetaGradient(learner)
    except ValueError as err:
        raise UserError(f"--compile with --algorithm {args.learner.algorithm}: {err}") from None


def _curvature_probe(t: Any, sampler: EpisodicSampler) -> list | None:
    """The fixed probe tasks curvature is measured on (rank 0 only), or None when off.

    Drawn from the training split with their own generator (`PROBE_SEED`), so they are the
    same in every run and across a resume, and the training tasks are drawn as without them.
    """
    if t.curvature_every == 0 or not distributed.is_main():
        return None
    return sampler.batch(t.curvature_tasks, torch.Generator().manual_seed(PROBE_SEED))


def measure_curvature(learner: MetaLearner, probe: Sequence) -> dict[str, float]:
    """The ``curv/`` metrics of the learner's current theta on the probe tasks.

    ``curv/support_top_eig`` (mean over the probe tasks) and ``curv/support_top_eig_max``:
    the top eigenvalue of each task's support-loss Hessian where the inner loop starts, beside
    ``curv/two_over_inner_lr``, the eigenvalue above which the inner step of rate
    ``inner_lr`` (the configured one; learned rates differ) diverges on a quadratic
    (`metalearn.algorithms.curvature.support_curvature`). ``curv/meta_top_eig``,
    ``curv/meta_trace`` and its ``curv/meta_trace_std_error``: the second-order meta-loss
    Hessian w.r.t. theta (`metalearn.algorithms.curvature.meta_curvature`).
    ``perf/curvature_s``: the seconds it all took. Each measurement seeds its own generator
    from `PROBE_SEED`, so it depends on theta alone.
    """
    start = time.perf_counter()
    support = support_curvature(learner, probe, generator=torch.Generator().manual_seed(PROBE_SEED))
    meta = meta_curvature(learner, probe, generator=torch.Generator().manual_seed(PROBE_SEED))
    return {
        "curv/support_top_eig": float(support.mean()),
        "curv/support_top_eig_max": float(support.max()),
        "curv/two_over_inner_lr": 2 / float(learner.inner_lr),
        "curv/meta_top_eig": meta.top_eigenvalue, "curv/meta_trace": meta.trace,
        "curv/meta_trace_std_error": meta.trace_std_error,
        "perf/curvature_s": time.perf_counter() - start,
    }  # fmt: skip


def _postfix(row: dict[str, float], state: RunState) -> dict[str, str]:
    shown = {"loss": f"{row['train/loss']:.3f}", "acc": f"{row['train/acc']:.3f}"}
    if state.best_val is not None:  # nothing to show before the first validation
        shown["best_val"] = f"{state.best_val:.3f}"
    return shown


def _my_tasks(sampler: EpisodicSampler, meta_batch: int, gen: torch.Generator) -> list:
    """This rank's share of the global meta-batch (all of it in a single process).

    Every rank draws the whole meta-batch's indices from the same generator (microseconds
    per task) and builds only its own tasks, so N ranks train on exactly the tasks one
    process would, and the generator state is the same on every rank (resume, any N).
    With augmentation, each task's seed is drawn with its indices, as `EpisodicSampler.batch`
    draws it, so a rank's tasks are augmented as one process would augment them.
    """
    classes, examples, seeds = sampler.draw(gen, meta_batch)  # seeds: None unless augmenting
    part = distributed.shard_slice(meta_batch)
    mine = None if seeds is None else seeds[part]
    return sampler.tasks_from_indices(classes[part], examples[part], mine)


def _snapshot(
    record: Mapping[str, Any], learner: MetaLearner, opt, gen: torch.Generator, state: RunState
) -> dict:
    """The checkpoint of the run at a step boundary (CPU tensors; cheap next to a step).

    The history is copied as a list of the same rows (rows are never changed once logged),
    so a snapshot costs O(steps) pointers, not a deep copy of every metric.
    """
    fields = {**state.to_dict(), "history": list(state.history)}
    return {
        **record, **fields, "learner": _cpu_state(learner),
        "optimizer": copy.deepcopy(opt.state_dict()), "generator": gen.get_state(),
        "torch_rng": torch.get_rng_state(),
    }  # fmt: skip


def validate(
    recipe: Recipe,
    learner: MetaLearner,
    samplers: dict,
    state: RunState,
    iteration: int,
    bar: tqdm,
) -> dict[str, float]:
    """Validation accuracy; remembers the best weights (or the latest, with no val split)."""
    sampler = samplers.get("val")
    if sampler is None:  # a split with no validation classes: keep the latest
        state.best_learner, state.best_iteration = _cpu_state(learner), iteration
        return {}
    bar.set_description("validate")
    t = recipe.training
    gen = torch.Generator().manual_seed(VAL_SEED)
    acc, half = evaluate_tasks(learner, sampler, t.val_tasks, t.eval_inner_steps, gen,
                               progress=bar.update)  # fmt: skip
    if state.best_val is None or acc > state.best_val:
        state.best_val, state.best_iteration = acc, iteration
        state.best_learner = _cpu_state(learner)
    return {"val/acc": acc, "val/acc_ci95": half, "val/best_acc": state.best_val}


def _cpu_state(learner: MetaLearner) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in learner.state_dict().items()}


def test(
    recipe: Recipe, learner: MetaLearner, samplers: dict, state: RunState, bar: tqdm
) -> dict[str, float]:
    """Accuracy of the best-validation weights on the recipe's test tasks."""
    if state.best_learner is not None:
        learner.load_state_dict(state.best_learner)
    bar.set_description("test")
    t = recipe.training
    gen = torch.Generator().manual_seed(TEST_SEED)
    acc, half = evaluate_tasks(learner, samplers["test"], t.test_tasks, t.eval_inner_steps,
                               gen, progress=bar.update)  # fmt: skip
    return {"test/acc": acc, "test/acc_ci95": half, "test/best_iteration": state.best_iteration}


# --------------------------------------------------------------------------- main


def main(exp: Experiment, args: Any) -> dict[str, float]:
    """Meta-train, test the best-validation weights, log everything; returns the results.

    Raises:
        UserError: a bad argument, a resume that changes the run, missing data (nothing
            has been written then).
        Stopped: SIGINT/SIGTERM; the run was checkpointed and marked failed in W&B.
    """
    check_args(exp, args)  # before anything else touches the machine
    system = args.system
    if system.threads > 0:
        torch.set_num_threads(system.threads)
    if system.tune_malloc:
        tune_malloc()
    dist = distributed.init_from_env(device=system.device, timeout_s=system.dist_timeout)
    try:
        if dist.distributed:
            args = dataclasses.replace(
                args, system=dataclasses.replace(system, device=str(dist.device))
            )
        return _main(exp, args, dist)
    finally:
        distributed.cleanup()


def _main(exp: Experiment, args: Any, dist: distributed.DistInfo) -> dict[str, float]:
    meta_batch = args.training.meta_batch
    require(meta_batch >= dist.world_size,
            f"--meta-batch {meta_batch} is below the {dist.world_size} processes: every "
            "rank needs a task; raise --meta-batch or launch fewer processes")  # fmt: skip
    # Rank 0 names the run (a new name is random) and every rank takes that name; rank 0
    # holds the run folder's lock while it trains (one writer per run), reads the
    # checkpoint (only its machine need hold it) and every rank gets its answer.
    args = distributed.from_main(resolve_args, exp, args)
    folder = checkpoint_path(args).parent
    with _run_lock(folder, dist.is_main):
        args, recipe, saved = distributed.from_main(start_from, exp, args)
        return _run(exp, args, recipe, saved, dist)


@contextlib.contextmanager
def _run_lock(folder: Path, main: bool):
    """The run folder's lock on rank 0 (`metalearn.runs.lock`); a folder this call made
    for a run that then stopped before writing anything is removed again."""
    if not main:
        yield
        return
    made = not folder.exists()
    try:
        with lock.held(folder):
            yield
    finally:
        if made and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


def _run(exp: Experiment, args: Any, recipe: Recipe, saved: dict | None,
         dist: distributed.DistInfo) -> dict[str, float]:  # fmt: skip
    path = checkpoint_path(args)
    if dist.is_main:
        print(f"checkpoint: {path}", flush=True)
    device = args.system.device
    samplers = make_samplers(recipe, device)
    learner = make_learner(recipe, device)
    measurable = isinstance(learner, MetaLossLearner) and not isinstance(learner, HeadLearner)
    lacks = "no inner loop" if isinstance(learner, HeadLearner) else "no meta-loss"
    require(recipe.training.curvature_every == 0 or measurable,
            f"--curvature-every {recipe.training.curvature_every} with --algorithm "
            f"{recipe.learner.algorithm}: {type(learner).__name__} has {lacks} to measure; use "
            "maml, fomaml, anil, metasgd, mamlpp, protomaml or lora, or drop "
            "--curvature-every")  # fmt: skip
    backward = meta_gradient(args, learner)
    state = RunState(run_name=str(args.tracking.run_name), wandb_id=args.tracking.wandb_id)
    if saved is not None:
        learner.load_state_dict(saved["learner"])
        torch.set_rng_state(saved["torch_rng"])
        state = RunState.from_dict(saved)
    distributed.broadcast_params(learner)  # every rank starts from rank 0's weights
    run = _make_run(exp, args, recipe, state, learner)
    if dist.is_main:
        print(f"W&B run: {Path(run.dir).parent if run is not None else 'not tracked'}", flush=True)
    record = {"args": flatten(args), "recipe": recipe.to_dict()}
    return _train_and_test(args, recipe, path, learner, samplers, state, run, saved, dist,
                           backward, record)  # fmt: skip


def _train_and_test(args, recipe, path, learner, samplers, state, run, saved, dist, backward,
                    record) -> dict[str, float]:  # fmt: skip
    """Train, test, record; the W&B run ends failed (exit code != 0) unless all of it ran."""
    started, exit_code = time.perf_counter(), 1
    try:
        with graceful_shutdown(), _make_progress(recipe, state, "val" in samplers) as bar:
            final = train(recipe, path, learner, samplers, state, run, bar, saved, backward,
                          record)  # fmt: skip
            results = test(recipe, learner, samplers, state, bar)
        results["perf/total_minutes"] = (time.perf_counter() - started) / 60
        state.results = final["results"] = results
        if dist.is_main:
            save_checkpoint(path, final)  # a finished run (the grid skips it)
        if run is not None:
            run.summary.update(results)
            if args.tracking.log_model:
                log_model(run, path, name=f"{state.run_name}-model")
        exit_code = 0
    except (KeyboardInterrupt, distributed.PeerError) as stop:
        exit_code = stop.exit_code if isinstance(stop, Stopped) else 1
        if run is not None and isinstance(stop, Stopped):
            run.mark_preempting()  # online: shown as preempted, resumable
        where = f"rank {dist.rank}: " if dist.distributed else ""
        print(f"\n{where}stopped at step {state.iteration}; continue with --resume "
              f"--run-name {state.run_name} --out-dir {args.tracking.out_dir}")  # fmt: skip
        raise
    finally:
        if run is not None:
            run.finish(exit_code=exit_code)
    if dist.is_main:
        others = {k: v for k, v in results.items() if k not in ("test/acc", "test/acc_ci95")}
        print("  ".join(f"{k}: {v:.4g}" for k, v in others.items()))
        print(f"test/acc: {results['test/acc']:.4f} ± {results['test/acc_ci95']:.4f}")
    return results
