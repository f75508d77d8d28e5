"""A run's lifecycle behind one small object, which an experiment's own loop uses.

The experiment writes its loop (draw a meta-batch, ``learner.backward``, the optimizer and
schedule step, validation, the test); `Run` holds what no experiment should rewrite::

    with Run(EXPERIMENT, args) as run:      # checked, resolved, locked, resumed
        recipe = run.recipe                 # the resolved arguments as a Recipe
        ...                                 # data, model, learner, optimizer, generator
        run.start(learner, opt, gen)        # a resumed run's weights and generators; W&B
        for step in run.steps():            # 0-based, from where the run stands
            row = ...                       # one meta-step's metrics
            run.log(row)                    # history, W&B, progress, checkpoint
        run.finish(results)                 # the final record; W&B summary

What it holds: the argument checks and their resolution (`metalearn.runs.experiment`),
``torchrun``'s process group, the run folder's lock (`metalearn.runs.lock`), resuming at
the saved step with the saved generators, SIGTERM and Ctrl-C (the last completed step is
checkpointed and the run ends with ``--resume`` named), W&B (its config, the re-logged
history of a resumed run, a failed run marked failed), one progress bar over every task
left, atomic checkpoints (`metalearn.checkpoint`) holding the history, and a non-finite
loss or gradient turned into one line naming the meta-step and the fix
(`metalearn.runs.lifecycle.diverged`). `metalearn.runs.lifecycle` says how no logged
metric is lost across a kill and resume.

Under ``torchrun`` each rank computes the meta-gradient of its share of every meta-batch
(`metalearn.runs.outer_loop.my_tasks`, `metalearn.distributed`); every rank draws the same
global meta-batch, so N processes train on exactly the tasks one process sees. Rank 0 alone
logs, checkpoints and shows progress. The parts of a meta-step around ``learner.backward``
(this rank's tasks, the checked gradient, the outer step size) are
`metalearn.runs.outer_loop`'s: `Run` is the lifecycle around the loop, not on its path.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from metalearn import distributed, tune_malloc
from metalearn.algorithms import MetaLearner
from metalearn.algorithms.compiled import CompiledMetaGradient
from metalearn.checkpoint import save_checkpoint
from metalearn.data import EpisodicSampler
from metalearn.data.omniglot import resolve_data_root
from metalearn.engine import AllTasksSkippedError, NonFiniteLossError
from metalearn.files import FileError
from metalearn.runs import lock
from metalearn.runs.cli import flatten
from metalearn.runs.experiment import (
    Experiment,
    check_args,
    checkpoint_path,
    resolve_args,
    start_from,
)
from metalearn.runs.lifecycle import (
    NonFiniteGradientError,
    RunState,
    Stopped,
    UserError,
    diverged,
    require,
    signals_held,
    unsaved_error,
)
from metalearn.runs.metrics import (
    PERF_TOTAL_MINUTES,
    TEST_ACC,
    TEST_ACC_CI95,
    TRAIN_ACC,
    TRAIN_LOSS,
    VAL_ACC,
)
from metalearn.runs.recipe import Recipe, build_samplers, flag_arguments
from metalearn.runs.tracking import (
    define_summaries,
    finish_run,
    graceful_shutdown,
    init_run,
    log_model,
    run_group,
)

__all__ = ["Run", "load_samplers", "meta_gradient", "run_lock", "top_k"]

_DIVERGED = (NonFiniteLossError, AllTasksSkippedError, NonFiniteGradientError)


class Run:
    """One training run's lifecycle (see the module docstring); a context manager.

    Attributes:
        args: the resolved arguments (a resumed run's saved ones, with what may change).
        recipe: the run's `Recipe`, from which its data, model and learner are built.
        state: what the run carries between steps (`RunState`: the step, the best
            validation, the history).
        path: the run's checkpoint file.
        bar: the progress bar (after `start`), for an evaluation's ``progress=``.
    """

    def __init__(self, experiment: Experiment, args: Any) -> None:
        self.experiment, self.args = experiment, args
        self.recipe: Recipe
        self.state: RunState
        self.path: Path
        self.saved: dict | None = None
        self.bar: Any = None
        self._stack = contextlib.ExitStack()  # the process group and the lock
        self._during = contextlib.ExitStack()  # SIGTERM handling and the bar
        self._wandb: Any = None
        self._snapshot: dict | None = None
        self._results: dict[str, float] | None = None
        self._kept: int | None = None  # the step of the checkpoint on disk (None: none)
        self._started = time.perf_counter()

    # ----------------------------------------------------------------------- start

    def __enter__(self) -> Run:
        """Check and resolve the arguments, take the run folder's lock, read a resumed run's
        checkpoint. Writes nothing but the lock.

        Raises:
            UserError: a bad argument, a resume that changes the run, a run that exists.
        """
        exp, args = self.experiment, self.args
        check_args(exp, args)  # before anything else touches the machine
        system = args.system
        if system.threads > 0:
            torch.set_num_threads(system.threads)
        if system.tune_malloc:
            tune_malloc()
        with contextlib.ExitStack() as stack:
            dist = distributed.init_from_env(device=system.device, timeout_s=system.dist_timeout)
            stack.callback(distributed.cleanup)
            if dist.distributed:
                device = dataclasses.replace(system, device=str(dist.device))
                args = dataclasses.replace(args, system=device)
            meta_batch = args.training.meta_batch
            require(meta_batch >= dist.world_size,
                    f"--meta-batch {meta_batch} is below the {dist.world_size} processes: every "
                    "rank needs a task; raise --meta-batch or launch fewer processes")  # fmt: skip
            # Rank 0 names the run (a new name is random) and every rank takes that name;
            # rank 0 holds the run folder's lock while it trains (one writer per run), reads
            # the checkpoint (only its machine need hold it) and every rank gets its answer.
            args = distributed.from_main(resolve_args, exp, args)
            stack.enter_context(run_lock(checkpoint_path(args).parent, dist.is_main))
            self.args, self.recipe, self.saved = distributed.from_main(start_from, exp, args)
            self._stack = stack.pop_all()
        self.dist, self.path = dist, checkpoint_path(self.args)
        tracking = self.args.tracking
        self.state = RunState(run_name=str(tracking.run_name), wandb_id=tracking.wandb_id)
        if self.saved is not None:
            self.state = RunState.from_dict(self.saved)
            self._kept = self.state.iteration
        try:  # a closed stdout (| head -1) raises here: the lock is released, not left
            if dist.is_main:
                print(f"checkpoint: {self.path}", flush=True)
                if self.saved is not None:
                    print(f"resuming {self.state.run_name} at meta-step {self.state.iteration} "
                          f"of {self.recipe.training.iterations}", flush=True)  # fmt: skip
        except BaseException:
            self._stack.close()
            raise
        return self

    def start(
        self,
        learner: MetaLearner,
        opt: torch.optim.Optimizer,
        gen: torch.Generator,
        validates: bool = True,
    ) -> None:
        """Begin training: a resumed run's weights, optimizer, task generator and torch's
        generator restored; every rank given rank 0's weights; the W&B run started (a resumed
        one re-logs its history); SIGTERM turned into `Stopped`; the progress bar shown.

        Args:
            learner, opt, gen: what the loop trains with and draws tasks from; every
                checkpoint holds their state.
            validates: whether the run has a validation split (for the bar's total).
        """
        k = self.recipe.training.ensemble_top_k
        require(validates or k == 1,
                f"--ensemble-top-k {k} ranks the run's validations, and this split has no "
                "validation classes; drop --ensemble-top-k")  # fmt: skip
        saved = self.saved
        if saved is not None:
            learner.load_state_dict(saved["learner"])
            torch.set_rng_state(saved["torch_rng"])
            opt.load_state_dict(saved["optimizer"])
            gen.set_state(saved["generator"])
        distributed.broadcast_params(learner)  # every rank starts from rank 0's weights
        self._learner, self._opt, self._gen = learner, opt, gen
        self._wandb = self._init_wandb(learner)
        if self.dist.is_main:
            where = Path(self._wandb.dir).parent if self._wandb is not None else "not tracked"
            print(f"W&B run: {where}", flush=True)
        self._record = {"args": flatten(self.args), "recipe": self.recipe.to_dict()}
        self._snapshot = self._take_snapshot()
        self._during.enter_context(graceful_shutdown())
        self.bar = self._during.enter_context(self._progress(validates))

    # ----------------------------------------------------------------------- steps

    def steps(self) -> Iterator[int]:
        """The meta-steps left to run, 0-based; each ends with `log`."""
        for step in range(self.state.iteration, self.recipe.training.iterations):
            self.bar.set_description("train")
            yield step

    def phase(self, what: str) -> None:
        """Name what the run does now on its progress bar (``"validate"``, ``"test"``)."""
        self.bar.set_description(what)

    def log(self, row: dict[str, float]) -> None:
        """End the current meta-step with its metrics: kept in the history, logged to W&B,
        shown, and checkpointed every ``checkpoint_every`` steps.

        Everything a resumed run needs is taken here, at step boundaries only, so an
        interrupt anywhere inside a step resumes from the last *completed* one.
        """
        t, state = self.recipe.training, self.state
        state.iteration += 1
        state.history.append({"step": state.iteration, **row})
        self._snapshot = self._take_snapshot()
        if self._wandb is not None:
            self._wandb.log(row, step=state.iteration)
        self.bar.update(t.meta_batch)
        shown = {"loss": f"{row[TRAIN_LOSS]:.3f}", "acc": f"{row[TRAIN_ACC]:.3f}"}
        if state.best_val is not None:  # nothing to show before the first validation
            shown["best_val"] = f"{state.best_val:.3f}"
        self.bar.set_postfix(shown, refresh=False)
        if state.iteration % t.checkpoint_every == 0:
            distributed.check_same(self._learner.parameters())  # a diverged rank fails loudly
            if self.dist.is_main:
                self._save(self._snapshot)

    def keep_best(self, learner: MetaLearner, accuracy: float | None) -> float:
        """Remember the weights of the step being run if ``accuracy`` is the best validation
        so far (a NaN accuracy never is); with None (no validation split), keep the latest.
        With ``--ensemble-top-k K`` above 1, also keep them among the K best validations
        (`RunState.top`).

        Returns:
            The best validation accuracy so far (NaN while none is finite).
        """
        state, step = self.state, self.state.iteration + 1
        weights = None
        if accuracy is None or (
            not math.isnan(accuracy) and (state.best_val is None or accuracy > state.best_val)
        ):
            state.best_val = state.best_val if accuracy is None else accuracy
            weights = _cpu_state(learner)
            state.best_iteration, state.best_learner = step, weights
        k = self.recipe.training.ensemble_top_k
        if k > 1 and accuracy is not None and not math.isnan(accuracy):
            kept = weights  # the best's copy, if just taken: one copy for both
            state.top = top_k(state.top, step, accuracy, k,
                              lambda: _cpu_state(learner) if kept is None else kept)  # fmt: skip
        return math.nan if state.best_val is None else state.best_val

    def load_best(self, learner: MetaLearner) -> None:
        """Load the best-validation weights into ``learner`` (for the test).

        Raises:
            UserError: every validation was NaN: no weights are the best.
        """
        state = self.state
        validations = sum(VAL_ACC in row for row in state.history)
        require(validations == 0 or state.best_val is not None or state.best_learner is not None,
                f"all {validations} validations of {state.run_name} were NaN, so no weights are "
                "the best and none were tested; the run diverged: lower --inner-lr or "
                "--outer-lr")  # fmt: skip
        if state.best_learner is not None:
            learner.load_state_dict(state.best_learner)

    def ensemble(self) -> list[dict[str, torch.Tensor]] | None:
        """The weights the test ensembles (`RunState.top`, best first), or None with
        ``--ensemble-top-k 1``: the best weights alone (`load_best`)."""
        if self.recipe.training.ensemble_top_k == 1:
            return None
        return [entry["learner"] for entry in self.state.top]

    # ----------------------------------------------------------------------- finish

    def finish(self, results: dict[str, float]) -> dict[str, float]:
        """Record the test ``results`` (with the run's minutes) as the finished run: in the
        checkpoint (a finished run, which the grid skips) and the W&B summary.

        Raises:
            UserError: the test accuracy is NaN (tasks whose losses were not finite, under
                ``--on-nonfinite skip``); the run is left unfinished at its last step.
        """
        require(not math.isnan(results[TEST_ACC]),
                f"{TEST_ACC} of {self.state.run_name} is NaN: some test tasks' losses were not "
                "finite (--on-nonfinite skip scores them NaN); the run diverged: lower "
                "--inner-lr or --outer-lr")  # fmt: skip
        results[PERF_TOTAL_MINUTES] = (time.perf_counter() - self._started) / 60
        self.state.results = results
        final = {**self._snapshot, "results": results}
        if self.dist.is_main:
            self._save(final)
        if self._wandb is not None:
            self._wandb.summary.update(results)
            if self.args.tracking.log_model:
                log_model(self._wandb, self.path, name=f"{self.state.run_name}-model")
        self._results = results
        return results

    def __exit__(self, kind: type | None, err: BaseException | None, tb: Any) -> None:
        """End the run: the last completed step checkpointed unless it finished, W&B ended
        (failed unless `finish` ran), the lock released; a stop names ``--resume``; a write
        that found no room is one line naming the checkpoint kept (`unsaved_error`)."""
        exit_code = 0 if err is None and self._results is not None else 1
        failed: list[OSError | FileError | None] = []  # the writes that failed as it ended
        with contextlib.ExitStack() as ending:  # runs its callbacks last-first
            ending.callback(self._stack.close)  # the lock, the process group
            if self._wandb is not None:  # a full disk may refuse W&B's last writes too
                ending.callback(lambda: failed.append(finish_run(self._wandb, exit_code)))
            self._during.close()  # the bar, SIGTERM's handler
            if err is not None and self._snapshot is not None and self.dist.is_main:
                # Ctrl-C / SIGTERM / an error: keep the last completed step, so --resume
                # continues. No collective here: the other ranks may be gone.
                failed.append(self._save_last())
            if isinstance(err, KeyboardInterrupt | distributed.PeerError):
                exit_code = err.exit_code if isinstance(err, Stopped) else 1
                if not any(failed):  # else the checkpoint is an older step's (below)
                    self._stopped(err)
        if isinstance(err, _DIVERGED):
            raise diverged(err, self.state.iteration + 1) from None
        resume = f"--resume --run-name {self.state.run_name} --out-dir {self.args.tracking.out_dir}"
        line = unsaved_error(err, failed, self.path, self._kept, unit="meta-step", resume=resume,
                             stops=(KeyboardInterrupt, distributed.PeerError))  # fmt: skip
        if line is not None:
            raise line from None
        if err is None and self._results is not None and self.dist.is_main:
            results = self._results
            others = {k: v for k, v in results.items() if k not in (TEST_ACC, TEST_ACC_CI95)}
            print("  ".join(f"{k}: {v:.4g}" for k, v in others.items()))
            print(f"{TEST_ACC}: {results[TEST_ACC]:.4f} ± {results[TEST_ACC_CI95]:.4f}")

    def _save(self, snapshot: dict) -> None:
        """Write ``snapshot`` as the run's checkpoint (atomically: a failed write keeps the
        previous one), and remember its step as the one kept."""
        save_checkpoint(self.path, snapshot)
        self._kept = snapshot["iteration"]

    def _save_last(self) -> FileError | None:
        """Checkpoint the last completed step as the run ends on an error; the write's own
        error if it failed (the previous checkpoint is kept then), else None."""
        with signals_held():
            try:
                self._save(self._snapshot)
            except FileError as failed:
                return failed
        return None

    def _stopped(self, stop: BaseException) -> None:
        if self._wandb is not None and isinstance(stop, Stopped):
            self._wandb.mark_preempting()  # online: shown as preempted, resumable
        where = f"rank {self.dist.rank}: " if self.dist.distributed else ""
        state, out = self.state, self.args.tracking.out_dir
        print(f"\n{where}stopped at step {state.iteration}; continue with --resume "
              f"--run-name {state.run_name} --out-dir {out}")  # fmt: skip

    # ----------------------------------------------------------------------- the parts

    def _init_wandb(self, learner: MetaLearner) -> Any:
        """The W&B run (None without tracking), continuing ``state.wandb_id`` on resume; a
        resumed run first re-logs the checkpoint's history (see `metalearn.runs.lifecycle`).

        Its config is the recipe once: the resolved arguments (the data's folder resolved),
        the learner's arguments no flag sets (``learner``), the group the run is in, and the
        experiment, data set, parameter count and process count.
        """
        t, recipe = self.args.tracking, self.recipe
        if not t.track or not self.dist.is_main:
            return None
        data, algorithm = recipe.data, recipe.learner.algorithm
        group = run_group(algorithm, data.ways, data.shots, t.wandb_group)
        flat = flatten(self.args)
        root = resolve_data_root(data.root) if data.dataset == "omniglot" else Path(data.root)
        flat["data_root"] = str(root.expanduser().resolve())  # where the data was read
        by_flag = flag_arguments(algorithm)
        config = {
            **flat, "wandb_group": group, "experiment": recipe.experiment,
            "dataset": data.dataset,
            "learner": {k: v for k, v in recipe.learner.arguments.items() if k not in by_flag},
            "params": sum(p.numel() for p in learner.parameters()),
            "world_size": self.dist.world_size,
        }  # fmt: skip
        run = init_run(
            config, project=t.wandb_project, mode=t.wandb_mode, name=self.state.run_name,
            group=group, tags=[algorithm, data.dataset, f"{data.ways}w{data.shots}s",
                               *self.experiment.tags(self.args)],
            dir=t.out_dir, run_id=self.state.wandb_id, job_type="train",
        )  # fmt: skip
        if run is not None:
            self.state.wandb_id = run.id
            define_summaries(run)
            for row in self.state.history:
                run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])
        return run

    def _progress(self, validates: bool) -> tqdm:
        """One bar over every task left to run: training, validations and the test.

        Counting tasks (not steps) lets the ETA include validation and test; an evaluation
        task (more inner steps, no meta-gradient) costs roughly what a training task does,
        and a test ensemble of K models adapts each test task K times.
        """
        t = self.recipe.training
        steps = range(self.state.iteration + 1, t.iterations + 1)
        validations = sum(1 for s in steps if s % t.val_every == 0 or s == t.iterations)
        total = len(steps) * t.meta_batch + validations * t.val_tasks * validates
        test = t.test_tasks * t.ensemble_top_k
        return tqdm(total=total + test, initial=0, desc="train", unit="task",
                    dynamic_ncols=True, disable=not self.dist.is_main)  # fmt: skip

    def _take_snapshot(self) -> dict:
        """The checkpoint of the run at a step boundary (CPU tensors; cheap next to a step).

        The history is copied as a list of the same rows (rows are never changed once
        logged), so a snapshot costs O(steps) pointers, not a deep copy of every metric.
        """
        state = self.state  # lists copied: rows and top entries are replaced, not changed
        fields = {**state.to_dict(), "history": list(state.history), "top": list(state.top)}
        return {
            **self._record, **fields, "learner": _cpu_state(self._learner),
            "optimizer": copy.deepcopy(self._opt.state_dict()),
            "generator": self._gen.get_state(), "torch_rng": torch.get_rng_state(),
        }  # fmt: skip


# --------------------------------------------------------------------------- helpers


def load_samplers(recipe: Recipe, device: str) -> dict[str, EpisodicSampler]:
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


def meta_gradient(args: Any, learner: MetaLearner) -> Any:
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


def top_k(
    top: list[dict[str, Any]], step: int, accuracy: float, k: int, weights: Any
) -> list[dict[str, Any]]:
    """``top`` (the best validations, best first) with the one at ``step`` ranked in, cut to
    ``k``: a new list (a snapshot holding the old one keeps it).

    Ranked by accuracy, the earlier step first among equal ones, as the best-validation
    weights are chosen (so the first entry is always theirs). MAML++'s reference ranks its
    epochs by ``np.argsort`` of their validation accuracies, reversed, whose order of equal
    accuracies is not defined (numpy's default sort is not stable).

    Args:
        top: ``[{"iteration", "val", "learner"}, ...]``, best first.
        step, accuracy: the validation to rank.
        k: entries kept.
        weights: ``() -> state dict`` of the step's weights, called only if they are kept.
    """
    if len(top) >= k and (accuracy, -step) <= (top[-1]["val"], -top[-1]["iteration"]):
        return top  # not among the k best: no copy of the weights taken
    entry = {"iteration": step, "val": accuracy, "learner": weights()}
    return sorted([*top, entry], key=lambda e: (-e["val"], e["iteration"]))[:k]


def _cpu_state(learner: MetaLearner) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in learner.state_dict().items()}


@contextlib.contextmanager
def run_lock(folder: Path, main: bool = True) -> Iterator[None]:
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
