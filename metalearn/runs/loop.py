"""A meta-training experiment: arguments, resume, train loop, validation, test, W&B, main.

What differs between experiments (their arguments, data and network) is an `Experiment`;
everything else is here, once, so every experiment resumes, logs, validates, tests and
refuses bad input the same way::

    EXPERIMENT = Experiment(Args, __doc__, PRESETS, RESUMABLE, make_samplers, make_learner,
                            dataset=lambda args: "omniglot")
    run_cli(lambda args: main(EXPERIMENT, args), lambda: parse_args(EXPERIMENT))

The argument dataclass holds the common fields the functions below read (``algorithm``,
``ways``, ``shots``, ``query``, ``eval_query``, ``meta_batch``, ``iterations``, the learner
values, ``val_every``, ``val_tasks``, ``test_tasks``, ``checkpoint_every``, ``seed``,
``out_dir``, ``run_name``, ``resume``, ``curvature_every``, ``curvature_tasks``,
``compile``, the W&B and device fields) and its own. A run is its arguments: they are
checked before any data loads, the open ones are resolved once (`resolve_args`), and the
result is what W&B and the checkpoint record. `metalearn.runs.lifecycle` says how no logged metric is
lost across a kill and resume. With ``curvature_every`` N > 0, every N meta-steps the train
loop measures the curvature of the support and meta losses on fixed probe tasks
(`measure_curvature`) and logs it under ``curv/`` with the step's other metrics. With
``compile``, the training meta-steps compute the meta-gradient under ``torch.compile``
(`meta_gradient`); validation and test stay eager.

Under ``torchrun`` each rank computes the meta-gradient of its share of every meta-batch
(`metalearn.distributed`); every rank draws the same global meta-batch, so N processes
train on exactly the tasks one process sees. Rank 0 alone logs, checkpoints and shows
progress; evaluation tasks are split across ranks.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from metalearn import distributed, tune_malloc
from metalearn.algorithms import MetaLearner, MetaLossLearner, StepMetrics
from metalearn.algorithms.build import learner_config, resolve_learner_args
from metalearn.checkpoint import load_checkpoint, save_checkpoint
from metalearn.runs.cli import parse_dataclass
from metalearn.algorithms.compiled import CompiledMetaGradient
from metalearn.data import EpisodicSampler
from metalearn.runs.evaluation import TEST_SEED, VAL_SEED, evaluate_tasks
from metalearn.algorithms.curvature import PROBE_SEED, meta_curvature, support_curvature
from metalearn.runs.lifecycle import RunState, Stopped, UserError, merge_resumed_args, require, signals_held
from metalearn.engine import Task
from metalearn.runs.tracking import graceful_shutdown, init_run, log_model, run_group

__all__ = [
    "Experiment",
    "check_args",
    "checkpoint_path",
    "default_run_name",
    "main",
    "make_optimizer",
    "measure_curvature",
    "meta_gradient",
    "meta_step",
    "parse_args",
    "resolve_args",
    "start_from",
    "test",
    "train",
    "validate",
]

MetaGradient = Callable[[Sequence[Task]], StepMetrics]
"""Fills ``.grad`` of a learner's parameters with a meta-batch's meta-gradient."""

_AT_LEAST_ONE = (
    "ways", "shots", "query", "eval_query", "meta_batch", "iterations", "hidden",
    "val_every", "val_tasks", "test_tasks", "checkpoint_every", "inner_steps", "curvature_tasks",
)  # fmt: skip


def default_run_name(args: Any) -> str:
    """``algorithm-NwKs-lrLR-stepsS-seedS``: the values a grid usually varies."""
    return (f"{args.algorithm}-{args.ways}w{args.shots}s-lr{args.inner_lr:g}-"
            f"steps{args.inner_steps}-seed{args.seed}")  # fmt: skip


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
        args_type: the argument dataclass (the common fields, see the module docstring).
        description: ``--help``'s opening text.
        presets: named groups of argument values (``--preset NAME``).
        resumable: the fields ``--resume`` may change (how long and where, not what).
        make_samplers: ``args -> {"train", "test"[, "val"]: EpisodicSampler}``; validation
            and test samplers draw ``eval_query`` queries. Raises `UserError` on missing data.
        make_learner: ``args -> MetaLearner``, seeded by ``args.seed``, on ``args.device``.
        dataset: ``args -> name`` for the W&B config and tags.
        check: the experiment's own refusals, run after the shared ones (`UserError`).
        resolve: fills the experiment's own open values (before the learner's are filled).
        run_name: ``args -> name`` of a run not given ``--run-name``.
        tags: ``args -> extra W&B tags`` (after algorithm, dataset and NwKs).
    """

    args_type: type
    description: str
    presets: Mapping[str, Mapping[str, Any]]
    resumable: tuple[str, ...]
    make_samplers: Callable[[Any], dict[str, EpisodicSampler]]
    make_learner: Callable[[Any], MetaLearner]
    dataset: Callable[[Any], str]
    check: Callable[[Any], None] = _no_check
    resolve: Callable[[Any], Any] = _unchanged
    run_name: Callable[[Any], str] = default_run_name
    tags: Callable[[Any], list[str]] = _no_tags


