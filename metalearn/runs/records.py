"""Reading tracked runs back: offline run folders and online projects as `RunRecord`s.

Offline runs are read with wandb's own reader, ``wandb leet inspect --json`` (wandb >= 0.31),
once per run folder: its record stream holds the run record (name, group, job type, tags,
config), every summary update and history row, and the exit record (`_replay`). Facts this
relies on (wandb 0.31, measured):

- A live offline run flushes its ``.wandb`` file every 15 s; a file without an exit record
  that has not been written for `STALE_AFTER_S` belongs to a run that was killed or
  interrupted, which ``leet`` still reports as ``running``. It is read as ``truncated``.
- ``leet`` skips a damaged chunk with "skipped corrupt data" on stderr and exits 0, and
  fails with "transactionlog: ..." on a file it cannot read at all; both are ``corrupt``.
- A resumed run (``wandb.init(id=..., resume="allow")``) writes a new run folder per start,
  all with the same run id; `merge_segments` joins them into one record.
- ``run.finish()`` can return before wandb's service has written the file (seen: its 7-byte
  header just after, all of it 50 ms later); in the same process, read after
  ``wandb.teardown()``, which waits for the service.

Online runs (``ENTITY/PROJECT``) are read with ``wandb.Api()``; the server already merges
resumed segments there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metalearn.files import regular_file

__all__ = [
    "STALE_AFTER_S",
    "OfflineArtifact",
    "RunReadError",
    "RunRecord",
    "find_offline_artifact",
    "find_run_dirs",
    "offline_artifacts",
    "merge_segments",
    "read_offline_run",
    "read_offline_runs",
    "read_online_runs",
]

STALE_AFTER_S = 600.0
"""Seconds without a write after which an unfinished offline run counts as truncated: 40x
the 15 s flush of a live run, and the 10 min ``wandb leet inspect --follow`` waits."""

READ_WORKERS = 4
"""Run folders read at once (each read is one ``wandb-core leet`` process)."""


class RunReadError(RuntimeError):
    """Runs could not be read (no W&B login, no server, a ``wandb`` without ``leet``)."""


@dataclass
class RunRecord:
    """One run read back: its identity, config, final summary and full history."""

    path: str
    """The run folder (a resumed run: its latest segment) or ``entity/project/id``."""
    name: str
    group: str | None
    tags: list[str]
    state: str
    """finished, failed, running, crashed (online); truncated or corrupt (offline files)."""
    config: dict[str, Any]
    summary: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    start_time: str = ""
    """ISO 8601 start time (sorts runs in the order they were started)."""
    run_id: str = ""
    segments: list[str] = field(default_factory=list)
    """Every run folder this record was read from, oldest first (several when resumed)."""
    problems: list[str] = field(default_factory=list)
    """What was wrong with its files (truncated, corrupt), each naming the file."""
    job_type: str = ""
    """W&B's job type: ``train`` for the experiments' runs, ``eval`` for
    ``metalearn-evaluate``'s; empty for runs recorded without one."""
    segment_summaries: list[dict[str, Any]] = field(default_factory=list)
    """Each segment's own final summary, oldest first (one per entry of ``segments``)."""
    project: str = ""
    """The W&B project the run was logged to (empty where the file does not say)."""

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """(steps, values) of a logged metric, in logging order."""
        rows = [r for r in self.history if key in r and r[key] is not None]
        return [r.get("_step", i) for i, r in enumerate(rows)], [r[key] for r in rows]


