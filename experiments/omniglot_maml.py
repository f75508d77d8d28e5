"""MAML (and family) on Omniglot, N-way K-shot, tracked in Weights & Biases.

What: meta-trains the conv4 network of Finn et al. (2017) on Omniglot with the chosen
algorithm, validates during training and keeps the best-validation weights, then reports
the test accuracy over 600 test tasks with a 95% confidence interval.

Command:
    python experiments/omniglot_maml.py                         # CPU-sized default run
    python experiments/omniglot_maml.py --preset paper-5w1s     # the paper's setting (GPU)
    python experiments/omniglot_maml.py --algorithm anil --ways 20 --shots 1
    python experiments/omniglot_maml.py --resume --run-name NAME  # continue a stopped run
    python experiments/omniglot_maml.py --preset paper-20w1s --help  # options, preset values
    wandb sweep experiments/sweeps/omniglot_maml.yaml           # a W&B sweep (then wandb agent)
    python scripts/grid.py --seeds 0 1 2 --set inner_lr=0.1,0.4  # a grid without a W&B server
    torchrun --nproc_per_node=2 experiments/omniglot_maml.py    # 2 processes (docs/distributed.md)

Data: ``--data-root`` or ``$METALEARN_DATA`` pointing at the extracted Omniglot folder
(``images_background/``, ``images_evaluation/``); without either, the cache folder is used
and filled by a download when the network allows. Expected result of the default run
(5-way 1-shot, 2 CPU cores, see README.md): about 15 minutes, test accuracy printed as
``test/acc: 0.9xx ± 0.00x``.

A run is its arguments: they are checked before any data loads, the learner's open ones
(``--inner-lr``, ``--inner-steps``, ``--cg-damping``) are filled from the per-algorithm table
in `metalearn.algorithms.build`, and the result is what W&B and the checkpoint record.
``--resume`` continues the saved run with the saved arguments; only the RESUMABLE ones may
be changed (see `metalearn.runs` for how no logged metric is lost across a kill and resume).

Under ``torchrun`` each rank computes the meta-gradient of its share of every meta-batch
and the shares are averaged (`metalearn.distributed`); every rank draws the same global
meta-batch, so N processes train on exactly the tasks one process sees. Rank 0 alone logs,
writes checkpoints and shows progress; evaluation tasks are split across ranks.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm

from metalearn import distributed, tune_malloc
from metalearn.algorithms import MetaLearner
from metalearn.algorithms.build import build_learner, learner_config, resolve_learner_args
from metalearn.checkpoint import load_checkpoint, save_checkpoint
from metalearn.cli import parse_dataclass
from metalearn.data import EpisodicSampler, load_omniglot, omniglot_samplers
from metalearn.data.omniglot import root_is_default
from metalearn.evaluation import TEST_SEED, VAL_SEED, evaluate_tasks
from metalearn.runs import (
    RunState,
    Stopped,
    UserError,
    merge_resumed_args,
    require,
    run_cli,
    signals_held,
)
from metalearn.seeding import seed_everything
from metalearn.tracking import graceful_shutdown, init_run, log_model, run_group


@dataclass
class Args:
    """Arguments of the Omniglot experiment (each is a --flag, also as --flag_name=VALUE)."""

    preset: Literal["cpu", "paper-5w1s", "paper-5w5s", "paper-20w1s", "paper-20w5s"] = "cpu"
    """Named configuration: cpu (about 15 min on 2 cores) or the MAML paper's settings."""
    algorithm: Literal["maml", "fomaml", "anil", "metasgd", "mamlpp", "imaml", "reptile"] = "maml"
    """Meta-learning algorithm."""
    ways: int = 5
    """N: classes per task."""
    shots: int = 1
    """K: support examples per class."""
    query: int = 5
    """Query examples per class during meta-training."""
    eval_query: int = 15
    """Query examples per class for validation and test tasks."""
    meta_batch: int = 16
    """Tasks per meta-step."""
    iterations: int = 2500
    """Meta-steps (may be raised on --resume to extend a run)."""
    inner_lr: float | None = None
    """Inner-loop learning rate (MAML's alpha); none: the algorithm's (0.4; iMAML 0.1)."""
    inner_steps: int | None = None
    """Inner steps during meta-training; none: the algorithm's (1; iMAML and Reptile 5)."""
    cg_damping: float | None = None
    """iMAML only: damping added to the conjugate-gradient system; none: 10 (conv4's
    adapted support Hessian has eigenvalues below -lambda)."""
    eval_inner_steps: int = 10
    """Inner steps at validation and test time."""
    outer_lr: float = 1e-3
    """Adam learning rate of the meta-update (Reptile: its epsilon, with SGD)."""
    hidden: int = 64
    """Filters per conv layer."""
    vectorize: Literal["auto", "vmap", "loop"] = "auto"
    """How a meta-batch runs: vmap, a Python loop, or auto (by workload)."""
    split: Literal["maml", "alphabet"] = "maml"
    """maml: 1100/100/423 characters with rotations; alphabet: background vs evaluation."""
    val_every: int = 250
    """Meta-steps between validations (the best-validation weights are tested)."""
    val_tasks: int = 200
    """Validation tasks per validation."""
    test_tasks: int = 600
    """Test tasks for the final accuracy and its 95% confidence interval."""
    checkpoint_every: int = 250
    """Meta-steps between checkpoints (also written on Ctrl-C / SIGTERM)."""
    seed: int = 0
    """Seeds the initial weights and the task sampling."""
    data_root: str | None = None
    """Omniglot folder (must exist); default $METALEARN_DATA, else the cache dir (downloaded)."""
    out_dir: str = "runs"
    """Where checkpoints and the W&B folder go."""
    run_name: str | None = None
    """Run name (default: algorithm-NwKs-lrLR-stepsS-seedS); --resume looks for it in out_dir."""
    resume: bool = False
    """Continue the run named run_name from its last checkpoint, with its saved arguments;
    only --iterations (to extend), --checkpoint-every, --device, --threads, --tune-malloc,
    --track, --wandb-mode, --wandb-group, --log-model, --dist-timeout, --data-root, --out-dir
    may change."""
    track: bool = True
    """Log to Weights & Biases (--no-track to skip)."""
    log_model: bool = False
    """Log the final checkpoint as a W&B artifact (type model, aliases best and latest)."""
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """auto: online when logged in and reachable, else offline."""
    wandb_project: str = "metalearn-omniglot"
    """W&B project."""
    wandb_group: str | None = None
    """W&B group (default: algorithm-NwKs); scripts/grid.py puts a whole grid in one."""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """Torch device."""
    threads: int = 1
    """Torch CPU threads (0: torch's default). 1 is robust on small shared machines: with
    other load, 2 threads made tiny per-task ops up to 7x slower here."""
    tune_malloc: bool = True
    """Keep freed memory for reuse (`metalearn.tune_malloc`, glibc only): a meta-step's
    large activations stop costing page faults; resident memory stays near its peak.
    --no-tune-malloc keeps malloc's defaults."""
    dist_timeout: float = 600.0
    """Under torchrun: seconds a rank waits for the others in a collective before the job
    fails, so a stalled rank ends the job (then --resume) instead of hanging it."""


