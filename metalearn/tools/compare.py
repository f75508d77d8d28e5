"""Compare tracked runs: the config that differs, how each run ended, and its curves.

Usage:
    metalearn-compare runs/wandb                        # the offline runs there
    metalearn-compare runs/wandb --group-by algorithm   # seeds: mean ± 95% CI
    metalearn-compare runs/wandb --metrics val/acc perf/tasks_per_s --format csv
    metalearn-compare runs/wandb --group-by inner_lr --plot runs/compare.png
    metalearn-compare runs/wandb --metrics curv/meta_top_eig curv/meta_trace
    metalearn-compare runs/wandb --evals    # each run's evaluations beside it
    metalearn-compare runs/wandb --job-type eval --group-by shots
    metalearn-compare ENTITY/PROJECT --online --filter config.algorithm=maml
    metalearn-compare runs/wandb --project metalearn-omniglot --group grid --tag maml

Each metric is read in the direction `DIRECTIONS` gives it (accuracies up; losses, interval
widths and times down; throughput up); a metric it does not know shows its final value only.
The curvature metrics (``curv/``: Hessian eigenvalues and traces) have no direction on
purpose: a sharper or flatter landscape is something to watch, not better in itself, so
they show their final value and their curves, never a "best".
One row per run, or with ``--group-by`` one row per group of runs (e.g. seeds), each number
the mean over the group's runs ± the 95% confidence half-width of that mean (Student t,
n - 1 degrees of freedom). Offline runs are read with `metalearn.runs.records`; a resumed run
is one row (its time, `SEGMENT_TOTALS`, summed over its segments), a damaged file is named on
stderr. For an interactive look, open the same folder with ``wandb leet runs/wandb``.

One W&B project is compared at a time (``--project``; by default the one with the most runs,
the others named on stderr), so the sine and curvature demos never join an Omniglot table;
``--group`` and ``--tag`` narrow it further. What is compared is what was trained: the runs
of one W&B job type (``--job-type``, default ``train``; an evaluation of a checkpoint by
``metalearn-evaluate`` is an ``eval`` job), never a mix; ``--evals`` shows each training
run's evaluations in rows beside it, outside the ranking. A config's nested dicts are
columns with dotted names (`flatten_config`): the recipe's ``learner.first_order``,
``data.image.size``, ...
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import sys
from collections import Counter
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Literal

import tyro

from metalearn.files import FileError, write_atomically
from metalearn.runs.cli import parse_dataclass, quiet_on_closed_stdout
from metalearn.runs.records import (
    RunReadError,
    RunRecord,
    read_offline_runs,
    read_online_runs,
)

DEFAULT_METRICS = ("val/acc", "test/acc", "train/loss")
"""What `experiments/omniglot_maml.py` logs to judge a run: validation, test, training."""

DIRECTIONS: tuple[tuple[str, str, str], ...] = (
    # (pattern on the metric's last path part, "up" or "down", what it measures);
    # the first match wins, so the suffixes come before the words they end. No pattern
    # matches the curvature metrics (curv/*): neither direction is better (module docstring).
    ("*_ci95", "down", "95% interval half-width"),
    ("*_per_s", "up", "throughput"),
    ("*_s", "down", "seconds"),
    ("*_seconds", "down", "seconds"),
    ("*_minutes", "down", "minutes"),
    ("acc", "up", "accuracy"),
    ("*_acc", "up", "accuracy"),
    ("*accuracy", "up", "accuracy"),
    ("*loss*", "down", "loss"),
    ("*mse*", "down", "squared error"),
)

RANGES: dict[str, tuple[float | None, float | None]] = {
    "accuracy": (0.0, 1.0), "loss": (0.0, None), "squared error": (0.0, None),
    "seconds": (0.0, None), "minutes": (0.0, None), "throughput": (0.0, None),
    "95% interval half-width": (0.0, None),
}  # fmt: skip
"""The values a metric can take, by what it measures (`direction`): a plotted interval is
clipped to them (a mean accuracy of 0.98 ± 0.05 is drawn up to 1, not 1.03)."""

BOOKKEEPING = frozenset({
    "out_dir", "run_name", "resume", "track", "wandb", "wandb_mode", "wandb_project",
    "threads", "device", "data_root", "tune_malloc", "dist_timeout", "checkpoint_every",
    "wandb_id", "data.root", "training.checkpoint_every", "checkpoint", "run",
    "training_run_id",
})  # fmt: skip
"""Config keys that say where and how a run was kept, not what was run: never compared."""

SEGMENT_TOTALS = {"perf/total_minutes": 60.0}
"""Metrics a run's segment measures of itself (``perf/total_minutes``: the wall time of one
process), with the seconds in one unit: a resumed run's value is the sum over its segments,
and a segment stopped before it logged one counts its W&B ``_runtime`` (seconds until its
last write), so a run resumed three times does not look faster than one that ran through."""

ONLINE_PATH = re.compile(r"[\w-][\w.-]*/[\w-][\w.-]*")
"""``ENTITY/PROJECT``: the only form read from the W&B server, and only with ``--online``."""

PROG = "metalearn-compare"

PLOTS_HINT = "pip install 'metalearn[plots]'"


class UsageError(Exception):
    """A mistake in the command line: printed as one line, exit status 2."""


def value_range(metric: str) -> tuple[float | None, float | None]:
    """(lowest, highest) value ``metric`` can take; None where it is not bounded or known."""
    known = direction(metric)
    return RANGES.get(known[1], (None, None)) if known else (None, None)


def clip(values: list[float], bounds: tuple[float | None, float | None]) -> list[float]:
    """``values`` clipped into ``bounds`` (a None bound: none on that side)."""
    lo, hi = bounds
    return [min(max(v, lo if lo is not None else v), hi if hi is not None else v) for v in values]


def direction(metric: str) -> tuple[str, str] | None:
    """("up" or "down", what it measures) for a metric, or None when unknown."""
    name = metric.rsplit("/", 1)[-1]
    for pattern, way, what in DIRECTIONS:
        if fnmatchcase(name, pattern):
            return way, what
    return None


# --- statistics --------------------------------------------------------------------------


def t_cdf_two_sided(t: float, dof: int) -> float:
    """P(|T| <= t) for Student's t with ``dof`` degrees of freedom (t >= 0).

    The closed forms of Abramowitz & Stegun 26.7.3-4 in theta = atan(t / sqrt(dof)): a finite
    series in cos^2(theta), exact for integer ``dof``.
    """
    theta = math.atan(t / math.sqrt(dof))
    c2, term, total = math.cos(theta) ** 2, 1.0, 1.0
    if dof % 2 == 0:  # sin(theta) * (1 + 1/2 c2 + 1*3/(2*4) c2^2 + ...), dof/2 terms
        for k in range(1, dof // 2):
            term *= c2 * (2 * k - 1) / (2 * k)
            total += term
        return math.sin(theta) * total
    if dof == 1:
        return 2 * theta / math.pi
    for k in range(1, (dof - 1) // 2):  # 2/pi (theta + sin cos (1 + 2/3 c2 + ...))
        term *= c2 * (2 * k) / (2 * k + 1)
        total += term
    return 2 / math.pi * (theta + math.sin(theta) * math.cos(theta) * total)


def t_quantile(level: float, dof: int) -> float:
    """t such that P(|T| <= t) = ``level``: the two-sided critical value (bisection)."""
    lo, hi = 0.0, 1.0
    while t_cdf_two_sided(hi, dof) < level:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf_two_sided(mid, dof) < level else (lo, mid)
    return (lo + hi) / 2


def mean_ci95(values: list[float]) -> tuple[float, float | None]:
    """Mean of ``values`` and the half-width of its 95% confidence interval.

    Half-width = t_{0.975, n-1} * s / sqrt(n), s the sample standard deviation (n - 1 in
    the denominator); None for a single value.
    """
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None
    s = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, t_quantile(0.95, n - 1) * s / math.sqrt(n)


# --- reading -----------------------------------------------------------------------------


def load(sources: list[str], online: bool, filters: dict[str, Any]) -> list[RunRecord]:
    """Runs from local run folders, and from ``ENTITY/PROJECT`` when ``online``; a damaged
    run file is named on stderr, and skipped when nothing of it could be read."""
    local, projects = [], []
    for src in sources:
        if Path(src).exists():
            local.append(src)
        elif online and ONLINE_PATH.fullmatch(src):
            projects.append(src)
        elif ONLINE_PATH.fullmatch(src):
            raise UsageError(f"no such run folder: {src} (to read W&B project {src}, add --online)")
        else:
            raise UsageError(f"no such run folder: {src}")
    runs = read_offline_runs(local) if local else []
    for project in projects:
        runs += read_online_runs(project, filters)
    for r in runs:
        for problem in r.problems:
            print(f"warning: {problem}{'' if r.run_id else '; skipped'}", file=sys.stderr)
    return [r for r in runs if r.run_id]


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def final_value(run: RunRecord, metric: str) -> float | None:
    """The run's final value: its summary's, else the last logged one (a `SEGMENT_TOTALS`
    metric of a resumed run: the sum over its segments)."""
    if metric in SEGMENT_TOTALS and len(run.segment_summaries) > 1:
        return _segment_total(run, metric)
    value = _number(run.summary.get(metric))
    if value is None:
        values = [v for v in map(_number, run.series(metric)[1]) if v is not None]
        value = values[-1] if values else None
    return value


def _segment_total(run: RunRecord, metric: str) -> float | None:
    """The sum of ``metric`` over the run's segments, W&B's runtime standing in for a
    segment that did not log it (it stopped before its end)."""
    total, seen = 0.0, False
    for summary in run.segment_summaries:
        value = _number(summary.get(metric))
        if value is None:
            seconds = _number(summary.get("_runtime"))
            value = None if seconds is None else seconds / SEGMENT_TOTALS[metric]
        if value is not None:
            total, seen = total + value, True
    return total if seen else None


def flatten_config(config: dict[str, Any]) -> dict[str, Any]:
    """A run's config with its nested dicts as dotted keys, less what the flat keys show.

    The recipe's parts keep their own names (``data.image.size``, ``model.backbone``), a
    learner's arguments sit directly under ``learner`` (``learner.first_order``), the
    recipe's own scalars under ``recipe.`` (``recipe.version``); any other dict under its
    key. A dotted key whose last part is a flat key with the same value (``learner.inner_lr``
    beside ``inner_lr``) is left out: it says nothing new.
    """
    flat = {k: v for k, v in config.items() if not isinstance(v, dict)}
    dotted: dict[str, Any] = {}
    for key, value in config.items():
        if not isinstance(value, dict):
            continue
        if key == "recipe":
            dotted.update({f"recipe.{k}": v for k, v in value.items() if not isinstance(v, dict)})
            dotted.update(_dotted({k: v for k, v in value.items() if isinstance(v, dict)}, ""))
        else:
            dotted.update(_dotted(value, f"{key}."))
    for key, value in dotted.items():
        leaf = key.rsplit(".", 1)[-1]
        if not (leaf in flat and flat[leaf] == value):
            flat[key] = value
    return flat


def _dotted(tree: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            # A learner's constructor arguments read as the learner's settings.
            inner = prefix if (key == "arguments" and prefix == "learner.") else f"{prefix}{key}."
            out.update(_dotted(value, inner))
        else:
            out[f"{prefix}{key}"] = value
    return out


def job_type(run: RunRecord) -> str:
    """The run's W&B job type; a run recorded without one is a training run unless tagged
    ``eval`` (evaluations were tagged so before they carried a job type)."""
    return run.job_type or ("eval" if "eval" in run.tags else "train")


def evaluated_run(evaluation: RunRecord, runs: list[RunRecord]) -> RunRecord | None:
    """The training run an evaluation run tested: by the W&B id it recorded, else by the
    run's name (evaluations recorded before they named the id); None when not among
    ``runs``."""
    config = evaluation.config
    by_id = {r.run_id: r for r in runs}
    if config.get("training_run_id") in by_id:
        return by_id[config["training_run_id"]]
    named = [r for r in runs if r.name == config.get("run")]
    return named[-1] if named else None


def best_step(run: RunRecord, metric: str, way: str) -> dict[str, Any] | None:
    """The history row where ``metric`` was best in direction ``way`` (first on ties)."""
    rows = [r for r in run.history if _number(r.get(metric)) is not None]
    if not rows:
        return None
    pick = max if way == "up" else min
    return pick(rows, key=lambda r: r[metric])


# --- the comparison ----------------------------------------------------------------------


@dataclass
class Estimate:
    """A number in the table: a run's value, or the mean over a group's runs."""

    value: float
    ci95: float | None
    """Half-width: the run's logged ``<metric>_ci95``, or across a group's runs (t)."""
    n: int
    """Runs behind it."""


@dataclass
class Row:
    """One run, or one group of runs."""

    label: str
    runs: list[RunRecord]
    config: dict[str, Any]
    final: dict[str, Estimate | None] = field(default_factory=dict)
    best: dict[str, Estimate | None] = field(default_factory=dict)
    """Only metrics with a best-over-steps column; an evaluation row has none (one value)."""
    evaluates: str | None = None
    """For an evaluation run shown beside its training run: that run's row label (the row
    is outside the ranking)."""


@dataclass
class Comparison:
    """Everything the table, the CSV, the JSON and the plot show."""

    rows: list[Row]
    metrics: list[str]
    config_keys: list[str]
    group_by: list[str]
    varied_within: list[str]
    """Config keys that differ inside a group (what the group's runs average over)."""
    bookkeeping: list[str]
    """Differing config keys left out as bookkeeping."""
    best_row: dict[str, str | None]
    with_best: list[str]
    """Metrics with a best-over-steps column (known direction, a history)."""


def _differs(runs: list[RunRecord], key: str) -> bool:
    return len({repr(r.config.get(key)) for r in runs}) > 1


def compare(
    runs: list[RunRecord],
    metrics: list[str],
    group_by: list[str],
    evals: list[RunRecord] | None = None,
) -> Comparison:
    """Rows (runs, or groups of runs by the ``group_by`` config keys) and their numbers.

    Args:
        runs: the runs, in the order they were started (rows keep it).
        metrics: the metric keys to show.
        group_by: config keys; empty: one row per run.
        evals: evaluation runs to show, each in a row after the row of the run it tested
            (`evaluated_run`), never averaged or ranked.

    Returns:
        The comparison: per row the final (and, with a known direction and a history, the
        best-over-steps) estimate of each metric, the config keys that tell rows apart.
    """
    keys = sorted({k for r in runs for k in r.config})
    differing = [k for k in keys if _differs(runs, k)]
    groups: dict[str, list[RunRecord]] = {}
    names = Counter(r.name for r in runs)
    for r in runs:  # a group per row, or a run per row in the order they were started
        label = ", ".join(f"{k}={r.config.get(k, '-')}" for k in group_by)
        label = label or (r.name if names[r.name] == 1 else f"{r.name} ({r.run_id})")
        groups.setdefault(label, []).append(r)
    varied = [k for k in differing if any(_differs(g, k) for g in groups.values())]
    shown = [k for k in differing if k not in BOOKKEEPING and k not in varied]
    shown = [*group_by, *(k for k in shown if k not in group_by)]
    rows = [Row(label, g, {k: g[0].config.get(k) for k in shown}) for label, g in groups.items()]
    with_best = [m for m in metrics if direction(m) and any(len(r.series(m)[1]) > 1 for r in runs)]
    for row in rows:
        for m in metrics:
            row.final[m] = _estimate(row.runs, m, None, grouped=bool(group_by))
            if m in with_best:
                row.best[m] = _estimate(row.runs, m, direction(m)[0], grouped=bool(group_by))
    best_row = {m: _best_row(rows, m) for m in metrics}
    return Comparison(
        rows=_with_evals(rows, evals or [], runs, shown, metrics), metrics=metrics,
        config_keys=shown, group_by=group_by,
        varied_within=[k for k in varied if k not in BOOKKEEPING],
        bookkeeping=[k for k in differing if k in BOOKKEEPING],
        best_row=best_row, with_best=with_best,
    )  # fmt: skip


def _with_evals(rows: list[Row], evals: list[RunRecord], runs: list[RunRecord],
                shown: list[str], metrics: list[str]) -> list[Row]:  # fmt: skip
    """``rows``, each followed by a row per evaluation of one of its runs."""
    out = []
    for row in rows:
        out.append(row)
        for e in evals:
            if evaluated_run(e, runs) in row.runs:
                ev = Row(_eval_label(e), [e], {k: e.config.get(k) for k in shown},
                         evaluates=row.label)  # fmt: skip
                ev.final = {m: _estimate([e], m, None, grouped=False) for m in metrics}
                out.append(ev)
    return out


def _eval_label(e: RunRecord) -> str:
    """``↳ NAME (eval: 5 shots, 20 steps, 2000 tasks, best weights)``."""
    c = e.config
    parts = [f"{c[k]} {word}" for k, word in (("shots", "shots"), ("steps", "steps"),
                                              ("tasks", "tasks")) if k in c]  # fmt: skip
    if "which" in c:
        parts.append(f"{c['which']} weights")
    return f"↳ {e.name} (eval{': ' if parts else ''}{', '.join(parts)})"


def _estimate(runs: list[RunRecord], m: str, way: str | None, grouped: bool) -> Estimate | None:
    """Final value (``way`` None) or best-over-steps value of ``m``: a run's own, with its
    logged interval, or the mean of a group's with the t interval across its runs."""
    points = []  # (value, logged half-width)
    for r in runs:
        if way is None:
            value, half = final_value(r, m), final_value(r, f"{m}_ci95")
        else:
            step = best_step(r, m, way)
            value, half = (None, None) if step is None else (step[m], step.get(f"{m}_ci95"))
        if value is not None:
            points.append((float(value), _number(half)))
    if not points:
        return None
    if not grouped:
        return Estimate(points[0][0], points[0][1], 1)
    mean, half = mean_ci95([v for v, _ in points])
    return Estimate(mean, half, len(points))


def _best_row(rows: list[Row], m: str) -> str | None:
    known = direction(m)
    scored = [(row.final[m].value, row.label) for row in rows if row.final.get(m)]
    if known is None or not scored:
        return None
    pick = max if known[0] == "up" else min
    return pick(scored, key=lambda s: s[0])[1]


# --- output ------------------------------------------------------------------------------


def notes(c: Comparison) -> list[str]:
    """What the numbers mean: direction of each metric, the intervals, what was left out."""
    lines = []
    for m in c.metrics:
        known = direction(m)
        if known is None:
            lines.append(f"{m}: direction unknown, final value only")
        else:
            way = "higher" if known[0] == "up" else "lower"
            best = f"; best final: {c.best_row[m]}" if c.best_row[m] else ""
            lines.append(f"{m}: {known[1]}, {way} is better{best}")
    if c.group_by:
        lines.append(
            "±: 95% confidence interval of the mean across a group's n runs "
            "(Student t, n - 1 degrees of freedom); none for n = 1"
        )
        if c.varied_within:
            lines.append(f"averaged over (differs within groups): {', '.join(c.varied_within)}")
    else:
        lines.append("±: the run's own logged <metric>_ci95, where it logged one")
    if c.with_best:
        lines.append("best: each run's best logged value over its steps")
    if c.bookkeeping:
        lines.append(f"left out as bookkeeping: {', '.join(c.bookkeeping)}")
    for m in c.metrics:
        if m in SEGMENT_TOTALS:
            lines.append(f"{m}: a resumed run's is the sum over its segments")
    if any(row.evaluates for row in c.rows):
        lines.append("↳ rows: evaluations (metalearn-evaluate) of the row above, not ranked")
    return lines


def _cell(e: Estimate | None) -> str:
    if e is None:
        return "-"
    return f"{e.value:.4g}" + ("" if e.ci95 is None else f" ± {e.ci95:.2g}")


def _columns(c: Comparison) -> list[tuple[str, str, str]]:
    """(header, metric, "final" or "best") per metric column."""
    cols = []
    for m in c.metrics:
        arrow = {"up": " ↑", "down": " ↓"}.get((direction(m) or ("", ""))[0], "")
        cols.append((f"{m}{arrow}", m, "final"))
        if m in c.with_best:
            cols.append((f"{m}{arrow} best", m, "best"))
    return cols


def to_markdown(c: Comparison) -> str:
    """A markdown table (the best final value of each metric in bold), then its notes."""
    cols = _columns(c)
    head = ["group" if c.group_by else "run", *(["n"] if c.group_by else []), "state"]
    head += [*c.config_keys, *(h for h, _, _ in cols)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in c.rows:
        cells = [row.label, *([str(len(row.runs))] if c.group_by else []), _state(row)]
        cells += [_fmt(row.config.get(k)) for k in c.config_keys]
        for _, m, kind in cols:
            text = _cell(getattr(row, kind).get(m))
            bold = kind == "final" and c.best_row[m] == row.label and len(c.rows) > 1
            cells.append(f"**{text}**" if bold else text)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", *notes(c)])


def to_csv(c: Comparison) -> str:
    """One line per row: label, n, state, config, then value and ±95% per metric column."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    cols = [(f"{m} {kind}", m, kind) for _, m, kind in _columns(c)]
    writer.writerow(["label", "n", "state", *c.config_keys,
                     *(x for h, _, _ in cols for x in (h, f"{h} ci95"))])  # fmt: skip
    for row in c.rows:
        cells: list[Any] = [row.label, len(row.runs), _state(row)]
        cells += [row.config.get(k) for k in c.config_keys]
        for _, m, kind in cols:
            e = getattr(row, kind).get(m)
            cells += ["", ""] if e is None else [e.value, "" if e.ci95 is None else e.ci95]
        writer.writerow(cells)
    return out.getvalue().rstrip("\n")


def to_json(c: Comparison) -> str:
    """The comparison as one JSON object (rows, metrics with direction and best row, notes)."""

    def est(e: Estimate | None) -> dict[str, Any] | None:
        return None if e is None else {"value": e.value, "ci95": e.ci95, "n": e.n}

    rows = [
        {"label": r.label, "n": len(r.runs), "state": _state(r), "config": r.config,
         "runs": [run.path for run in r.runs], "evaluates": r.evaluates,
         "metrics": {m: {"final": est(r.final[m]), "best": est(r.best.get(m))}
                     for m in c.metrics}}
        for r in c.rows
    ]  # fmt: skip
    metrics = [
        {"name": m, "direction": (direction(m) or (None,))[0], "best_row": c.best_row[m]}
        for m in c.metrics
    ]
    return json.dumps(
        {"group_by": c.group_by, "metrics": metrics, "rows": rows, "notes": notes(c),
         "varied_within_groups": c.varied_within, "bookkeeping_left_out": c.bookkeeping},
        default=str, indent=1,
    )  # fmt: skip


def _state(row: Row) -> str:
    counts = Counter(r.state for r in row.runs)
    return ", ".join(s if len(row.runs) == 1 else f"{n} {s}" for s, n in counts.items())


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


# --- plot --------------------------------------------------------------------------------


def require_plot(out: Path, overwrite: bool) -> None:
    """Fail before any work when the plot cannot be written: matplotlib missing, a name
    matplotlib cannot write, a file there and no ``--overwrite``, or a folder there."""
    require_matplotlib(out)
    if out.is_dir():
        raise UsageError(f"--plot {out} is a folder; give a file name, e.g. {out / 'compare.png'}")
    if os.path.lexists(out) and not overwrite:
        raise UsageError(f"--plot {out} exists; pass --overwrite to replace it, or another name")


def write_plot(c: Comparison, out: Path, overwrite: bool) -> None:
    """The figure written to ``out`` whole or not at all (`metalearn.files.write_atomically`).

    Raises:
        UsageError: the file could not be written (a full disk), or appeared meanwhile.
    """
    kind = out.suffix.lstrip(".").lower()
    try:
        write_atomically(out, lambda file: figure(c).savefig(file, format=kind, dpi=120),
                         overwrite=overwrite, what="--plot")  # fmt: skip
    except (FileExistsError, FileError) as err:
        raise UsageError(str(err)) from None


def require_matplotlib(out: Path) -> None:
    """Fail before any work when matplotlib cannot write the plot."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
    except ImportError:
        raise UsageError(f"--plot needs matplotlib: {PLOTS_HINT}") from None
    kinds = FigureCanvasAgg.get_supported_filetypes()
    if out.suffix.lstrip(".").lower() not in kinds:
        raise UsageError(f"--plot {out}: end the name in one of .{', .'.join(sorted(kinds))}")


def figure(c: Comparison) -> Any:
    """One panel per metric: curves with 95% bands, or points with intervals for metrics
    logged only once (test metrics). Returns the matplotlib Figure."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5 * len(c.metrics), 3.8), layout="constrained")
    axes = fig.subplots(1, len(c.metrics), squeeze=False)[0]
    for ax, m in zip(axes, c.metrics):
        known = direction(m)
        way = "" if known is None else f" ({'higher' if known[0] == 'up' else 'lower'} is better)"
        if any(len(r.series(m)[1]) > 1 for row in c.rows for r in row.runs):
            for row in c.rows:
                _curve(ax, row, m, grouped=bool(c.group_by))
            ax.set_xlabel("step")
        else:
            _points(ax, c.rows, m)
        ax.set_ylabel(f"{m}{way}")
        ax.set_title(m)
    legend: dict[str, Any] = {}  # one legend for every panel, beside them: off the data
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    if legend:
        fig.legend(list(legend.values()), list(legend), loc="outside right upper", fontsize=7)
    band = "mean ± 95% CI across runs (t)" if c.group_by else "± logged 95% interval"
    fig.suptitle(f"bands and bars: {band}, clipped to each metric's range", fontsize=9)
    return fig


def _curve(ax: Any, row: Row, m: str, grouped: bool) -> None:
    """The row's curve: a run's values (± its logged ``m_ci95``), or a group's mean ± CI."""
    by_step: dict[float, list[tuple[float, float | None]]] = {}
    for r in row.runs:
        for i, h in enumerate(r.history):
            if _number(h.get(m)) is not None:
                step = h.get("_step", i)
                by_step.setdefault(step, []).append((h[m], _number(h.get(f"{m}_ci95"))))
    if not by_step:
        return
    steps = sorted(by_step)
    if grouped:
        stats = [mean_ci95([v for v, _ in by_step[s]]) for s in steps]
    else:
        stats = [by_step[s][-1] for s in steps]
    (line,) = ax.plot(steps, [mean for mean, _ in stats], label=f"{row.label} (n={len(row.runs)})")
    band = [(s, mean, half) for s, (mean, half) in zip(steps, stats) if half is not None]
    if band:
        xs, means, halves = zip(*band)
        bounds = value_range(m)
        lo = clip([a - h for a, h in zip(means, halves)], bounds)
        hi = clip([a + h for a, h in zip(means, halves)], bounds)
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.25, linewidth=0)


def _points(ax: Any, rows: list[Row], m: str) -> None:
    """A point per row at its final value, with its interval as an error bar."""
    bounds = value_range(m)
    for i, row in enumerate(rows):
        e = row.final.get(m)
        if e is not None:
            half = e.ci95 or 0.0
            (lo,), (hi,) = clip([e.value - half], bounds), clip([e.value + half], bounds)
            ax.errorbar([i], [e.value], yerr=[[e.value - lo], [hi - e.value]], fmt="o",
                        capsize=4, label=f"{row.label} (n={e.n})")  # fmt: skip
    ax.set_xticks(range(len(rows)), [row.label for row in rows], rotation=20, fontsize=7)
    ax.set_xlim(-0.5, len(rows) - 0.5)


# --- command line ------------------------------------------------------------------------


@dataclass
class Args:
    """Arguments of metalearn-compare (each is a --flag; see --help)."""

    sources: tyro.conf.Positional[tuple[str, ...]] = ()
    """Run folders, wandb/ folders, .wandb files; ENTITY/PROJECT with --online."""
    metrics: tuple[str, ...] = ()
    """Metrics to show (default: those of val/acc test/acc train/loss the runs logged)."""
    group_by: tuple[str, ...] = ()
    """Config keys (dotted for nested ones: learner.first_order): a row per group, mean ±
    95% CI of its runs."""
    job_type: str = "train"
    """The W&B job type compared: train (the experiments' runs) or eval (metalearn-evaluate's
    evaluations); a run recorded without one is train, or eval if tagged eval."""
    evals: bool = False
    """Show each training run's evaluation runs in rows after it (not ranked, not averaged)."""
    format: Literal["markdown", "csv", "json"] = "markdown"
    """Output format."""
    plot: str | None = None
    """Write the curves to this image (.png, ...); an existing file needs --overwrite."""
    overwrite: bool = False
    """Replace the plot's file where it exists."""
    online: bool = False
    """Read ENTITY/PROJECT sources from the W&B server."""
    filter: tyro.conf.UseAppendAction[tuple[str, ...]] = ()
    """Online runs only, KEY=VALUE (repeat for more), e.g. config.algorithm=maml."""
    project: str | None = None
    """The W&B project compared (default: the one with the most runs of the compared job
    type; the others are named on stderr)."""
    group: tyro.conf.UseAppendAction[tuple[str, ...]] = ()
    """Only runs in this W&B group (repeat: any of them)."""
    tag: tyro.conf.UseAppendAction[tuple[str, ...]] = ()
    """Only runs with this W&B tag (repeat: every one of them)."""


def parse_args(argv: list[str] | None) -> Args:
    """The command line as `Args` (a bad one: one line on stderr, exit status 2)."""
    return parse_dataclass(Args, argv, description=__doc__.split("\n\n")[0])


def _filters(items: list[str], online: bool) -> dict[str, Any]:
    if items and not online:
        raise UsageError("--filter selects online runs; add --online with an ENTITY/PROJECT")
    filters = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise UsageError(f"--filter {item!r}: write KEY=VALUE, e.g. config.algorithm=maml")
        try:
            filters[key] = json.loads(value)  # numbers and booleans match as such
        except json.JSONDecodeError:
            filters[key] = value
    return filters


def _metrics(runs: list[RunRecord], asked: list[str] | None) -> list[str]:
    """The metrics compared: those asked for, each logged by some run, else the defaults
    the runs logged.

    Raises:
        UsageError: a metric asked for that no run logged, or none of the defaults logged
            (both naming the metrics the runs logged).
    """
    logged = {k for r in runs for k in r.summary} | {k for r in runs for h in r.history for k in h}
    if asked:
        if unknown := [m for m in asked if m not in logged]:
            names = ", ".join(sorted(k for k in logged if not k.startswith("_")))
            raise UsageError(f"--metrics {' '.join(unknown)}: no run logged "
                             f"{'it' if len(unknown) == 1 else 'them'}; the runs logged "
                             f"{names or 'nothing'}")  # fmt: skip
        return asked
    metrics = [m for m in DEFAULT_METRICS if m in logged]
    if not metrics:
        names = ", ".join(sorted(k for k in logged if not k.startswith("_"))[:12])
        raise UsageError(f"these runs logged none of {', '.join(DEFAULT_METRICS)}; pass "
                         f"--metrics KEY... (logged: {names or 'nothing'})")  # fmt: skip
    return metrics


def run(argv: list[str] | None = None) -> str:
    """The comparison as text in the chosen format (and the plot, if asked).

    Raises:
        UsageError: a bad source, key, filter or plot path; matplotlib missing for --plot.
    """
    args = parse_args(argv)
    if not args.sources:
        raise UsageError("give the runs to compare: run folders, wandb/ folders, .wandb files "
                         "(or ENTITY/PROJECT with --online)")  # fmt: skip
    plot = None if args.plot is None else Path(args.plot)
    if plot is not None:
        require_plot(plot, args.overwrite)
    filters = _filters(list(args.filter), args.online)
    try:
        runs = load(args.sources, args.online, filters)
    except (FileNotFoundError, RunReadError, FileError) as e:  # FileError: a FIFO, say
        raise UsageError(str(e)) from None
    runs, note = in_project(runs, args.project, args.job_type)
    runs, evals = select(runs, args.job_type, args.evals, args.sources)
    runs = filtered(runs, args.group, args.tag)
    group_by = list(args.group_by)
    for key in group_by:
        if not any(key in r.config for r in runs):
            keys = ", ".join(sorted({k for r in runs for k in r.config}))
            raise UsageError(f"--group-by {key}: no run has this config key (keys: {keys})")
    c = compare(runs, _metrics(runs, list(args.metrics)), group_by, evals)
    text = {"markdown": to_markdown, "csv": to_csv, "json": to_json}[args.format](c)
    if plot is not None:
        write_plot(c, plot, args.overwrite)
        print(f"plot: {plot}", file=sys.stderr)
    if note is not None:
        print(note, file=sys.stderr)
    return text


def select(runs: list[RunRecord], wanted: str, with_evals: bool,
           sources: tuple[str, ...]) -> tuple[list[RunRecord], list[RunRecord]]:  # fmt: skip
    """The runs of job type ``wanted`` and (``with_evals``) the evaluations shown beside
    them, every config flattened (`flatten_config`).

    Raises:
        UsageError: no run of that job type (naming the job types there are).
    """
    for r in runs:
        r.config = flatten_config(r.config)
    chosen = [r for r in runs if job_type(r) == wanted]
    if not chosen:
        found = ", ".join(sorted({job_type(r) for r in runs}))
        raise UsageError(f"no {wanted} runs in {' '.join(sources)} (job types there: {found}); "
                         "pass --job-type with one of them")  # fmt: skip
    evals = [r for r in runs if job_type(r) == "eval"] if with_evals and wanted != "eval" else []
    return chosen, evals


def in_project(runs: list[RunRecord], project: str | None,
               wanted: str) -> tuple[list[RunRecord], str | None]:  # fmt: skip
    """The runs of one W&B project: ``project``, else the one with the most runs of job type
    ``wanted`` (ties: the latest started), so that runs of different experiments (an
    Omniglot grid, the sine demo) never share a table; and, where it chose, a note naming
    the others (printed on stderr).

    Raises:
        UsageError: ``project`` names no project among the runs (naming those there are).
    """
    counts = Counter(r.project for r in runs)
    note = None
    if project is None:
        if len(counts) < 2:
            return runs, None
        latest = {r.project: r.start_time for r in runs}
        wanted_counts = Counter(r.project for r in runs if job_type(r) == wanted)
        project = max(counts, key=lambda p: (wanted_counts[p], latest[p]))
        others = ", ".join(f"{p or '(none)'} ({n})" for p, n in counts.items() if p != project)
        note = (f"comparing project {project} ({counts[project]} runs); also here: {others}; "
                "pass --project to choose")  # fmt: skip
    elif project not in counts:
        there = ", ".join(f"{p or '(none)'} ({n} runs)" for p, n in counts.items())
        raise UsageError(f"--project {project}: no run of that project here (projects: {there})")
    return [r for r in runs if r.project == project], note


def filtered(runs: list[RunRecord], groups: tuple[str, ...],
             tags: tuple[str, ...]) -> list[RunRecord]:  # fmt: skip
    """The runs in one of ``groups`` (all when empty) that carry every one of ``tags``.

    Raises:
        UsageError: no run is left (naming the groups and tags there are).
    """
    kept = [r for r in runs if (not groups or r.group in groups) and set(tags) <= set(r.tags)]
    if not kept:
        found = sorted({str(r.group) for r in runs}), sorted({t for r in runs for t in r.tags})
        raise UsageError(f"no run in group {' or '.join(groups) or 'any'} with tags "
                         f"{', '.join(tags) or 'any'} (groups: {', '.join(found[0])}; tags: "
                         f"{', '.join(found[1]) or 'none'})")  # fmt: skip
    return kept


@quiet_on_closed_stdout
def main(argv: list[str] | None = None) -> int:
    """``metalearn-compare``: print the comparison; a usage error is one line on stderr and
    exit status 2; a reader that leaves ends it quietly, exit status 141."""
    try:
        text = run(argv)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