def find_run_dirs(path: str | Path) -> list[Path]:
    """Offline run folders under ``path``: itself if it holds a ``.wandb`` file, else the
    ``*run-*`` folders in it or in its ``wandb/`` subfolder.

    Raises:
        FileNotFoundError: ``path`` does not exist, or holds no run.
        metalearn.files.FileError: ``path`` is a ``.wandb`` name that is no regular file (a
            FIFO, which wandb's reader would wait on for ever).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no such run folder: {path}")
    if path.suffix == ".wandb" and not path.is_dir():  # a FIFO is refused, never waited on
        return [regular_file(path, what="W&B run file")]
    if any(path.glob("*.wandb")):
        return [path]
    base = path / "wandb" if (path / "wandb").is_dir() else path
    dirs = sorted(p for p in base.glob("*run-*") if p.is_dir() and any(p.glob("*.wandb")))
    if not dirs:
        raise FileNotFoundError(
            f"no W&B runs under {path} (looked for {base}/*run-*/*.wandb); pass a wandb/ "
            "folder, a wandb/offline-run-* folder or a .wandb file"
        )
    return dirs


def read_offline_runs(paths: Iterable[str | Path]) -> list[RunRecord]:
    """Every run under ``paths`` (see `find_run_dirs`), resumed segments merged into one
    record, ordered by start time."""
    dirs = sorted({d.resolve() for p in paths for d in find_run_dirs(p)})
    # Each read waits on one ``wandb-core`` process (`_inspect_command`).
    with ThreadPoolExecutor(max_workers=READ_WORKERS) as pool:
        return merge_segments(pool.map(read_offline_run, dirs))


def read_offline_run(run_dir: str | Path) -> RunRecord:
    """Read one offline run folder (one segment of a resumed run) with one ``wandb leet``.

    Args:
        run_dir: a ``wandb/offline-run-*`` folder, or its ``.wandb`` file.

    Returns:
        The record; a damaged file gives state ``corrupt`` or ``truncated`` (with what was
        readable and a line in ``problems``) instead of an exception.

    Raises:
        metalearn.files.FileError: a ``.wandb`` file there is no regular file (a FIFO).
        RunReadError: wandb's reader failed, or printed what is not its records.
    """
    file = _wandb_file(Path(run_dir))
    rc, stream, err = _leet(_inspect_command(file))
    if rc != 0:
        return _unreadable(file, err)
    seen = _replay(_records(stream, file))
    exit_code = seen.pop("exit_code")
    state = "running" if exit_code is None else ("finished" if exit_code == 0 else "failed")
    state, problem = _file_state(file, state, exit_code is not None, err)
    run_id = seen["run_id"] or _id_from_name(file)
    return RunRecord(
        path=str(file.parent), name=seen["name"] or run_id or file.parent.name,
        state=state, run_id=run_id, segments=[str(file.parent)],
        problems=[problem] if problem else [], segment_summaries=[seen["summary"]], **{
            k: seen[k] for k in ("group", "tags", "config", "summary", "history", "start_time",
                                 "job_type", "project")},
    )  # fmt: skip


def _records(stream: str, file: Path) -> list[dict[str, Any]]:
    """The records ``wandb leet inspect --json`` printed for ``file``, one JSON object a line.

    Raises:
        RunReadError: a line that is not a JSON object (a ``wandb`` printing another form).
    """
    records = []
    for number, line in enumerate(stream.splitlines(), 1):
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            raise RunReadError(f"wandb leet inspect printed line {number} of {file}'s records "
                               f"as {line[:60]!r}, not a JSON object; reading offline runs "
                               "needs wandb >= 0.31 (pip install -U wandb)")  # fmt: skip
        records.append(record)
    return records


def _replay(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The run as its records (`_records`) leave it: the run record's identity and config
    (later records update earlier ones), the summary updates applied in order, the history
    rows, the exit code (None: no exit record).
    """
    seen: dict[str, Any] = {"name": "", "group": None, "tags": [], "config": {}, "summary": {},
                            "history": [], "start_time": "", "job_type": "", "run_id": "",
                            "exit_code": None, "project": ""}  # fmt: skip
    for record in records:
        kind = record.get("type")
        if kind == "history":
            seen["history"].append(record["history"]["item"])
        elif kind == "summary":
            update = record["summary"].get("update") or {}
            for key, value in update.items():
                if not key.startswith("_wandb"):
                    _set_nested(seen["summary"], key, value)
        elif kind == "run":
            run = record["run"]
            config = (run.get("config") or {}).get("update") or {}
            seen["config"].update({k: v for k, v in config.items() if not k.startswith("_")})
            for key, field_ in (("display_name", "name"), ("run_group", "group"),
                                ("job_type", "job_type"), ("run_id", "run_id"),
                                ("start_time", "start_time"), ("tags", "tags"),
                                ("project", "project")):  # fmt: skip
                if run.get(key):
                    seen[field_] = list(run[key]) if key == "tags" else run[key]
        elif kind == "exit":
            seen["exit_code"] = int(record["exit"].get("exit_code") or 0)
    return seen


def _set_nested(summary: dict[str, Any], key: str, value: Any) -> None:
    """Apply one summary update: the stream flattens a logged object's fields into dotted
    keys (an image's ``test/curves.width``), kept nested as the run's summary holds them
    (``summary["test/curves"]["width"]``); metric names hold no dots."""
    head, dot, rest = key.partition(".")
    if not dot:
        summary[key] = value
        return
    if not isinstance(summary.get(head), dict):
        summary[head] = {}
    _set_nested(summary[head], rest, value)


def _file_state(file: Path, state: str, exited: bool, stderr: str) -> tuple[str, str | None]:
    """The run's state as its file shows it, and what is wrong with the file (or None)."""
    if "corrupt" in stderr:
        return "corrupt", f"{file}: {_last_line(stderr)}"
    if exited:
        return state, None
    idle = time.time() - file.stat().st_mtime
    if idle < STALE_AFTER_S:
        return "running", None
    return "truncated", (
        f"{file}: ends without an exit record and was last written {idle / 60:.0f} min ago "
        "(the run was killed or interrupted); shown as far as it was written"
    )