# The MAML paper's Omniglot settings (Finn et al., 2017, Sec. 5.2 and appendix A.1).
PAPER = dict(iterations=60_000, query=1, eval_query=1, inner_steps=1, eval_inner_steps=10,
             outer_lr=1e-3, val_every=1000, checkpoint_every=1000, val_tasks=600)  # fmt: skip
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {},
    "paper-5w1s": {**PAPER, "ways": 5, "shots": 1, "meta_batch": 32, "inner_lr": 0.4},
    "paper-5w5s": {**PAPER, "ways": 5, "shots": 5, "meta_batch": 32, "inner_lr": 0.4},
    "paper-20w1s": {**PAPER, "ways": 20, "shots": 1, "meta_batch": 16, "inner_lr": 0.1,
                    "inner_steps": 5},
    "paper-20w5s": {**PAPER, "ways": 20, "shots": 5, "meta_batch": 16, "inner_lr": 0.1,
                    "inner_steps": 5},
}  # fmt: skip
# What --resume may change: how long and where the run goes on, not what it computes.
RESUMABLE = (
    "iterations", "checkpoint_every", "device", "threads", "tune_malloc", "track",
    "wandb_mode", "wandb_group", "log_model", "dist_timeout", "data_root", "out_dir", "resume",
)  # fmt: skip
_AT_LEAST_ONE = (
    "ways", "shots", "query", "eval_query", "meta_batch", "iterations", "hidden",
    "val_every", "val_tasks", "test_tasks", "checkpoint_every", "inner_steps",
)  # fmt: skip


