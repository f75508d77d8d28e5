"""A seeds x settings grid of either experiment, without a W&B server.

What: runs every combination of the given settings and seeds as a separate process of
``experiments/<experiment>.py``, N at a time, all in one W&B group. A cell is its whole
recipe: the run the cell's command line makes, every flag after presets and defaults
(`metalearn.runs.recipe`), built here before anything launches, without loading data. Its
run folder is named by what differs between the cells, the seed and a hash of that recipe
(`cell_key`), so a cell is done only when a run of exactly that recipe finished: run the
grid again with another flag after ``--`` and its cells are new ones, next to the old. A
cell whose run stopped is resumed; one whose folder holds another recipe is refused (it
would have to be a hash collision, or a folder renamed by hand). At the end it prints one
row per cell and the mean and spread over seeds of each setting.

Command:
    python scripts/grid.py --seeds 0 1 2 --set inner_lr=0.1,0.4 --set inner_steps=1,5 \\
        --jobs 2 -- --iterations 500 --wandb-mode offline
    python scripts/grid.py --experiment fewshot_maml --set backbone=conv4,resnet12 \\
        -- --dataset cifar-fs --data-root DIR
    # flags after "--" go to every cell; logs: <out-dir>/<group>-logs/<cell>.log

A ``--set`` name is an experiment flag (``inner_lr`` or ``inner-lr``), checked before
anything runs, as is every cell's command line; the grid owns ``seed`` (``--seeds``),
``run_name``, ``out_dir``, ``wandb_group`` and ``resume``.

Expected result: 12 runs under ``runs/`` named ``grid-lr0.1-steps1-seed0-<hash>`` and so
on, a table of test accuracies; ``scripts/compare_runs.py runs/wandb`` compares the curves.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import itertools
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Literal

import tyro

from metalearn.deploy import read_run_checkpoint
from metalearn.runs import experiment as runs_experiment
from metalearn.runs.cli import flag, flat_fields, parse_dataclass
from metalearn.runs.lifecycle import UserError
from metalearn.runs.lock import describe, run_holder
from metalearn.runs.recipe import Recipe, read_recipe

ROOT = Path(__file__).resolve().parents[1]
SHORT = {"inner_lr": "lr", "inner_steps": "steps", "outer_lr": "olr", "algorithm": ""}
OWNED = ("seed", "run_name", "out_dir", "wandb_group", "resume")
"""Flags the grid sets for every cell (the seed through --seeds)."""


class GridError(Exception):
    """A mistake in the grid's command line: one line, exit status 2, nothing launched."""


@dataclass
class Args:
    """Arguments of grid.py (each is a --flag; flags after -- go to every cell)."""

    seeds: tuple[int, ...] = (0,)
    """Seeds: every setting runs once per seed."""
    set: tyro.conf.UseAppendAction[tuple[str, ...]] = ()
    """An experiment flag and its values, NAME=V1,V2 (repeat for more)."""
    experiment: Literal["omniglot_maml", "fewshot_maml"] = "omniglot_maml"
    """The experiment each cell runs (experiments/<experiment>.py)."""
    jobs: int = 1
    """Processes at a time."""
    group: str = "grid"
    """W&B group and the cells' run-name prefix."""
    out_dir: str = "runs"
    """Where the runs go."""


@dataclass
class Cell:
    """One run of the grid: its settings, seed, recipe and name."""

    settings: dict[str, str]
    seed: int
    argv: list[str]
    """The cell's command line, less its name (what its recipe is made from)."""
    key: str
    """`cell_key` of the cell's recipe."""
    name: str

    def command(self, resume: bool) -> list[str]:
        """The cell's flags: its command line, its name, ``--resume`` when it stopped."""
        return [*self.argv, f"--run-name={self.name}", *(["--resume"] if resume else [])]


@cache
def experiment_module(name: str) -> ModuleType:
    """``experiments/<name>.py``, imported (as the module ``name``)."""
    folder = str(ROOT / "experiments")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(name)