def _unreadable(file: Path, stderr: str) -> RunRecord:
    if "transactionlog" not in stderr:  # not the file's fault: wandb itself failed
        raise RunReadError(
            f"wandb leet inspect failed on {file}: {_last_line(stderr)}; reading offline runs "
            "needs wandb >= 0.31 (pip install -U wandb)"
        )
    return RunRecord(
        path=str(file.parent), name=file.parent.name, group=None, tags=[], state="corrupt",
        config={}, summary={}, run_id="", segments=[str(file.parent)],
        problems=[f"{file}: unreadable ({_last_line(stderr)})"],
    )  # fmt: skip


def merge_segments(records: Iterable[RunRecord]) -> list[RunRecord]:
    """Join the segments of resumed runs (same run id) into one record each.

    History rows are keyed by step, a later segment's values replacing an earlier one's at
    the same step (a resumed run repeats the steps after its last checkpoint); config, name,
    group, tags and state come from the latest segment, the summary is the earlier ones
    updated by the later ones. Records without a run id (unreadable files) stay alone.

    Returns:
        One record per run, ordered by start time.
    """
    by_id: dict[str, list[RunRecord]] = {}
    alone: list[RunRecord] = []
    for r in records:
        (by_id.setdefault(r.run_id, []) if r.run_id else alone).append(r)
    merged = [_merge(sorted(group, key=_start_key)) for group in by_id.values()]
    return sorted(merged + alone, key=_start_key)


def _merge(segments: list[RunRecord]) -> RunRecord:
    if len(segments) == 1:
        return segments[0]
    rows: dict[Any, dict[str, Any]] = {}
    summary: dict[str, Any] = {}
    for seg in segments:
        for i, row in enumerate(seg.history):
            key = row.get("_step", (seg.path, i))
            rows[key] = {**rows.get(key, {}), **row}
        summary.update(seg.summary)
    last = segments[-1]
    # A resumed segment started without a name falls back to the run id: not a new name.
    named = [s for s in segments if s.name != s.run_id]
    return RunRecord(
        path=last.path, name=named[-1].name if named else last.run_id,
        group=next((s.group for s in reversed(segments) if s.group), None),
        tags=last.tags or next((s.tags for s in reversed(segments) if s.tags), []),
        state=last.state, config=last.config, summary=summary,
        history=sorted(rows.values(), key=lambda r: r.get("_step", 0)),
        start_time=segments[0].start_time, run_id=last.run_id,
        segments=[p for s in segments for p in s.segments],
        problems=[p for s in segments for p in s.problems],
        job_type=next((s.job_type for s in reversed(segments) if s.job_type), ""),
        segment_summaries=[x for s in segments for x in s.segment_summaries],
        project=next((s.project for s in reversed(segments) if s.project), ""),
    )  # fmt: skip


def _start_key(r: RunRecord) -> tuple[str, str]:
    # Folder names carry the start second only; the recorded start time breaks ties.
    return (r.start_time, r.path)


def _wandb_file(run_dir: Path) -> Path:
    if not run_dir.exists():
        raise FileNotFoundError(f"no W&B run at {run_dir}; pass a wandb/offline-run-* folder")
    if run_dir.is_file():
        return run_dir
    files = sorted(run_dir.glob("*.wandb"))
    if not files:
        raise FileNotFoundError(
            f"{run_dir} holds no .wandb file; pass a wandb/offline-run-* folder"
        )
    for file in files:  # wandb's reader waits on a FIFO for ever: refused here, named
        regular_file(file, what="W&B run file")
    if len(files) > 1:  # e.g. a file copied in: read the newest, name the others
        chosen = max(files, key=lambda f: (f.stat().st_mtime_ns, f.name))
        others = ", ".join(f.name for f in files if f != chosen)
        warnings.warn(f"{run_dir} holds {len(files)} .wandb files; reading {chosen.name}, the "
                      f"last written (not {others}); pass a .wandb file to read another",
                      stacklevel=3)  # fmt: skip
        return chosen
    return files[0]


def _id_from_name(file: Path) -> str:
    """``run-<id>.wandb`` -> ``<id>`` (a file cut before its run record still has an id)."""
    return file.stem.removeprefix("run-") if file.stem.startswith("run-") else ""


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "no message"


