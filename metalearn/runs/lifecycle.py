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
- **A full disk** (or a quota, or a file-size limit) is such an error: a write of the run's
  that found no room ends it with one line naming the file, the checkpoint kept on disk (the
  last one written: `metalearn.files.write_atomically` replaces nothing when it fails) and
  the way on (`out_of_room`). wandb-core drops the records it cannot write without a word,
  so a run's own checkpoint, written after the steps it holds were logged, is what finds a
  full disk under a tracked run too; ``--resume`` then re-logs every step (above).
- **A reader that leaves** (``| head -1``) ends the program quietly, exit status 141
  (`metalearn.runs.cli.quiet_on_closed_stdout`); a run's checkpoint is saved first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from metalearn.files import FileError, disk_full
from metalearn.runs.cli import CLOSED_STDOUT, silence_stdout

__all__ = [
    "RunState",
    "Stopped",
    "UserError",
    "diverged",
    "latest_segment",
    "merge_resumed_args",
    "out_of_room",
    "require",
    "run_cli",
    "signals_held",
    "unsaved_error",
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


def out_of_room(err: OSError | FileError, checkpoint: Path, kept: int | None, *, unit: str,
                resume: str) -> UserError:  # fmt: skip
    """The one line a run ends with when a write of its found no room (`disk_full`).

    Args:
        err: the refused write (a `FileError` names its file; an ``OSError`` may).
        checkpoint: the run's checkpoint file.
        kept: the step of the checkpoint on disk (None: none was written).
        unit: what a step is called (``"meta-step"``, ``"iteration"``).
        resume: the flags that continue the run (``--resume --run-name ...``).
    """
    target = getattr(err, "path", None) or getattr(err, "filename", None) or checkpoint.parent
    reason = os.strerror(err.errno) if err.errno else str(err)
    if kept is None:
        held, then = "no checkpoint of the run was written", "run it again"
    else:
        held, then = f"{checkpoint} of {unit} {kept} is kept", f"continue with {resume}"
    return UserError(f"could not write {target}: {reason}; {held}: free space on the disk "
                     f"holding {checkpoint.parent}, then {then}")  # fmt: skip


def unsaved_error(err: BaseException | None, failed: Sequence[BaseException | None],
                  checkpoint: Path, kept: int | None, *, unit: str, resume: str,
                  stops: tuple[type, ...] = (KeyboardInterrupt,)) -> UserError | None:  # fmt: skip
    """The one line a run ends with when a write of its failed, else None (``err``, if any,
    goes on as it is).

    Args:
        err: what ended the run (None: it finished); a `UserError` is never replaced.
        failed: the writes that failed as the run ended (its last checkpoint's `FileError`,
            W&B's ``OSError``; None for one that did not fail).
        checkpoint, kept, unit, resume: as `out_of_room`.
        stops: the errors that end a run without a fault of its own (a signal): after one,
            a failed last write is the line, whatever the failure.

    Returns:
        `out_of_room` of the first of ``err`` and ``failed`` that found no room; else a
        failed last write's line after a stop; else None.
    """
    if isinstance(err, UserError):
        return None
    full = next((e for e in (err, *failed) if e is not None and disk_full(e)), None)
    if full is not None:
        return out_of_room(full, checkpoint, kept, unit=unit, resume=resume)
    other = next((e for e in failed if e is not None), None)
    if other is not None and isinstance(err, stops):
        return UserError(" ".join(str(other).split()))
    return None


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
    """Run ``main(parse())`` as a program: exit 2 with one line on a `UserError` (and on a
    file refused or not written, `metalearn.files.FileError`, or a write that found no
    room), exit 128 + signal when stopped by a signal (the run is saved by then), exit 141
    quietly when stdout's reader has left (`metalearn.runs.cli.CLOSED_STDOUT`), else 0."""
    # A log file on a full disk (wandb's debug.log in the run's folder) fails on each record:
    # not a traceback each time; the run's own write that found no room is the one line.
    logging.raiseExceptions = False
    try:
        main(parse())
        sys.stdout.flush()  # a closed stdout fails here, not in the interpreter's exit
    except BrokenPipeError:
        silence_stdout()
        sys.exit(CLOSED_STDOUT)
    except (UserError, FileError) as err:
        _fail(str(err))
    except OSError as err:
        if not disk_full(err):
            raise
        _fail(f"could not write {err.filename or 'a file'}: {os.strerror(err.errno)}; free "
              "space on its disk, then run again")  # fmt: skip
    except Stopped as stop:
        sys.exit(stop.exit_code)
    except KeyboardInterrupt:  # Ctrl-C outside the held sections: SIGINT
        sys.exit(128 + signal.SIGINT)


def _fail(message: str) -> None:
    print(f"error: {' '.join(message.split())}", file=sys.stderr)
    sys.exit(2)