def parse_settings(items: tuple[str, ...] | list[str], exp: ModuleType) -> dict[str, list[str]]:
    """``["inner_lr=0.1,0.4", ...]`` as ``{"inner_lr": ["0.1", "0.4"]}``, every name a flag
    of the experiment (``inner-lr`` is ``inner_lr``).

    Raises:
        GridError: a malformed item, a name the experiment has no flag for, or one the grid
            sets itself.
    """
    names = list(flat_fields(exp.Args))
    settings = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.replace("-", "_")
        if not sep or not key.isidentifier() or not all(values.split(",")):
            raise GridError(f"--set {item}: write NAME=V1,V2 (e.g. inner_lr=0.1,0.4)")
        if key in OWNED:
            raise GridError(f"--set {key}: the grid sets {flag(key)} for every cell"
                            f"{' (give --seeds)' if key == 'seed' else ''}")  # fmt: skip
        if key not in names:
            close = difflib.get_close_matches(key, names, n=2)
            hint = f"; did you mean {' or '.join(close)}?" if close else "; see its --help"
            raise GridError(f"--set {key}: experiments/{exp.EXPERIMENT.name}.py has no flag "
                            f"{flag(key)}{hint}")  # fmt: skip
        settings[key] = values.split(",")
    return settings


def cell_recipe(exp: ModuleType, argv: list[str]) -> Recipe:
    """The recipe the experiment makes of ``argv``, as the run will (no data is loaded).

    Raises:
        UserError: a value the experiment refuses. A command line it cannot parse exits
            with its one-line error and status 2.
    """
    args = exp.parse_args(argv)
    return runs_experiment.make_recipe(exp.EXPERIMENT, exp.resolve_args(args))