def _inspect_command(file: Path) -> list[str]:
    """The command that prints ``file``'s records, one JSON object a line: wandb's reader,
    ``wandb leet inspect --json``, run as the ``wandb-core`` binary the ``wandb`` command
    starts (0.1 s, where the ``wandb`` command spends about a second importing wandb first);
    the ``wandb`` command where that binary is not found."""
    spec = importlib.util.find_spec("wandb")
    core = Path(spec.origin).parent / "bin" / "wandb-core" if spec and spec.origin else None
    if core is not None and os.access(core, os.X_OK):
        # The arguments `wandb leet inspect` passes it for a .wandb file (wandb 0.31).
        return [str(core), "leet", "inspect", "--no-observability", "--json", "--run-file",
                str(file), str(file.parent.parent)]  # fmt: skip
    exe = Path(sys.executable).with_name("wandb")
    cli = [str(exe)] if exe.exists() else [sys.executable, "-m", "wandb"]
    return [*cli, "leet", "inspect", "--json", str(file)]


def _leet(cmd: list[str]) -> tuple[int, str, str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout, done.stderr


@dataclass
class OfflineArtifact:
    """An artifact an offline run logged, as its ``.wandb`` file records it."""

    name: str
    type: str
    aliases: list[str]
    digest: str
    """W&B's digest of the manifest (the same files give the same digest)."""
    files: dict[str, Path]
    """Each file's name in the artifact -> where its bytes are: a relative path in the
    manifest is read from the run folder (`metalearn.runs.tracking.add_run_file`)."""
    run_dir: Path
    run_id: str


def offline_artifacts(run_dir: str | Path) -> list[OfflineArtifact]:
    """The artifacts an offline run folder logged, in logging order (read with ``wandb leet``).

    Raises:
        FileNotFoundError: not a run folder (one with several .wandb files reads the newest).
        RunReadError: the file cannot be read.
    """
    file = _wandb_file(Path(run_dir))
    rc, out, err = _leet(_inspect_command(file))
    if rc != 0:
        raise RunReadError(f"wandb leet inspect failed on {file}: {_last_line(err)}")
    found = []
    for record in _records(out, file):
        if record.get("type") != "artifact":
            continue
        a = record["artifact"]
        entries = a.get("manifest", {}).get("contents", [])
        # An absolute local path stays as it is (joining drops the run folder).
        files = {e["path"]: file.parent / e["local_path"] for e in entries if e.get("local_path")}
        found.append(OfflineArtifact(a["name"], a.get("type", ""), list(a.get("aliases", [])),
                                     a.get("digest", ""), files, file.parent,
                                     a.get("run_id", "")))  # fmt: skip
    return found


def find_offline_artifact(wandb_dir: str | Path, name: str, alias: str) -> OfflineArtifact:
    """The newest artifact ``name`` with ``alias`` among the offline runs in ``wandb_dir``
    (folders holding ``artifacts/<name>/``, where `metalearn.runs.tracking.add_run_file`
    keeps an offline artifact's files).

    Raises:
        FileNotFoundError: no run there logged it (or not with that alias).
    """
    wandb_dir = Path(wandb_dir)
    candidates = sorted(p.parent.parent for p in wandb_dir.glob(f"*run-*/artifacts/{name}"))
    for run_dir in reversed(candidates):  # folder names start with the start time
        for artifact in reversed(offline_artifacts(run_dir)):
            if artifact.name == name and alias in artifact.aliases:
                return artifact
    raise FileNotFoundError(
        f"no offline run in {wandb_dir} logged an artifact {name}:{alias} (offline, an "
        "artifact is found among the runs it was logged by: pass --out-dir, or sync them and "
        "read it online)"
    )


def read_online_runs(path: str, filters: Mapping[str, Any] | None = None) -> list[RunRecord]:
    """Read the runs of ``entity/project`` from the W&B server with ``wandb.Api()``.

    Args:
        path: ``"entity/project"``.
        filters: a MongoDB-style filter as ``wandb.Api().runs`` takes, e.g.
            ``{"config.algorithm": "maml"}``.

    Raises:
        RunReadError: not logged in, or the server did not answer.
    """
    import wandb

    try:
        runs = list(wandb.Api().runs(path, filters=dict(filters or {})))
        return [_online_record(path, run) for run in runs]
    except wandb.errors.Error as e:
        raise RunReadError(
            f"reading {path} from the W&B server failed: {e} (log in with `wandb login`, or "
            "compare offline run folders instead)"
        ) from e


def _online_record(path: str, run: Any) -> RunRecord:
    return RunRecord(
        path=f"{path}/{run.id}", name=run.name, group=run.group, tags=list(run.tags),
        state=run.state, config={k: v for k, v in run.config.items() if not k.startswith("_")},
        summary=dict(run.summary), history=list(run.scan_history()),
        start_time=str(getattr(run, "created_at", "") or ""), run_id=run.id,
        segments=[f"{path}/{run.id}"], job_type=getattr(run, "job_type", "") or "",
        segment_summaries=[dict(run.summary)], project=path.rsplit("/", 1)[-1],
    )  # fmt: skip
