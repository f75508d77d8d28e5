"""Weights & Biases tracking: offline by default, one config per run, clean shutdown.

Reading runs back (for comparison) is `metalearn.runs.records`.

Facts this module is built on (wandb 0.31, measured): offline ``init`` takes
about 0.5 s; with an API key set but no network, online ``init`` blocks ~100 s before
failing, so the mode is decided *before* calling it; offline runs keep everything in their
``.wandb`` file, which ``wandb leet inspect --json`` reads back; data reaches that file only
every 15 s or at ``finish``, so SIGTERM is turned into a clean finish (and a killed process
loses up to 15 s of metrics: `metalearn.runs.lifecycle` keeps them in the checkpoint); an
offline run resumed under the same id is written to a new ``offline-run-*`` folder;
``finish(exit_code=N)`` with N != 0 records the run as ``failed``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from metalearn.files import disk_full, open_regular, write_atomically
from metalearn.runs.lifecycle import Stopped, UserError
from metalearn.runs.metrics import TRAIN_ACC, TRAIN_LOSS, VAL_ACC

__all__ = [
    "SUMMARIES",
    "add_run_file",
    "check_mode",
    "decide_mode",
    "define_summaries",
    "finish_run",
    "git_commit",
    "graceful_shutdown",
    "init_run",
    "log_model",
    "run_group",
]

WANDB_HOST = "api.wandb.ai"

SUMMARIES = {TRAIN_ACC: "max", VAL_ACC: "max", TRAIN_LOSS: "min"}
"""How a training run's W&B summary holds a logged metric: its best value (``{"max": v}``
or ``{"min": v}``) instead of its last. ``val/best_acc`` needs none: it is the running best,
so its last value is already the best validation accuracy, a plain number a sweep can
optimise (experiments/sweeps/)."""


def _has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return WANDB_HOST in netrc.read_text()
    except OSError:
        return False


def _reachable(host: str, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def decide_mode(requested: str | None = "auto") -> str:
    """The W&B mode to use: ``"online"``, ``"offline"`` or ``"disabled"``.

    ``"auto"`` (or None) means: ``$WANDB_MODE`` if set; else online when an API key is
    configured *and* the server answers within 2 s; else offline.
    """
    if requested not in (None, "auto", "online", "offline", "disabled"):
        raise ValueError(f"unknown W&B mode {requested!r}; use auto, online, offline or disabled")
    if requested not in (None, "auto"):
        return requested
    env = os.environ.get("WANDB_MODE")
    if env in ("online", "offline", "disabled"):
        return env
    if env == "dryrun":
        return "offline"
    return "online" if _has_api_key() and _reachable(WANDB_HOST) else "offline"


def check_mode(requested: str | None = "auto", flag: str = "--wandb-mode") -> None:
    """Refuse online tracking without a W&B API key, before anything loads: wandb's ``init``
    would fail there (or ask for a key), after the data was read and the model built.

    Args:
        requested: the mode asked for (see `decide_mode`; ``auto`` is online only with a key).
        flag: how messages name the setting.

    Raises:
        UserError: online (asked, or ``$WANDB_MODE``) and no key in ``$WANDB_API_KEY`` or
            the netrc file.
    """
    if decide_mode(requested) != "online" or _has_api_key():
        return
    asked = f"{flag} online" if requested == "online" else "WANDB_MODE=online"
    raise UserError(f"{asked} needs a W&B API key and none is set: run `wandb login` (or set "
                    f"WANDB_API_KEY), or pass {flag} offline (`wandb sync` later)")  # fmt: skip


def git_commit(cwd: str | Path | None = None) -> str:
    """The short commit hash of the checkout (with ``-dirty`` if modified), or "unknown"."""
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--abbrev=10"],
            cwd=cwd or Path(__file__).resolve().parent, capture_output=True, text=True,
            timeout=5, check=True,
        )  # fmt: skip
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_group(algorithm: str, ways: int, shots: int, group: str | None = None) -> str:
    """A run's W&B group: ``group`` if given, else ``<algorithm>-<N>w<K>s``.

    The experiments and ``metalearn-evaluate`` (whose eval runs join the trained run's
    group) both name groups here.
    """
    return group or f"{algorithm}-{ways}w{shots}s"


def init_run(
    config: Mapping[str, Any],
    *,
    project: str,
    mode: str | None = "auto",
    name: str | None = None,
    group: str | None = None,
    tags: list[str] | None = None,
    dir: str | Path = "runs",
    run_id: str | None = None,
    job_type: str | None = None,
) -> Any:
    """Start a W&B run with the whole config; returns the run, or None when disabled.

    Args:
        config: the experiment's whole configuration (a dataclass's ``asdict``).
        project: W&B project.
        mode: see `decide_mode`.
        name, group, tags: run metadata (the git commit is added as a tag).
        dir: where the ``wandb/`` folder goes.
        run_id: resume this run (``resume="allow"``) so a resumed experiment continues it.
        job_type: W&B's job type (e.g. ``"eval"`` for a checkpoint's evaluation).
    """
    mode = decide_mode(mode)
    if mode == "disabled":
        return None
    import wandb

    Path(dir).mkdir(parents=True, exist_ok=True)
    commit = git_commit()
    return wandb.init(
        project=project, config={**config, "git_commit": commit}, mode=mode, name=name,
        group=group, tags=[*(tags or []), f"git:{commit}"], dir=str(dir), id=run_id,
        resume="allow" if run_id else None, job_type=job_type,
    )  # fmt: skip


@contextlib.contextmanager
def graceful_shutdown() -> Iterator[None]:
    """Turn SIGTERM into `metalearn.runs.lifecycle.Stopped` (a KeyboardInterrupt) inside the block.

    A killed job (SIGTERM from a scheduler, ``timeout``, ``kill``) then runs its ``finally``
    clauses: it keeps its last checkpoint and finishes its W&B run, exactly like Ctrl-C;
    ``Stopped.exit_code`` (143) is what the run and the process should end with.
    """

    if sys.platform == "win32" or not _in_main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Stopped(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def finish_run(run: Any, exit_code: int) -> OSError | None:
    """``run.finish(exit_code=...)``; on a full disk, the ``OSError`` wandb raises as it closes
    its log file in the run's folder (returned, naming that folder, for the run's one line),
    else None."""
    folder = run.settings.sync_dir
    try:
        run.finish(exit_code=exit_code)
    except OSError as err:
        if not disk_full(err):
            raise
        err.filename = err.filename or folder
        return err
    return None


def define_summaries(run: Any) -> None:
    """Make each metric of `SUMMARIES` summarised by its best value, not its last."""
    for metric, how in SUMMARIES.items():
        run.define_metric(metric, summary=how)


def log_model(run: Any, path: str | Path, name: str) -> Any:
    """Log the checkpoint at ``path`` as a W&B artifact of type ``model``.

    Aliases ``best`` and ``latest``: the checkpoint holds both the best-validation and the
    last weights. The bytes are kept in the run's W&B folder (`add_run_file`), so an
    offline run folder moved to another machine still holds its model; after ``wandb sync``
    ``wandb artifact get <entity>/<project>/<name>:best`` fetches it.

    Returns:
        The logged artifact.
    """
    import wandb

    artifact = wandb.Artifact(name, type="model", metadata={"file": Path(path).name})
    add_run_file(run, artifact, path)
    return run.log_artifact(artifact, aliases=["best", "latest"])


def add_run_file(run: Any, artifact: Any, path: str | Path) -> Any:
    """Add the file at ``path`` to ``artifact``, its bytes kept inside the run's W&B folder.

    The file is copied to ``<run folder>/artifacts/<artifact name>/<file name>`` and added
    as it is there (``policy="immutable"``: no second copy in wandb's staging folder, which
    lives outside the run, in ``$WANDB_DATA_DIR``). Offline, the manifest entry names it
    relative to the run folder: wandb records a file's path as given and ``wandb sync``
    opens it as recorded, from the folder it runs in, never relative to the run folder
    (wandb-core's sync rewrites only the entity, project, run id and job type), so an
    absolute path would die with the machine. Sync a moved folder from inside it: ``cd
    <out_dir>/wandb/offline-run-... && wandb sync .``. Online runs upload at once.

    Returns:
        The manifest entry.
    """
    source = Path(path)
    folder = Path(run.settings.sync_dir).resolve()
    kept = folder / "artifacts" / artifact.name / source.name
    # a copy, as wandb's own staging (the source may change), written whole or not at all
    write_atomically(kept, lambda file: _copy(source, file), what="model artifact")
    entry = artifact.add_file(str(kept), name=source.name, policy="immutable")
    if run.offline:
        entry.local_path = str(kept.relative_to(folder))
    return entry


def _copy(source: Path, file: Any) -> None:
    with open_regular(source, what="checkpoint") as src:
        shutil.copyfileobj(src, file)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