# --------------------------------------------------------------------------- arguments


def check_args(args: Args) -> None:
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
    require(
        args.threads >= 0, f"--threads {args.threads}: must be at least 1, or 0 for torch's default"
    )
    require(0 <= args.seed < 2**32, f"--seed {args.seed}: must be in [0, 2**32)")
    if args.data_root is not None:
        require(Path(args.data_root).expanduser().is_dir(),
                f"--data-root {args.data_root} does not exist; give the folder holding "
                "images_background/ and images_evaluation/, or drop --data-root")  # fmt: skip


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def resolve_args(args: Args) -> Args:
    """Checked ``args`` with the learner's open values and the run name filled in."""
    check_args(args)
    try:
        resolved = Args(**resolve_learner_args(dataclasses.asdict(args)))
    except ValueError as err:
        raise UserError(str(err)) from None
    if resolved.run_name is None:
        resolved.run_name = (f"{resolved.algorithm}-{resolved.ways}w{resolved.shots}s-"
                             f"lr{resolved.inner_lr:g}-steps{resolved.inner_steps}-"
                             f"seed{resolved.seed}")  # fmt: skip
    return resolved


def checkpoint_path(args: Args) -> Path:
    return Path(args.out_dir) / str(args.run_name) / "checkpoint.pt"


def start_from(args: Args) -> tuple[Args, dict | None]:
    """The run's arguments and its checkpoint (None for a fresh run). Writes nothing.

    Raises:
        UserError: resuming a run that does not exist, a resume that changes a fixed
            argument, or a fresh run whose name is taken.
    """
    args = resolve_args(args)
    path = checkpoint_path(args)
    if not args.resume:
        require(not path.exists(), f"{path} exists: pass --resume to continue that run, or "
                                   "--run-name NEW for a new one")  # fmt: skip
        return args, None
    try:
        saved = load_checkpoint(path)
    except FileNotFoundError as err:
        raise UserError(str(err)) from None
    merged = merge_resumed_args(saved["args"], dataclasses.asdict(args), RESUMABLE)
    require(merged["iterations"] >= saved["iteration"],
            f"--iterations {merged['iterations']} is below the {saved['iteration']} steps "
            f"{path} already holds; pass at least {saved['iteration']}")  # fmt: skip
    return Args(**merged), saved


def parse_args(argv: Sequence[str] | None = None) -> Args:
    """The command line as `Args`; with ``--resume``, unspecified flags take the saved run's
    values (so ``--resume --run-name NAME`` alone continues that run as it was)."""
    description = __doc__.split("\n\n")[0]
    args = parse_dataclass(Args, argv, description=description, presets=PRESETS)
    if not args.resume:
        return args
    path = checkpoint_path(resolve_args(args))
    if not path.is_file():  # start_from names it (or rank 0 holds it, under torchrun)
        return args
    saved = load_checkpoint(path)["args"]
    base = Args(**{**{k: v for k, v in saved.items() if k in _fields()}, "resume": True})
    return parse_dataclass(Args, argv, description=description, base=base)


