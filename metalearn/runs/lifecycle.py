"""A tracked run's lifecycle: its state, resuming it, user errors, signals, and its history.

Shared by the experiments so that a run says exactly what ran:

- **State.** `RunState` is everything a run carries from step to step besides the weights,
  optimiser and generators; a checkpoint is ``{"args": ..., weights..., **RunState}``.
- **Resume is the saved run.** `merge_resumed_args` takes the checkpoint's arguments and
  refuses any given value that differs from them, except the fields a user may change on a
  resume (more iterations, another device, ...). Nothing is written before that check.
- **No metric lost** (the design): a W&B run loses what it has not flushed when the process
  is killed (``kill -9``; wandb flushes about every 15 s), so the metrics of every step are
  kept in `RunState.history` and written *inside* each checkpoint, atomically with the
  weights they belong to. A resumed run continues the same W&B run id, first re-logs the
  checkpoint's history, then re-runs the steps after the checkpoint deterministically (the
  generators are restored). Offline, a resume starts a new ``offline-run-*`` segment of the
  same id; `latest_segment` is the one that holds every step exactly once. Online (or after
  ``wandb sync`` of every segment) the server keeps the first value of each step and drops
  re-logged steps it already has, so again every step is there once. Chosen over reading
  the killed segment back (slow, and nothing is known to be in it) and over one W&B run per
  resume (a reader would have to stitch them).
- **Errors a user can fix** (`UserError`) end the program with one line and exit code 2;
  SIGTERM/SIGINT end it with 128 + the signal number after the run is saved (`Stopped`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "RunState",
    "Stopped",
    "UserError",
    "diverged",
    "latest_segment",
    "merge_resumed_args",
    "require",
    "run_cli",
    "signals_held",
]

T = TypeVar("T")


class UserError(Exception):
    """A mistake the user can fix (bad value, missing data, a run that exists): one line."""


class NonFiniteGradientError(FloatingPointError):
    """The meta-gradient of a step is NaN or infinite while its losses are finite (a loss
    so large its gradient overflows); the step is not taken."""

    def __init__(self, parameters: list[str]) -> None:
        self.parameters = parameters
        super().__init__(f"non-finite meta-gradient of {', '.join(parameters)}")


def diverged(err: FloatingPointError, step: int) -> UserError:
    """The one line a run that diverged at meta-step ``step`` ends with.

    Args:
        err: the engine's `NonFiniteLossError` (``kind``, ``task_index``, ``step``: the
            inner step, None for a query loss), `AllTasksSkippedError` (``n_tasks``) or
            `NonFiniteGradientError`.
        step: the meta-step (1-based) whose tasks gave the non-finite loss.
    """
    if isinstance(err, NonFiniteGradientError):  # finite losses: skipping tasks cannot help
        more = f" (and {len(err.parameters) - 1} more)" if len(err.parameters) > 1 else ""
        return UserError(
            f"meta-step {step}: non-finite meta-gradient of {err.parameters[0]}{more} from "
            "finite losses; the run diverged: lower --inner-lr or --outer-lr (the step was "
            "not taken; the checkpoint keeps the last finite step)"
        )
    if hasattr(err, "n_tasks"):  # AllTasksSkippedError: skipping already on
        return UserError(
            f"meta-step {step}: all {err.n_tasks} tasks had non-finite losses under "
            "--on-nonfinite skip; the run diverged: lower --inner-lr or --outer-lr, or check "
            "the data for NaNs (the checkpoint keeps the last finite step)"
        )
    task = f", task {err.task_index}" if err.task_index is not None else ""
    inner = f", inner step {err.step}" if err.step is not None else ""
    return UserError(
        f"meta-step {step}{task}{inner}: non-finite {err.kind} loss ({err.value}); the run "
        "diverged: lower --inner-lr or --outer-lr, check the data for NaNs, or pass "
        "--on-nonfinite skip to drop such tasks (recorded in the run)"
    )


class Stopped(KeyboardInterrupt):
    """The run was stopped by a signal (SIGINT or SIGTERM) after saving what it had.

    Attributes:
        signum: the signal's number; the process exits with 128 + signum.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(f"received signal {signum}")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def require(ok: bool, message: str) -> None:
    """Raise `UserError` with ``message`` unless ``ok``."""
    if not ok:
        raise UserError(message)


