"""A meta-RL run's lifecycle: `metalearn.runs.run.Run`'s guarantees for a loop that trains
policy parameters on sampled episodes instead of a `MetaLearner` on a data set's tasks.

`Run` is built around the supervised recipe (a data set, a learner from the registry, the
best-validation weights chosen by accuracy, ``test/acc``); a meta-RL run has none of these.
`PolicyRun` keeps what every run must do, from the same parts: the arguments checked and
named once (`metalearn.runs.experiment.new_run_identity`), the run folder's lock
(`metalearn.runs.lock`), a resume that is the saved run (`merge_resumed_args`: only
`RESUMABLE` arguments may change) at the saved step, atomic checkpoints holding the history
(`metalearn.checkpoint`), SIGTERM and Ctrl-C ending with the last completed step saved and
``--resume`` named, W&B with a resumed run's history re-logged, and a user's mistake as one
line (`UserError`, exit 2)::

    with PolicyRun(EXPERIMENT, args) as run:   # checked, named, locked, resumed
        run.start({"policy": params_holder})   # a resumed run's state restored; W&B
        for iteration in run.steps():
            run.log(row)                       # history, W&B, checkpoint
        run.finish(results, headline=...)      # the final record; the last line

A run's randomness is a function of its seed and where it is used (`metalearn.rl.seeds`), so
a resumed run repeats an uninterrupted one bit for bit; torch's global generator is saved
as well, for anything drawn from it.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from metalearn.checkpoint import load_checkpoint, save_checkpoint
from metalearn.files import FileError
from metalearn.runs.cli import flatten, unflatten
from metalearn.runs.experiment import (
    Experiment,
    _check_device,
    _check_run_folder,
    _taken,
    checkpoint_path,
    new_run_identity,
    require_owner,
)
from metalearn.runs.lifecycle import (
    RunState,
    Stopped,
    UserError,
    merge_resumed_args,
    require,
    signals_held,
    unsaved_error,
)
from metalearn.runs.run import run_lock
from metalearn.runs.tracking import check_mode, finish_run, graceful_shutdown, init_run, log_model

__all__ = ["RESUMABLE", "PolicyRun", "saved_args"]

RESUMABLE = (
    "iterations",
    "checkpoint_every",
    "device",
    "threads",
    "track",
    "wandb_mode",
    "wandb_group",
    "log_model",
    "out_dir",
    "resume",
)
"""What ``--resume`` may change: how long, where and how fast the run goes on."""


def saved_args(exp: Experiment, path: Path) -> dict[str, Any]:
    """A meta-RL run's saved flat arguments, refused unless ``exp`` wrote its checkpoint:
    what `metalearn.runs.experiment.parse_args` takes as ``saved_args`` to resume one (a
    meta-RL checkpoint holds no recipe to check)."""
    return _read(exp, path)["args"]


def _known(exp: Experiment, flat: Mapping[str, Any]) -> dict[str, Any]:
    fields = flatten(exp.args_type())
    return {k: v for k, v in flat.items() if k in fields}


def _read(exp: Experiment, path: Path) -> dict:
    """A run's checkpoint, or a one-line `UserError` naming why it cannot be resumed."""
    try:
        saved = load_checkpoint(path)
    except FileNotFoundError as err:
        raise UserError(str(err)) from None
    except Exception as err:  # truncated, empty, or not a checkpoint at all
        raise UserError(
            f"{path} cannot be read as a checkpoint ({type(err).__name__}); start "
            "a new run with another --run-name"
        ) from None
    require(isinstance(saved, dict) and "args" in saved,
            f"{path} is not a metalearn run's checkpoint (no 'args' entry)")  # fmt: skip
    require_owner(exp, path, saved)
    require(saved.get("experiment") == exp.name,
            f"{path} is not a checkpoint of experiments/{exp.name}.py; resume it with the "
            "script that wrote it")  # fmt: skip
    return saved