def _fields() -> set[str]:
    return {f.name for f in dataclasses.fields(Args)}


# --------------------------------------------------------------------------- the pieces


def make_samplers(args: Args) -> dict[str, EpisodicSampler]:
    """Train, validation and test task samplers (validation and test with eval_query)."""
    try:
        with distributed.main_first():  # one process per machine fills the cache (or downloads)
            data = load_omniglot(args.data_root, download=root_is_default(args.data_root))
    except FileNotFoundError as err:
        raise UserError(" ".join(str(err).split())) from None
    common = dict(ways=args.ways, shots=args.shots, device=args.device)
    samplers = omniglot_samplers(data, args.split, queries=args.query, **common)
    evaluation = omniglot_samplers(data, args.split, queries=args.eval_query, **common)
    samplers.update({k: v for k, v in evaluation.items() if k != "train"})
    return samplers


def make_learner(args: Args) -> MetaLearner:
    """The algorithm around a fresh conv4 (seeded by args.seed), built exactly as recorded.

    `metalearn.algorithms.build.build_learner` holds the construction, so a deployed
    checkpoint is rebuilt exactly as it was trained. ``args`` are resolved already in a run
    (`resolve_args`); resolving again changes nothing and lets callers pass open ones.
    """
    seed_everything(args.seed)
    return build_learner(resolve_learner_args(dataclasses.asdict(args))).to(args.device)


def make_optimizer(args: Args, learner: MetaLearner) -> torch.optim.Optimizer:
    """Adam on every learnable tensor (Reptile: plain SGD, its outer step epsilon)."""
    if args.algorithm == "reptile":
        return torch.optim.SGD(learner.parameters(), lr=args.outer_lr)
    return torch.optim.Adam(learner.parameters(), lr=args.outer_lr)


def make_run(args: Args, state: RunState, learner: MetaLearner) -> Any:
    """The W&B run (None without tracking), continuing ``state.wandb_id`` on resume.

    A resumed run first re-logs the checkpoint's history (see `metalearn.runs`).
    """
    if not args.track or not distributed.is_main():
        return None
    run = init_run(
        {**dataclasses.asdict(args), "learner": learner_config(dataclasses.asdict(args)),
         "dataset": "omniglot", "params": sum(p.numel() for p in learner.parameters()),
         "world_size": distributed.info().world_size},
        project=args.wandb_project, mode=args.wandb_mode, name=state.run_name,
        group=run_group(args.algorithm, args.ways, args.shots, args.wandb_group),
        tags=[args.algorithm, "omniglot", f"{args.ways}w{args.shots}s", args.split],
        dir=args.out_dir, run_id=state.wandb_id,
    )  # fmt: skip
    if run is not None:
        state.wandb_id = run.id
        for row in state.history:
            run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])
    return run


def make_progress(args: Args, state: RunState, has_val: bool) -> tqdm:
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
    args: Args,
    learner: MetaLearner,
    samplers: dict,
    state: RunState,
    run: Any,
    bar: tqdm,
    saved: dict | None,
) -> dict:
    """Meta-train from ``state`` (fresh or resumed); returns the last checkpoint written."""
    opt = make_optimizer(args, learner)
    gen = torch.Generator().manual_seed(args.seed)
    if saved is not None:
        opt.load_state_dict(saved["optimizer"])
        gen.set_state(saved["generator"])
    path = checkpoint_path(args)
    snapshot = _snapshot(args, learner, opt, gen, state)
    try:
        for it in range(state.iteration, args.iterations):
            bar.set_description("train")
            row = _meta_step(args, learner, opt, samplers["train"], gen)
            bar.update(args.meta_batch)
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


