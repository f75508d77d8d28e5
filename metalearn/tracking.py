"""Weights & Biases tracking: offline by default, clean shutdown, reading runs back.

Facts this module is built on (wandb 0.31, measured): offline ``init`` takes
about 0.5 s; with an API key set but no network, online ``init`` blocks ~100 s before
failing, so the mode is decided *before* calling it; offline runs keep everything in their
``.wandb`` file, which ``wandb leet inspect --json`` reads back; data reaches that file only
every 15 s or at ``finish``, so SIGTERM is turned into a clean finish (and a killed process
loses up to 15 s of metrics: `metalearn.runs` keeps them in the checkpoint); an offline run
resumed under the same id is written to a new ``offline-run-*`` folder; ``finish(exit_code=N)``
with N != 0 records the run as ``failed``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metalearn.runs import Stopped

__all__ = [
    "RunRecord",
    "decide_mode",
    "git_commit",
    "graceful_shutdown",
    "init_run",
    "log_model",
    "read_offline_run",
    "read_online_runs",
]

WANDB_HOST = "api.wandb.ai"


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
) -> Any:
    """Start a W&B run with the whole config; returns the run, or None when disabled.

    Args:
        config: the experiment's whole configuration (a dataclass's ``asdict``).
        project: W&B project.
        mode: see `decide_mode`.
        name, group, tags: run metadata (the git commit is added as a tag).
        dir: where the ``wandb/`` folder goes.
        run_id: resume this run (``resume="allow"``) so a resumed experiment continues it.
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
        resume="allow" if run_id else None,
    )  # fmt: skip


@contextlib.contextmanager
def graceful_shutdown() -> Iterator[None]:
    """Turn SIGTERM into `metalearn.runs.Stopped` (a KeyboardInterrupt) inside the block.

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


def log_model(run: Any, path: str | Path, name: str) -> Any:
    """Log the checkpoint at ``path`` as a W&B artifact of type ``model``.

    Aliases ``best`` and ``latest``: the checkpoint holds both the best-validation and the
    last weights. Offline runs carry the artifact in their ``.wandb`` file until
    ``wandb sync``; then ``wandb artifact get <entity>/<project>/<name>:best`` fetches it.

    Returns:
        The logged artifact.
    """
    import wandb

    artifact = wandb.Artifact(name, type="model", metadata={"file": Path(path).name})
    artifact.add_file(str(path))
    return run.log_artifact(artifact, aliases=["best", "latest"])


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


@dataclass
class RunRecord:
    """One run read back: its identity, config, final summary and full history."""

    path: str
    name: str
    group: str | None
    tags: list[str]
    state: str
    config: dict[str, Any]
    summary: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    start_time: str = ""
    """ISO 8601 start time (sorts runs in the order they were started)."""

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """(steps, values) of a logged metric, in logging order."""
        rows = [r for r in self.history if key in r and r[key] is not None]
        return [r.get("_step", i) for i, r in enumerate(rows)], [r[key] for r in rows]


def _wandb_cli() -> list[str]:
    exe = Path(sys.executable).with_name("wandb")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "wandb"]


def read_offline_run(run_dir: str | Path) -> RunRecord:
    """Read an offline run directory with wandb's own ``wandb leet inspect --json``.

    Args:
        run_dir: a ``wandb/offline-run-*`` directory (or its ``.wandb`` file).
    """
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise FileNotFoundError(f"no W&B run at {run_dir}; pass a wandb/offline-run-* directory")
    cli = _wandb_cli()
    summary = json.loads(_run([*cli, "leet", "inspect", "--summary", "--json", str(run_dir)]))
    history, group = [], None
    for line in _run([*cli, "leet", "inspect", "--json", str(run_dir)]).splitlines():
        record = json.loads(line)
        if record.get("type") == "history":
            history.append(record["history"]["item"])
        elif record.get("type") == "run":
            group = record["run"].get("run_group") or group
    config = {k: v for k, v in summary.get("config", {}).items() if not k.startswith("_")}
    return RunRecord(
        path=str(run_dir), name=summary.get("name") or summary.get("run_id", run_dir.name),
        group=group, tags=list(summary.get("tags") or []), state=summary.get("state", "?"),
        config=config, summary=dict(summary.get("summary") or {}), history=history,
        start_time=summary.get("start_time", ""),
    )  # fmt: skip


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-500:]}; "
            "reading offline runs needs wandb >= 0.31"
        )
    return done.stdout


def read_online_runs(path: str, filters: Mapping[str, Any] | None = None) -> list[RunRecord]:
    """Read runs of ``entity/project`` from the W&B server with ``wandb.Api()``.

    Args:
        path: ``"entity/project"``.
        filters: a MongoDB-style filter as ``wandb.Api().runs`` takes, e.g.
            ``{"config.algorithm": "maml"}``.
    """
    import wandb

    records = []
    for run in wandb.Api().runs(path, filters=dict(filters or {})):
        records.append(
            RunRecord(
                path=f"{path}/{run.id}",
                name=run.name,
                group=run.group,
                tags=list(run.tags),
                state=run.state,
                config={k: v for k, v in run.config.items() if not k.startswith("_")},
                summary=dict(run.summary),
                history=list(run.scan_history()),
            )  # fmt: skip
        )
    return records