def cell_key(recipe: Recipe) -> str:
    """8 hex digits of the SHA-256 of the recipe: the cell's identity.

    Left out are the recipe's parts a run may change on resume without changing its
    numbers (`metalearn.runs.recipe.with_resumed`): where the data lives, how often it
    checkpoints, and the learner's memory settings (gradient checkpointing, chunk size).
    """
    record = recipe.to_dict()
    record["data"].pop("root")
    record["training"].pop("checkpoint_every")
    for memory_only in ("checkpoint", "chunk_size"):
        record["learner"]["arguments"].pop(memory_only, None)
    text = json.dumps(record, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def make_cells(settings: dict[str, list[str]], seeds: tuple[int, ...] | list[int],
               args: Args, extra: list[str]) -> list[Cell]:  # fmt: skip
    """Every combination with every seed, each named by the varied settings (a lone value
    is not in the name), its seed and its recipe's key.

    Raises:
        GridError: a cell's command line the experiment refuses (named).
    """
    exp = experiment_module(args.experiment)
    varied = [k for k, v in settings.items() if len(v) > 1]
    cells = []
    for combo in itertools.product(*settings.values()):
        chosen = dict(zip(settings, combo))
        for seed in seeds:
            argv = [*(f"--{k}={v}" for k, v in chosen.items()), f"--seed={seed}",
                    f"--out-dir={args.out_dir}", f"--wandb-group={args.group}", *extra]  # fmt: skip
            try:
                key = cell_key(cell_recipe(exp, argv))
            except UserError as err:
                setting = ", ".join(f"{k}={v}" for k, v in chosen.items()) or "defaults"
                raise GridError(f"cell {setting}, seed {seed}: {err}") from None
            parts = [f"{SHORT.get(k, k)}{chosen[k]}" for k in varied]
            name = "-".join([args.group, *parts, f"seed{seed}", key])
            cells.append(Cell(chosen, seed, argv, key, name))
    return cells


def status(cell: Cell, out_dir: str) -> str:
    """What the cell's run folder holds: ``"new"`` (no checkpoint), ``"done"`` (a finished
    run of the cell's recipe), ``"stopped"`` (an unfinished one: resume it), ``"differs"``
    (a run of another recipe under the cell's name: refused), ``"running"`` (a live process
    holds its run lock: skipped) or ``"damaged"`` (an unreadable checkpoint: skipped)."""
    path = Path(out_dir) / cell.name / "checkpoint.pt"
    if run_holder(path.parent) is not None:
        return "running"
    if not path.is_file():
        return "new"
    try:
        saved = read_run_checkpoint(path)
        key = cell_key(read_recipe(saved))
    except ValueError:  # truncated, empty, or not a run's checkpoint
        return "damaged"
    if key != cell.key:
        return "differs"
    return "done" if saved.get("results") else "stopped"


def results(cell: Cell, out_dir: str) -> dict[str, float] | None:
    """The test results of the cell's finished run, or None."""
    if status(cell, out_dir) != "done":
        return None
    return read_run_checkpoint(Path(out_dir) / cell.name / "checkpoint.pt")["results"]


def skip_note(cell: Cell, state: str, out_dir: Path) -> str | None:
    """The one line a skipped cell (``"running"`` or ``"damaged"``) prints, else None."""
    folder = out_dir / cell.name
    if state == "running":
        holder = run_holder(folder)
        by = describe(holder) if holder else "a process that has just ended"
        return f"SKIPPED {cell.name}: running now, by {by}; run the grid again when it ends"
    if state == "damaged":
        return (f"SKIPPED {cell.name}: {folder / 'checkpoint.pt'} cannot be read (truncated, "
                "empty or not a run's); move it away and run the grid again")  # fmt: skip
    return None


def run_all(cells: list[Cell], args: Args) -> dict[str, int]:
    """Run the cells that are not done, ``args.jobs`` at a time; returns exit codes by name."""
    logs = Path(args.out_dir) / f"{args.group}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    states = {c.name: status(c, args.out_dir) for c in cells}
    todo = [c for c in cells if states[c.name] in ("new", "stopped")]
    refused = [c.name for c in cells if states[c.name] == "differs"]
    done = sum(s == "done" for s in states.values())
    print(f"{len(cells)} cells, {done} done, {len(todo)} to run"
          + (f", {len(refused)} refused" if refused else ""))  # fmt: skip
    for name in refused:
        print(f"REFUSED {name}: its folder holds a run of another recipe; move it away")
    for cell in cells:
        note = skip_note(cell, states[cell.name], Path(args.out_dir))
        if note:
            print(note)
    experiment = ROOT / "experiments" / f"{args.experiment}.py"
    running: dict[str, subprocess.Popen] = {}
    codes: dict[str, int] = {name: 2 for name in refused}
    codes |= {c.name: 2 for c in cells if states[c.name] == "damaged"}
    while todo or running:
        while todo and len(running) < args.jobs:
            cell = todo.pop(0)
            resume = states[cell.name] == "stopped"
            cmd = [sys.executable, str(experiment), *cell.command(resume)]
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
        found = results(cell, out_dir)
        if found:
            rows.append(f"| {cell.name} | {found['test/acc']:.4f} ± {found['test/acc_ci95']:.4f} |")
            key = ", ".join(f"{k}={v}" for k, v in cell.settings.items()) or "(defaults)"
            by_setting.setdefault(key, []).append(found["test/acc"])
        else:
            rows.append(f"| {cell.name} | not finished |")
    rows += ["", "| setting | seeds | mean test/acc | std |", "|---|---|---|---|"]
    for key, accs in by_setting.items():
        std = statistics.stdev(accs) if len(accs) > 1 else float("nan")
        rows.append(f"| {key} | {len(accs)} | {statistics.mean(accs):.4f} | {std:.4f} |")
    return "\n".join(rows)


def plan(argv: list[str]) -> tuple[Args, list[Cell]]:
    """The grid's arguments and its cells, everything checked; nothing is written.

    Raises:
        GridError: a bad grid flag, ``--set`` or cell command line.
    """
    own, extra = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv \
        else (argv, [])  # fmt: skip
    args = parse_dataclass(Args, own, description=__doc__.split("\n\n")[0])
    if args.jobs < 1:
        raise GridError(f"--jobs {args.jobs}: must be at least 1")
    exp = experiment_module(args.experiment)
    for item in extra:
        name = item.split("=", 1)[0].removeprefix("--").replace("-", "_")
        if item.startswith("--") and name in OWNED:
            raise GridError(f"{item} after --: the grid sets {flag(name)} for every cell"
                            f"{' (give --seeds)' if name == 'seed' else ''}")  # fmt: skip
    settings = parse_settings(args.set, exp)
    return args, make_cells(settings, args.seeds, args, extra)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args, cells = plan(argv)
    except GridError as err:
        print(f"grid.py: error: {err}", file=sys.stderr)
        return 2
    codes = run_all(cells, args)
    print(summary(cells, args.out_dir))
    failed = [name for name, code in codes.items() if code != 0]
    if failed:
        print(f"{len(failed)} failed; their logs are in {args.out_dir}/{args.group}-logs/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