@dataclass
class RunState:
    """What a run carries between steps besides weights, optimiser and generators.

    Attributes:
        run_name: the run's folder under ``out_dir`` and its W&B name.
        iteration: meta-steps completed.
        best_val: best validation accuracy so far; None before the first validation.
        best_iteration: the step ``best_val`` was measured at.
        best_learner: the weights at ``best_iteration`` (CPU tensors), or None.
        wandb_id: the W&B run id, so a resume continues the same run.
        history: the metrics logged at every completed step, in order (each with "step").
        results: the test results once the run finished, else None.
        top: with ``--ensemble-top-k K`` above 1, the K best validations so far, best first
            (ties: the earlier), each ``{"iteration", "val", "learner"}``; the first is
            ``best_*`` (its weights the same tensors). Empty otherwise.
    """

    run_name: str
    iteration: int = 0
    best_val: float | None = None
    best_iteration: int = 0
    best_learner: dict[str, Any] | None = None
    wandb_id: str | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    results: dict[str, float] | None = None
    top: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The state as plain containers (a checkpoint's entries); shares the tensors."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, saved: Mapping[str, Any]) -> RunState:
        """The state held in a checkpoint (other entries are ignored)."""
        return cls(**{f.name: saved[f.name] for f in dataclasses.fields(cls) if f.name in saved})


def merge_resumed_args(
    saved: Mapping[str, Any], given: Mapping[str, Any], changeable: Collection[str]
) -> dict[str, Any]:
    """The saved run's arguments, with the given values of the ``changeable`` fields.

    A given value that is None (left open) takes the saved value.

    Raises:
        UserError: a field outside ``changeable`` was given a value other than the saved
            one (the message names both values and the way out).
    """
    merged = dict(saved)
    for key, value in given.items():
        if value is None or key not in saved or value == saved[key]:
            continue
        if key not in changeable:
            flag = "--" + key.replace("_", "-")
            raise UserError(
                f"{flag} {value} differs from the resumed run's "
                f"{'default' if saved[key] is None else saved[key]}; drop {flag} to "
                f"continue that run, or start a new one with --run-name (on resume only "
                f"{', '.join('--' + c.replace('_', '-') for c in sorted(changeable))} may change)"
            )
        merged[key] = value
    return merged


def latest_segment(wandb_dir: str | Path, run_id: str) -> Path:
    """The newest ``offline-run-*-<run_id>`` folder: the one holding the whole history.

    Raises:
        FileNotFoundError: no offline segment of that run under ``wandb_dir``.
    """
    segments = sorted(Path(wandb_dir).glob(f"offline-run-*-{run_id}"))
    if not segments:
        raise FileNotFoundError(f"no offline W&B run {run_id} under {wandb_dir}")
    return segments[-1]


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM until the block ends, then raise `Stopped` if one came.

    A checkpoint being written when a signal arrives is finished first: the write is atomic
    either way, but cutting it short loses the steps since the previous checkpoint.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if held:
        raise Stopped(held[0])


def run_cli(main: Callable[[T], Any], parse: Callable[[], T]) -> None:
    """Run ``main(parse())`` as a program: exit 2 with one line on a `UserError`, exit
    128 + signal when stopped by a signal (the run is saved by then), else exit 0."""
    try:
        main(parse())
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except Stopped as stop:
        sys.exit(stop.exit_code)
    except KeyboardInterrupt:  # Ctrl-C outside the held sections: SIGINT
        sys.exit(128 + signal.SIGINT)
