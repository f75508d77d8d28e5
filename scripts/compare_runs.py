"""Compare tracked runs: a table of what differs and how they ended, and overlaid curves.

Usage:
    python scripts/compare_runs.py runs/wandb                       # every offline run there
    python scripts/compare_runs.py RUN_DIR RUN_DIR --metrics val/acc train/loss
    python scripts/compare_runs.py my-entity/metalearn --filter config.algorithm=maml

Offline runs are read with wandb's own ``wandb leet inspect --json`` (wandb >= 0.31);
``entity/project`` reads online runs with ``wandb.Api()``. For an interactive look, open the
same folder with ``wandb leet runs/wandb`` and select the runs to overlay their charts.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from metalearn.tracking import RunRecord, read_offline_run, read_online_runs


def find_run_dirs(path: Path) -> list[Path]:
    """Run directories under ``path``: itself if it is one, else its ``*run-*`` children."""
    if list(path.glob("*.wandb")):
        return [path]
    base = path / "wandb" if (path / "wandb").is_dir() else path
    return sorted(p for p in base.glob("*run-*") if p.is_dir() and list(p.glob("*.wandb")))


def load(sources: list[str], filters: dict[str, Any]) -> list[RunRecord]:
    """Runs from offline directories or ``entity/project`` paths."""
    runs: list[RunRecord] = []
    for src in sources:
        path = Path(src)
        if path.exists():
            dirs = find_run_dirs(path)
            if not dirs:
                raise FileNotFoundError(f"no W&B runs under {path} (looked for */run-*.wandb)")
            # Directory names sort by second only; the recorded start time breaks ties.
            runs.extend(sorted((read_offline_run(d) for d in dirs), key=lambda r: r.start_time))
        elif src.count("/") == 1:
            runs.extend(read_online_runs(src, filters))
        else:
            raise FileNotFoundError(
                f"{src!r} is neither a run directory nor entity/project; pass a wandb/ folder, "
                "a wandb/offline-run-* folder or entity/project"
            )
    return runs


def differing_keys(runs: list[RunRecord]) -> list[str]:
    """Config keys whose values are not the same across all runs."""
    keys = sorted({k for r in runs for k in r.config})
    return [k for k in keys if len({repr(r.config.get(k)) for r in runs}) > 1]


def best(values: list[float], metric: str) -> float:
    """Best value of a metric: max for accuracies, min otherwise."""
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not finite:
        return float("nan")
    return max(finite) if "acc" in metric else min(finite)


def table(runs: list[RunRecord], metrics: list[str]) -> str:
    """A markdown table: name, differing config, then final and best of each metric."""
    keys = differing_keys(runs)
    head = ["run", "state", *keys]
    for m in metrics:
        head += [f"{m} (final)", f"{m} (best)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        cells = [r.name, r.state, *(_fmt(r.config.get(k)) for k in keys)]
        for m in metrics:
            _, values = r.series(m)
            final = r.summary.get(m, values[-1] if values else None)
            cells += [_fmt(final), _fmt(best(values, m) if values else r.summary.get(m))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def plot(runs: list[RunRecord], metrics: list[str], out: Path) -> Path | None:
    """One panel per metric, every run's curve overlaid; None if nothing was logged."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [m for m in metrics if any(r.series(m)[1] for r in runs)]
    if not metrics:
        return None
    fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 3.5), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        for r in runs:
            steps, values = r.series(m)
            if values:
                ax.plot(steps, values, label=r.name)
        ax.set(title=m, xlabel="step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def default_metrics(runs: list[RunRecord]) -> list[str]:
    """The namespaced scalar metrics the runs logged (train/, val/, test/), up to four."""
    keys = sorted({k for r in runs for row in r.history for k in row if "/" in k})
    return keys[:4]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="+", help="run dirs, wandb/ dirs, or entity/project")
    parser.add_argument("--metrics", nargs="*", help="metrics to compare (default: logged ones)")
    parser.add_argument("--filter", action="append", default=[], help="online: key=value")
    parser.add_argument("--out", default="runs/compare.png", help="where to write the plot")
    args = parser.parse_args(argv)
    filters = dict(f.split("=", 1) for f in args.filter)
    runs = load(args.sources, filters)
    metrics = args.metrics or default_metrics(runs)
    text = table(runs, metrics)
    print(text)
    png = plot(runs, metrics, Path(args.out))
    print(f"\nplot: {png}" if png else "\nno metric history to plot")
    return text


if __name__ == "__main__":
    main()
