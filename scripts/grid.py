"""A seeds x settings grid of the Omniglot experiment, without a W&B server.

What: runs every combination of the given settings and seeds as a separate process of
``experiments/omniglot_maml.py``, N at a time, each named by what differs between the cells
and all in one W&B group; a cell whose checkpoint holds test results is skipped, one with an
unfinished checkpoint is resumed, so the same command continues a stopped grid. At the end
it prints one row per cell and the mean and spread over seeds of each setting.

Command:
    python scripts/grid.py --seeds 0 1 2 --set inner_lr=0.1,0.4 --set inner_steps=1,5 \\
        --jobs 2 -- --iterations 500 --wandb-mode offline
    # flags after "--" go to every cell; logs: <out-dir>/<group>-logs/<cell>.log

Expected result: 12 runs under ``runs/`` named ``grid-lr0.1-steps1-seed0`` and so on, a
table of test accuracies; ``scripts/compare_runs.py runs/wandb`` compares the curves.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENT = ROOT / "experiments" / "omniglot_maml.py"
SHORT = {"inner_lr": "lr", "inner_steps": "steps", "outer_lr": "olr", "algorithm": ""}


@dataclass
class Cell:
    """One run of the grid: its settings, seed and name."""

    settings: dict[str, str]
    seed: int
    name: str

    def flags(self, out_dir: str, group: str) -> list[str]:
        values = [f"--{k}={v}" for k, v in self.settings.items()]
        return [*values, f"--seed={self.seed}", f"--run-name={self.name}",
                f"--out-dir={out_dir}", f"--wandb-group={group}"]  # fmt: skip


def parse_settings(items: list[str]) -> dict[str, list[str]]:
    """``["inner_lr=0.1,0.4", ...]`` as ``{"inner_lr": ["0.1", "0.4"]}``."""
    settings = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key.isidentifier() or not all(values.split(",")):
            raise SystemExit(
                f"grid.py: error: --set {item}: write NAME=V1,V2 (e.g. inner_lr=0.1,0.4)"
            )
        settings[key] = values.split(",")
    return settings


def make_cells(settings: dict[str, list[str]], seeds: list[int], group: str) -> list[Cell]:
    """Every combination, named by the varied settings (a lone value is not in the name)."""
    varied = [k for k, v in settings.items() if len(v) > 1]
    cells = []
    for combo in itertools.product(*settings.values()):
        chosen = dict(zip(settings, combo))
        for seed in seeds:
            parts = [f"{SHORT.get(k, k)}{chosen[k]}" for k in varied]
            cells.append(Cell(chosen, seed, "-".join([group, *parts, f"seed{seed}"])))
    return cells


def status(cell: Cell, out_dir: str) -> str:
    """``"done"`` (test results saved), ``"stopped"`` (a checkpoint to resume) or ``"new"``."""
    path = Path(out_dir) / cell.name / "checkpoint.pt"
    if not path.is_file():
        return "new"
    saved = torch.load(path, map_location="cpu", weights_only=True)
    return "done" if saved.get("results") else "stopped"


def run_all(cells: list[Cell], args: argparse.Namespace, extra: list[str]) -> dict[str, int]:
    """Run the cells that are not done, ``args.jobs`` at a time; returns exit codes by name."""
    logs = Path(args.out_dir) / f"{args.group}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    todo = [c for c in cells if status(c, args.out_dir) != "done"]
    print(f"{len(cells)} cells, {len(cells) - len(todo)} done, {len(todo)} to run")
    running: dict[str, subprocess.Popen] = {}
    codes: dict[str, int] = {}
    while todo or running:
        while todo and len(running) < args.jobs:
            cell = todo.pop(0)
            resume = ["--resume"] if status(cell, args.out_dir) == "stopped" else []
            cmd = [sys.executable, str(EXPERIMENT), *cell.flags(args.out_dir, args.group),
                   *resume, *extra]  # fmt: skip
            with open(logs / f"{cell.name}.log", "a") as log:
                running[cell.name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            print(f"start {cell.name}{' (resume)' if resume else ''}", flush=True)
        for name, proc in list(running.items()):
            if proc.poll() is not None:
                codes[name] = running.pop(name).returncode
                print(f"{'done ' if codes[name] == 0 else 'FAILED'} {name} (exit {codes[name]})")
        time.sleep(0.5)
    return codes


def summary(cells: list[Cell], out_dir: str) -> str:
    """A table: each cell's test accuracy, then each setting's mean and spread over seeds."""
    rows, by_setting = ["| run | test/acc |", "|---|---|"], {}
    for cell in cells:
        path = Path(out_dir) / cell.name / "checkpoint.pt"
        results = None
        if path.is_file():
            results = torch.load(path, map_location="cpu", weights_only=True).get("results")
        if results:
            rows.append(
                f"| {cell.name} | {results['test/acc']:.4f} ± {results['test/acc_ci95']:.4f} |"
            )
            key = ", ".join(f"{k}={v}" for k, v in cell.settings.items()) or "(defaults)"
            by_setting.setdefault(key, []).append(results["test/acc"])
        else:
            rows.append(f"| {cell.name} | not finished |")
    rows += ["", "| setting | seeds | mean test/acc | std |", "|---|---|---|---|"]
    for key, accs in by_setting.items():
        std = statistics.stdev(accs) if len(accs) > 1 else float("nan")
        rows.append(f"| {key} | {len(accs)} | {statistics.mean(accs):.4f} | {std:.4f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seeds (default: 0)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=V1,V2",
                        help="an experiment flag and its values (repeat for more)")  # fmt: skip
    parser.add_argument("--jobs", type=int, default=1, help="processes at a time (default: 1)")
    parser.add_argument("--group", default="grid", help="W&B group and run-name prefix")
    parser.add_argument("--out-dir", default="runs", help="where the runs go (default: runs)")
    args = parser.parse_args(own)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: must be at least 1")
    cells = make_cells(parse_settings(args.set), args.seeds, args.group)
    codes = run_all(cells, args, extra)
    print(summary(cells, args.out_dir))
    failed = [name for name, code in codes.items() if code != 0]
    if failed:
        print(f"{len(failed)} failed; their logs are in {args.out_dir}/{args.group}-logs/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