class PolicyRun:
    """One meta-RL run's lifecycle (module docstring); a context manager.

    Attributes:
        args: the resolved arguments (a resumed run's saved ones, with what may change).
        state: the step, the history and the results (`RunState`).
        path: the run's checkpoint file.
    """

    def __init__(self, experiment: Experiment, args: Any) -> None:
        self.experiment, self.args = experiment, args
        self.saved: dict | None = None
        self._stack = contextlib.ExitStack()
        self._during = contextlib.ExitStack()
        self._wandb: Any = None
        self._snapshot: dict | None = None
        self._finished = False
        self._kept: int | None = None  # the iteration of the checkpoint on disk (None: none)
        self._started = time.perf_counter()

    def __enter__(self) -> PolicyRun:
        """Check and resolve the arguments, take the run folder's lock, read a resumed run's
        checkpoint. Writes nothing but the lock.

        Raises:
            UserError: a bad argument, a resume that changes the run, a run that exists.
        """
        exp = self.experiment
        args = copy.deepcopy(self.args)  # the caller's arguments stay as given
        t = args.tracking
        _check_device(args.system.device)
        _check_run_folder(t.out_dir, t.run_name, t.resume)
        if t.track:
            check_mode(t.wandb_mode)  # online needs a key: refused before anything runs
        exp.check(args)
        args = exp.resolve(args)
        t = args.tracking
        if t.run_name is None:
            t.run_name, chosen = new_run_identity(f"{exp.name}-{args.env.env}-seed{_seed(args)}")
            t.wandb_id = t.wandb_id or chosen
        torch.set_num_threads(max(args.system.threads, 1))
        self.path = checkpoint_path(args)
        with contextlib.ExitStack() as stack:
            stack.enter_context(run_lock(self.path.parent))
            if t.resume:
                self.saved = _read(exp, self.path)
                merged = merge_resumed_args(self.saved["args"], flatten(args), RESUMABLE)
                require(
                    merged["iterations"] >= self.saved["iteration"],
                    f"--iterations {merged['iterations']} is below the "
                    f"{self.saved['iteration']} iterations {self.path} already holds",
                )
                args = unflatten(exp.args_type, _known(exp, merged))
            else:
                require(not self.path.exists(), _taken(self.path))
            self._stack = stack.pop_all()
        self.args = args
        self.state = RunState(run_name=str(t.run_name), wandb_id=t.wandb_id)
        if self.saved is not None:
            self.state = RunState.from_dict(self.saved)
            self._kept = self.state.iteration
        try:  # a closed stdout (| head -1) raises here: the lock is released, not left
            print(f"checkpoint: {self.path}", flush=True)
            if self.saved is not None:
                print(f"resuming {self.state.run_name} at iteration {self.state.iteration} of "
                      f"{args.training.iterations}", flush=True)  # fmt: skip
        except BaseException:
            self._stack.close()
            raise
        return self

    def start(self, parts: Mapping[str, Any]) -> None:
        """Begin training: a resumed run's ``parts`` (name -> an object with ``state_dict``
        and ``load_state_dict``) and torch's generator restored, the W&B run started (a
        resumed one re-logs its history), SIGTERM turned into `Stopped`."""
        if self.saved is not None:
            for name, part in parts.items():
                part.load_state_dict(self.saved[name])
            torch.set_rng_state(self.saved["torch_rng"])
        self._parts = dict(parts)
        self._wandb = self._init_wandb()
        where = Path(self._wandb.dir).parent if self._wandb is not None else "not tracked"
        print(f"W&B run: {where}", flush=True)
        self._snapshot = self._take_snapshot()
        self._during.enter_context(graceful_shutdown())

    def steps(self) -> Iterator[int]:
        """The iterations left to run, 0-based; each ends with `log`."""
        yield from range(self.state.iteration, self.args.training.iterations)

    def log(self, row: dict[str, float], show: Callable[[dict], str] | None = None) -> None:
        """End the current iteration with its metrics: kept in the history, logged to W&B,
        printed (``show(row)``), and checkpointed every ``checkpoint_every`` iterations."""
        state = self.state
        state.iteration += 1
        state.history.append({"step": state.iteration, **row})
        self._snapshot = self._take_snapshot()
        if self._wandb is not None:
            self._wandb.log(row, step=state.iteration)
        if show is not None:
            print(
                f"iteration {state.iteration}/{self.args.training.iterations}  {show(row)}",
                flush=True,
            )
        if state.iteration % self.args.training.checkpoint_every == 0:
            self._save(self._snapshot)

    def finish(self, results: dict[str, float], headline: tuple[str, str]) -> dict[str, float]:
        """Record ``results`` as the finished run (checkpoint and W&B summary); print them,
        the ``headline`` (metric, its 95% half-width) last."""
        results["perf/total_minutes"] = (time.perf_counter() - self._started) / 60
        self.state.results = results
        self._save({**self._snapshot, "results": results})
        if self._wandb is not None:
            self._wandb.summary.update(results)
            if self.args.tracking.log_model:
                log_model(self._wandb, self.path, name=f"{self.state.run_name}-model")
        self._finished = True
        key, ci = headline
        others = {k: v for k, v in results.items() if k not in headline}
        print("  ".join(f"{k}: {v:.4g}" for k, v in others.items()))
        print(f"{key}: {results[key]:.4g} ± {results[ci]:.2g}", flush=True)
        return results

    def __exit__(self, kind: type | None, err: BaseException | None, tb: Any) -> None:
        """End the run: the last completed iteration checkpointed unless it finished, W&B
        ended (failed unless `finish` ran), the lock released; a stop names ``--resume``; a
        write that found no room is one line naming the checkpoint kept (`unsaved_error`)."""
        exit_code = 0 if err is None and self._finished else 1
        failed: list[OSError | FileError | None] = []  # the writes that failed as it ended
        with contextlib.ExitStack() as ending:
            ending.callback(self._stack.close)
            if self._wandb is not None:  # a full disk may refuse W&B's last writes too
                ending.callback(lambda: failed.append(finish_run(self._wandb, exit_code)))
            self._during.close()
            if err is not None and self._snapshot is not None:
                try:
                    self._save(self._snapshot)
                except FileError as unsaved:  # the previous checkpoint is kept
                    failed.append(unsaved)
            if isinstance(err, KeyboardInterrupt) and not failed:
                print(
                    f"\nstopped at iteration {self.state.iteration}; continue with --resume "
                    f"--run-name {self.state.run_name} --out-dir {self.args.tracking.out_dir}"
                )
                if isinstance(err, Stopped) and self._wandb is not None:
                    self._wandb.mark_preempting()
        resume = f"--resume --run-name {self.state.run_name} --out-dir {self.args.tracking.out_dir}"
        line = unsaved_error(err, failed, self.path, self._kept, unit="iteration", resume=resume)
        if line is not None:
            raise line from None

    def _save(self, snapshot: dict) -> None:
        """Write ``snapshot`` as the checkpoint (a signal held until it is written; a failed
        write keeps the previous one), and remember its iteration as the one kept."""
        with signals_held():
            save_checkpoint(self.path, snapshot)
        self._kept = snapshot["iteration"]

    def _init_wandb(self) -> Any:
        t = self.args.tracking
        if not t.track:
            return None
        env = self.args.env.env
        group = t.wandb_group or f"{self.experiment.name}-{env}"
        run = init_run(
            {**flatten(self.args), "experiment": self.experiment.name},
            project=t.wandb_project,
            mode=t.wandb_mode,
            name=self.state.run_name,
            group=group,
            tags=[self.experiment.name, env],
            dir=t.out_dir,
            run_id=self.state.wandb_id,
            job_type="train",
        )
        if run is not None:
            self.state.wandb_id = run.id
            for row in self.state.history:  # a resumed run: no metric lost
                run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])
        return run

    def _take_snapshot(self) -> dict:
        fields = {**self.state.to_dict(), "history": list(self.state.history)}
        parts = {name: copy.deepcopy(part.state_dict()) for name, part in self._parts.items()}
        return {
            "experiment": self.experiment.name,
            "args": flatten(self.args),
            **fields,
            **parts,
            "torch_rng": torch.get_rng_state(),
        }


def _seed(args: Any) -> int:
    return flatten(args)["seed"]