# --------------------------------------------------------------------------- arguments


def check_args(exp: Experiment, args: Any) -> None:
    """Refuse values that would fail later (or silently do nothing), before any data loads."""
    for name in _AT_LEAST_ONE:
        value = getattr(args, name)
        require(value is None or value >= 1, f"{_flag(name)} {value}: must be at least 1")
    require(args.ways >= 2, f"--ways {args.ways}: a task needs at least 2 classes")
    for name in ("inner_lr", "outer_lr", "dist_timeout"):
        value = getattr(args, name)
        require(value is None or value > 0, f"{_flag(name)} {value}: must be positive")
    require(args.cg_damping is None or args.cg_damping >= 0,
            f"--cg-damping {args.cg_damping}: must be >= 0")  # fmt: skip
    require(args.eval_inner_steps >= 0, f"--eval-inner-steps {args.eval_inner_steps}: must be >= 0")
    require(args.curvature_every >= 0,
            f"--curvature-every {args.curvature_every}: must be >= 0 (0: off)")  # fmt: skip
    require(
        args.threads >= 0, f"--threads {args.threads}: must be at least 1, or 0 for torch's default"
    )
    require(0 <= args.seed < 2**32, f"--seed {args.seed}: must be in [0, 2**32)")
    exp.check(args)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def resolve_args(exp: Experiment, args: Any) -> Any:
    """Checked ``args`` with the open values and the run name filled in."""
    check_args(exp, args)
    try:
        resolved = exp.args_type(**resolve_learner_args(dataclasses.asdict(exp.resolve(args))))
    except ValueError as err:
        raise UserError(str(err)) from None
    if resolved.run_name is None:
        resolved.run_name = exp.run_name(resolved)
    return resolved


def checkpoint_path(args: Any) -> Path:
    return Path(args.out_dir) / str(args.run_name) / "checkpoint.pt"


def start_from(exp: Experiment, args: Any) -> tuple[Any, dict | None]:
    """The run's arguments and its checkpoint (None for a fresh run). Writes nothing.

    Raises:
        UserError: resuming a run that does not exist, a resume that changes a fixed
            argument, or a fresh run whose name is taken.
    """
    args = resolve_args(exp, args)
    path = checkpoint_path(args)
    if not args.resume:
        require(not path.exists(), f"{path} exists: pass --resume to continue that run, or "
                                   "--run-name NEW for a new one")  # fmt: skip
        return args, None
    try:
        saved = load_checkpoint(path)
    except FileNotFoundError as err:
        raise UserError(str(err)) from None
    merged = merge_resumed_args(saved["args"], dataclasses.asdict(args), exp.resumable)
    require(merged["iterations"] >= saved["iteration"],
            f"--iterations {merged['iterations']} is below the {saved['iteration']} steps "
            f"{path} already holds; pass at least {saved['iteration']}")  # fmt: skip
    return exp.args_type(**merged), saved


def parse_args(exp: Experiment, argv: Sequence[str] | None = None) -> Any:
    """The command line as ``exp.args_type``; with ``--resume``, unspecified flags take the
    saved run's values (so ``--resume --run-name NAME`` alone continues that run as it was)."""
    description = exp.description.split("\n\n")[0]
    args = parse_dataclass(exp.args_type, argv, description=description, presets=exp.presets)
    if not args.resume:
        return args
    path = checkpoint_path(resolve_args(exp, args))
    if not path.is_file():  # start_from names it (or rank 0 holds it, under torchrun)
        return args
    saved = load_checkpoint(path)["args"]
    fields = {f.name for f in dataclasses.fields(exp.args_type)}
    base = exp.args_type(**{**{k: v for k, v in saved.items() if k in fields}, "resume": True})
    return parse_dataclass(exp.args_type, argv, description=description, base=base)