def _meta_step(args: Args, learner: MetaLearner, opt, sampler, gen) -> dict[str, float]:
    """One meta-step on this rank's share of a meta-batch; returns its logged metrics."""
    start = time.perf_counter()
    tasks = _my_tasks(sampler, args.meta_batch, gen)
    opt.zero_grad(set_to_none=True)
    metrics = learner.backward(tasks)
    metrics = distributed.average_meta_step(learner, metrics, len(tasks))
    opt.step()
    seconds = time.perf_counter() - start
    return {
        "train/loss": metrics.loss, "train/acc": metrics.accuracy, "perf/step_s": seconds,
        "perf/tasks_per_s": args.meta_batch / seconds,
        "perf/vectorized_tasks": metrics.vectorized, "train/skipped": metrics.skipped,
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
    """
    classes, examples = sampler.sample_indices(gen, meta_batch)
    part = distributed.shard_slice(meta_batch)
    return sampler.tasks_from_indices(classes[part], examples[part])


def _snapshot(args: Args, learner: MetaLearner, opt, gen: torch.Generator, state: RunState) -> dict:
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
    args: Args, learner: MetaLearner, samplers: dict, state: RunState, iteration: int, bar: tqdm
) -> dict[str, float]:
    """Validation accuracy; remembers the best weights (or the latest, with no val split)."""
    sampler = samplers.get("val")
    if sampler is None:  # the alphabet split with no held-out alphabets: keep the latest
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
    args: Args, learner: MetaLearner, samplers: dict, state: RunState, bar: tqdm
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


def main(args: Args) -> dict[str, float]:
    """Meta-train, test the best-validation weights, log everything; returns the results.

    Raises:
        UserError: a bad argument, a resume that changes the run, missing data (nothing
            has been written then).
        Stopped: SIGINT/SIGTERM; the run was checkpointed and marked failed in W&B.
    """
    check_args(args)  # before anything else touches the machine
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.tune_malloc:
        tune_malloc()
    dist = distributed.init_from_env(device=args.device, timeout_s=args.dist_timeout)
    try:
        return _main(dataclasses.replace(args, device=str(dist.device)) if dist.distributed
                     else args, dist)  # fmt: skip
    finally:
        distributed.cleanup()


def _main(args: Args, dist: distributed.DistInfo) -> dict[str, float]:
    require(args.meta_batch >= dist.world_size,
            f"--meta-batch {args.meta_batch} is below the {dist.world_size} processes: every "
            "rank needs a task; raise --meta-batch or launch fewer processes")  # fmt: skip
    # Rank 0 reads (only its machine need hold the checkpoint) and every rank gets its answer.
    args, saved = distributed.from_main(start_from, args)
    if dist.is_main:
        print(f"checkpoint: {checkpoint_path(args)}", flush=True)
    samplers = make_samplers(args)
    learner = make_learner(args)
    state = RunState(run_name=str(args.run_name))
    if saved is not None:
        learner.load_state_dict(saved["learner"])
        torch.set_rng_state(saved["torch_rng"])
        state = RunState.from_dict(saved)
    distributed.broadcast_params(learner)  # every rank starts from rank 0's weights
    run = make_run(args, state, learner)
    if dist.is_main:
        print(f"W&B run: {Path(run.dir).parent if run is not None else 'not tracked'}", flush=True)
    return _train_and_test(args, learner, samplers, state, run, saved, dist)


def _train_and_test(args, learner, samplers, state, run, saved, dist) -> dict[str, float]:
    """Train, test, record; the W&B run ends failed (exit code != 0) unless all of it ran."""
    started, exit_code = time.perf_counter(), 1
    try:
        with graceful_shutdown(), make_progress(args, state, "val" in samplers) as bar:
            final = train(args, learner, samplers, state, run, bar, saved)
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
        print(" ".join(f"{k}: {v:.4f}" for k, v in results.items() if k != "test/acc_ci95"))
        print(f"test/acc: {results['test/acc']:.4f} ± {results['test/acc_ci95']:.4f}")
    return results


if __name__ == "__main__":
    run_cli(main, parse_args)