# --------------------------------------------------------------------------- the pieces


def make_optimizer(args: Any, learner: MetaLearner) -> torch.optim.Optimizer:
    """Adam on every learnable tensor (Reptile: plain SGD, its outer step epsilon)."""
    if args.algorithm == "reptile":
        return torch.optim.SGD(learner.parameters(), lr=args.outer_lr)
    return torch.optim.Adam(learner.parameters(), lr=args.outer_lr)


def _make_run(exp: Experiment, args: Any, state: RunState, learner: MetaLearner) -> Any:
    """The W&B run (None without tracking), continuing ``state.wandb_id`` on resume.

    A resumed run first re-logs the checkpoint's history (see `metalearn.runs.lifecycle`).
    """
    if not args.track or not distributed.is_main():
        return None
    dataset = exp.dataset(args)
    run = init_run(
        {**dataclasses.asdict(args), "learner": learner_config(dataclasses.asdict(args)),
         "dataset": dataset, "params": sum(p.numel() for p in learner.parameters()),
         "world_size": distributed.info().world_size},
        project=args.wandb_project, mode=args.wandb_mode, name=state.run_name,
        group=run_group(args.algorithm, args.ways, args.shots, args.wandb_group),
        tags=[args.algorithm, dataset, f"{args.ways}w{args.shots}s", *exp.tags(args)],
        dir=args.out_dir, run_id=state.wandb_id,
    )  # fmt: skip
    if run is not None:
        state.wandb_id = run.id
        for row in state.history:
            run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])
    return run


def _make_progress(args: Any, state: RunState, has_val: bool) -> tqdm:
    """One bar over every task left to run: training, validations and the test.

    Counting tasks (not steps) lets the ETA include validation and test; an evaluation
    task (more inner steps, no meta-gradient) costs roughly what a training task does.
    """
    steps = range(state.iteration + 1, args.iterations + 1)
    validations = sum(1 for s in steps if s % args.val_every == 0 or s == args.iterations)
    total = len(steps) * args.meta_batch + validations * args.val_tasks * has_val
    return tqdm(total=total + args.test_tasks, initial=0, desc="train", unit="task",
                dynamic_ncols=True, disable=not distributed.is_main())  # fmt: skip


# --------------------------------------------------------------------------- train, evaluate


def train(
    args: Any,
    learner: MetaLearner,
    samplers: dict,
    state: RunState,
    run: Any,
    bar: tqdm,
    saved: dict | None,
    backward: MetaGradient | None = None,
) -> dict:
    """Meta-train from ``state`` (fresh or resumed); returns the last checkpoint written.

    ``backward`` computes each step's meta-gradient (default ``learner.backward``).
    """
    opt = make_optimizer(args, learner)
    gen = torch.Generator().manual_seed(args.seed)
    if saved is not None:
        opt.load_state_dict(saved["optimizer"])
        gen.set_state(saved["generator"])
    path = checkpoint_path(args)
    snapshot = _snapshot(args, learner, opt, gen, state)
    probe = _curvature_probe(args, samplers["train"])
    try:
        for it in range(state.iteration, args.iterations):
            bar.set_description("train")
            row = meta_step(args, learner, opt, samplers["train"], gen, backward)
            bar.update(args.meta_batch)
            if probe is not None and (it + 1) % args.curvature_every == 0:
                bar.set_description("curvature")
                row.update(measure_curvature(learner, probe))
            if (it + 1) % args.val_every == 0 or it + 1 == args.iterations:
                row.update(validate(args, learner, samplers, state, it + 1, bar))
            state.iteration = it + 1
            state.history.append({"step": state.iteration, **row})
            # Everything a resumed run needs, taken only at step boundaries, so an interrupt
            # anywhere inside a step resumes from the last *completed* one.
            snapshot = _snapshot(args, learner, opt, gen, state)
            if run is not None:
                run.log(row, step=state.iteration)
            bar.set_postfix(_postfix(row, state), refresh=False)
            if state.iteration % args.checkpoint_every == 0:
                distributed.check_same(learner.parameters())  # a diverged rank fails loudly
                if distributed.is_main():
                    save_checkpoint(path, snapshot)
    finally:
        # Ctrl-C / SIGTERM / an error: keep the last completed step, so --resume continues.
        # No collective here: the other ranks may be gone.
        if distributed.is_main():
            with signals_held():
                save_checkpoint(path, snapshot)
    return snapshot


def meta_step(
    args: Any, learner: MetaLearner, opt, sampler, gen, backward: MetaGradient | None = None
) -> dict[str, float]:
    """One meta-step on this rank's share of a meta-batch; returns its logged metrics.

    ``backward`` fills ``.grad`` with the meta-gradient of the tasks (default
    ``learner.backward``; `meta_gradient` gives the run's).
    """
    start = time.perf_counter()
    tasks = _my_tasks(sampler, args.meta_batch, gen)
    opt.zero_grad(set_to_none=True)
    metrics = (learner.backward if backward is None else backward)(tasks)
    metrics = distributed.average_meta_step(learner, metrics, len(tasks))
    opt.step()
    seconds = time.perf_counter() - start
    return {
        "train/loss": metrics.loss, "train/acc": metrics.accuracy, "perf/step_s": seconds,
        "perf/tasks_per_s": args.meta_batch / seconds,
        "perf/vectorized_tasks": metrics.vectorized, "train/skipped": metrics.skipped,
    }  # fmt: skip


def meta_gradient(args: Any, learner: MetaLearner) -> MetaGradient:
    """What fills ``.grad`` in a training step: ``learner.backward``, compiled with
    ``--compile`` (`metalearn.algorithms.compiled.CompiledMetaGradient`).

    Raises:
        UserError: ``--compile`` for a learner whose meta-step cannot be compiled.
    """
    if not args.compile:
        return learner.backward
    try:
        return CompiledMetaGradient(learner)
    except ValueError as err:
        raise UserError(f"--compile with --algorithm {args.algorithm}: {err}") from None


def _curvature_probe(args: Any, sampler: EpisodicSampler) -> list | None:
    """The fixed probe tasks curvature is measured on (rank 0 only), or None when off.

    Drawn from the training split with their own generator (`PROBE_SEED`), so they are the
    same in every run and across a resume, and the training tasks are drawn as without them.
    """
    if args.curvature_every == 0 or not distributed.is_main():
        return None
    return sampler.batch(args.curvature_tasks, torch.Generator().manual_seed(PROBE_SEED))


def measure_curvature(learner: MetaLearner, probe: Sequence) -> dict[str, float]:
    """The ``curv/`` metrics of the learner's current theta on the probe tasks.

    ``curv/support_top_eig`` (mean over the probe tasks) and ``curv/support_top_eig_max``:
    the top eigenvalue of each task's support-loss Hessian at theta, beside
    ``curv/two_over_inner_lr``, the eigenvalue above which the inner step of rate
    ``inner_lr`` (the configured one; learned rates differ) diverges on a quadratic
    (`metalearn.algorithms.curvature.support_curvature`). ``curv/meta_top_eig``,
    ``curv/meta_trace`` and its ``curv/meta_trace_std_error``: the second-order meta-loss
    Hessian w.r.t. theta (`metalearn.algorithms.curvature.meta_curvature`). ``perf/curvature_s``:
    the seconds it all took. Each measurement seeds its own generator from `PROBE_SEED`,
    so it depends on theta alone.
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


def _snapshot(args: Any, learner: MetaLearner, opt, gen: torch.Generator, state: RunState) -> dict:
    """The checkpoint of the run at a step boundary (CPU tensors; cheap next to a step).

    The history is copied as a list of the same rows (rows are never changed once logged),
    so a snapshot costs O(steps) pointers, not a deep copy of every metric.
    """
    fields = {**state.to_dict(), "history": list(state.history)}
    return {
        "args": dataclasses.asdict(args), **fields, "learner": _cpu_state(learner),
        "optimizer": copy.deepcopy(opt.state_dict()), "generator": gen.get_state(),
        "torch_rng": torch.get_rng_state(),
    }  # fmt: skip


def validate(
    args: Any, learner: MetaLearner, samplers: dict, state: RunState, iteration: int, bar: tqdm
) -> dict[str, float]:
    """Validation accuracy; remembers the best weights (or the latest, with no val split)."""
    sampler = samplers.get("val")
    if sampler is None:  # a split with no validation classes: keep the latest
        state.best_learner, state.best_iteration = _cpu_state(learner), iteration
        return {}
    bar.set_description("validate")
    gen = torch.Generator().manual_seed(VAL_SEED)
    acc, half = evaluate_tasks(learner, sampler, args.val_tasks, args.eval_inner_steps, gen,
                               progress=bar.update)  # fmt: skip
    if state.best_val is None or acc > state.best_val:
        state.best_val, state.best_iteration = acc, iteration
        state.best_learner = _cpu_state(learner)
    return {"val/acc": acc, "val/acc_ci95": half, "val/best_acc": state.best_val}


def _cpu_state(learner: MetaLearner) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in learner.state_dict().items()}


def test(
    args: Any, learner: MetaLearner, samplers: dict, state: RunState, bar: tqdm
) -> dict[str, float]:
    """Accuracy of the best-validation weights on ``args.test_tasks`` test tasks."""
    if state.best_learner is not None:
        learner.load_state_dict(state.best_learner)
    bar.set_description("test")
    gen = torch.Generator().manual_seed(TEST_SEED)
    acc, half = evaluate_tasks(learner, samplers["test"], args.test_tasks, args.eval_inner_steps,
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
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.tune_malloc:
        tune_malloc()
    dist = distributed.init_from_env(device=args.device, timeout_s=args.dist_timeout)
    try:
        return _main(exp, dataclasses.replace(args, device=str(dist.device))
                     if dist.distributed else args, dist)  # fmt: skip
    finally:
        distributed.cleanup()


def _main(exp: Experiment, args: Any, dist: distributed.DistInfo) -> dict[str, float]:
    require(args.meta_batch >= dist.world_size,
            f"--meta-batch {args.meta_batch} is below the {dist.world_size} processes: every "
            "rank needs a task; raise --meta-batch or launch fewer processes")  # fmt: skip
    # Rank 0 reads (only its machine need hold the checkpoint) and every rank gets its answer.
    args, saved = distributed.from_main(start_from, exp, args)
    if dist.is_main:
        print(f"checkpoint: {checkpoint_path(args)}", flush=True)
    samplers = exp.make_samplers(args)
    learner = exp.make_learner(args)
    require(args.curvature_every == 0 or isinstance(learner, MetaLossLearner),
            f"--curvature-every {args.curvature_every} with --algorithm {args.algorithm}: "
            f"{type(learner).__name__} has no meta-loss to measure; use maml, fomaml, anil, "
            "metasgd, mamlpp, protomaml or lora, or drop --curvature-every")  # fmt: skip
    backward = meta_gradient(args, learner)
    state = RunState(run_name=str(args.run_name))
    if saved is not None:
        learner.load_state_dict(saved["learner"])
        torch.set_rng_state(saved["torch_rng"])
        state = RunState.from_dict(saved)
    distributed.broadcast_params(learner)  # every rank starts from rank 0's weights
    run = _make_run(exp, args, state, learner)
    if dist.is_main:
        print(f"W&B run: {Path(run.dir).parent if run is not None else 'not tracked'}", flush=True)
    return _train_and_test(args, learner, samplers, state, run, saved, dist, backward)


def _train_and_test(args, learner, samplers, state, run, saved, dist, backward) -> dict[str, float]:
    """Train, test, record; the W&B run ends failed (exit code != 0) unless all of it ran."""
    started, exit_code = time.perf_counter(), 1
    try:
        with graceful_shutdown(), _make_progress(args, state, "val" in samplers) as bar:
            final = train(args, learner, samplers, state, run, bar, saved, backward)
            results = test(args, learner, samplers, state, bar)
        results["perf/total_minutes"] = (time.perf_counter() - started) / 60
        state.results = final["results"] = results
        if dist.is_main:
            save_checkpoint(checkpoint_path(args), final)  # a finished run (the grid skips it)
        if run is not None:
            run.summary.update(results)
            if args.log_model:
                log_model(run, checkpoint_path(args), name=f"{state.run_name}-model")
        exit_code = 0
    except (KeyboardInterrupt, distributed.PeerError) as stop:
        exit_code = stop.exit_code if isinstance(stop, Stopped) else 1
        if run is not None and isinstance(stop, Stopped):
            run.mark_preempting()  # online: shown as preempted, resumable
        where = f"rank {dist.rank}: " if dist.distributed else ""
        print(f"\n{where}stopped at step {state.iteration}; continue with --resume "
              f"--run-name {state.run_name}")  # fmt: skip
        raise
    finally:
        if run is not None:
            run.finish(exit_code=exit_code)
    if dist.is_main:
        others = {k: v for k, v in results.items() if k not in ("test/acc", "test/acc_ci95")}
        print("  ".join(f"{k}: {v:.4g}" for k, v in others.items()))
        print(f"test/acc: {results['test/acc']:.4f} ± {results['test/acc_ci95']:.4f}")
    return results
