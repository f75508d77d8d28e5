"""A seeds x settings grid of either experiment, without a W&B server.

What: runs every combination of the given settings and seeds as a separate process of an
experiment file (``python experiments/<experiment>.py ...``), N at a time, all in one W&B
group. A cell is its whole recipe: the run the cell's command line makes, every flag after
presets and defaults (`metalearn.runs.recipe`), built here before anything launches, without
loading data. Its run folder is named by what differs between the cells, the seed and a hash
of that recipe (`cell_key`), so a cell is done only when a run of exactly that recipe
finished: run the grid again with another flag after ``--`` and its cells are new ones, next
to the old. A cell whose run stopped is resumed; one whose folder holds another recipe is
refused (it would have to be a hash collision, or a folder renamed by hand). At the end it
prints one row per cell and the mean and spread over seeds of each setting.

Command (from the folder that holds experiments/, e.g. a clone of metalearn):
    metalearn-grid --seeds 0 1 2 --set inner_lr=0.1,0.4 --set inner_steps=1,5 \\
        --jobs 2 -- --iterations 500 --wandb-mode offline
    metalearn-grid --experiment fewshot_maml --set backbone=conv4,resnet12 \\
        -- --dataset cifar-fs --data-root DIR
    metalearn-grid --experiment path/to/my_experiment.py --set inner_lr=0.1,0.4
    # flags after "--" go to every cell; logs: <out-dir>/<group>-logs/<cell>.log

The experiment is a file, not an installed module: ``--experiment NAME`` is
``experiments/NAME.py`` under the current folder, anything ending in ``.py`` a path. The grid
reads its ``Args``, ``parse_args`` and ``EXPERIMENT`` by loading the file by its path
(`metalearn.tools.experiments`; nothing is added to ``sys.path``), and runs each cell as ``python
FILE ...``. Ctrl-C stops the cells (each saves a checkpoint) and lists the ones that a rerun
of the same command resumes.

A ``--set`` name is an experiment flag (``inner_lr`` or ``inner-lr``), checked before
anything runs, as is every cell's command line; the grid owns ``seed`` (``--seeds``),
``run_name``, ``out_dir``, ``wandb_group`` and ``resume``.

Expected result: 12 runs under ``runs/`` named ``grid-lr0.1-steps1-seed0-<hash>`` and so
on, a table of test accuracies; ``metalearn-compare runs/wandb`` compares the curves.
"""

from __future__ import annotations

import difflib
import hashlib
import itertools
import json
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import tyro

from metalearn.runs.cli import flag, flat_fields, parse_dataclass, quiet_on_closed_stdout
from metalearn.runs.lifecycle import UserError
from metalearn.tools import experiments

if TYPE_CHECKING:  # imported where used: --help loads no torch
    from metalearn.runs.recipe import Recipe

PROG = "metalearn-grid"
SHORT = {"inner_lr": "lr", "inner_steps": "steps", "outer_lr": "olr", "algorithm": ""}
OWNED = ("seed", "run_name", "out_dir", "wandb_group", "resume")
"""Flags the grid sets for every cell (the seed through --seeds)."""


class GridError(Exception):
    """A mistake in the grid's command line: one line, exit status 2, nothing launched."""


@dataclass
class Args:
    """Arguments of metalearn-grid (each is a --flag; flags after -- go to every cell)."""

    seeds: tuple[int, ...] = (0,)
    """Seeds: every setting runs once per seed."""
    set: tyro.conf.UseAppendAction[tuple[str, ...]] = ()
    """An experiment flag and its values, NAME=V1,V2 (repeat for more)."""
    experiment: str = "omniglot_maml"
    """The experiment each cell runs: NAME (experiments/NAME.py under the current folder:
    omniglot_maml, fewshot_maml) or the path of an experiment file (ending in .py)."""
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


def experiment_file(experiment: str) -> Path:
    """The experiment's file (`metalearn.tools.experiments.experiment_file`).

    Raises:
        GridError: no such file.
    """
    try:
        return experiments.experiment_file(experiment)
    except UserError as err:
        raise GridError(str(err)) from None


def experiment_module(path: Path) -> ModuleType:
    """The experiment file at ``path``, loaded by its path (`load_experiment`).

    Raises:
        GridError: not an experiment file.
    """
    try:
        return experiments.experiment_module(path)
    except UserError as err:
        raise GridError(str(err)) from None


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
            raise GridError(f"--set {key}: {Path(exp.__file__).name} has no flag "
                            f"{flag(key)}{hint}")  # fmt: skip
        settings[key] = values.split(",")
    return settings


def cell_recipe(exp: ModuleType, argv: list[str]) -> Recipe:
    """The recipe the experiment makes of ``argv``, as the run will (no data is loaded).

    Raises:
        UserError: a value the experiment refuses. A command line it cannot parse exits
            with its one-line error and status 2.
    """
    from metalearn.runs import experiment as runs_experiment

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
    for memory_only in ("gradient_checkpointing", "chunk_size"):
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
    exp = experiment_module(experiment_file(args.experiment))
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
    from metalearn.deploy import read_run_checkpoint
    from metalearn.runs.lock import run_holder
    from metalearn.runs.recipe import read_recipe

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
    from metalearn.deploy import read_run_checkpoint

    if status(cell, out_dir) != "done":
        return None
    return read_run_checkpoint(Path(out_dir) / cell.name / "checkpoint.pt")["results"]


def skip_note(cell: Cell, state: str, out_dir: Path) -> str | None:
    """The one line a skipped cell (``"running"`` or ``"damaged"``) prints, else None."""
    from metalearn.runs.lock import describe, run_holder

    folder = out_dir / cell.name
    if state == "running":
        holder = run_holder(folder)
        by = describe(holder) if holder else "a process that has just ended"
        return f"SKIPPED {cell.name}: running now, by {by}; run the grid again when it ends"
    if state == "damaged":
        return (f"SKIPPED {cell.name}: {folder / 'checkpoint.pt'} cannot be read "
                f"({_why_unreadable(folder / 'checkpoint.pt')}); move it away and run the grid "
                "again")  # fmt: skip
    return None


def _why_unreadable(path: Path) -> str:
    """Why `status` found ``path`` damaged: the reader's one line (a record of another format
    names the metalearn version that wrote it, `metalearn.runs.recipe.check_version`)."""
    from metalearn.deploy import read_run_checkpoint
    from metalearn.runs.recipe import read_recipe

    try:
        read_recipe(read_run_checkpoint(path))
    except ValueError as err:
        return str(err)
    return "it was replaced while the grid read it"


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
    codes: dict[str, int] = {name: 2 for name in refused}
    codes |= {c.name: 2 for c in cells if states[c.name] == "damaged"}
    return codes | _run_processes(todo, states, experiment_file(args.experiment), args.jobs, logs)


def _run_processes(todo: list[Cell], states: dict[str, str], experiment: Path, jobs: int,
                   logs: Path) -> dict[str, int]:  # fmt: skip
    """Run ``todo`` as ``python EXPERIMENT ...`` processes, ``jobs`` at a time; their exit
    codes by name. Ctrl-C (KeyboardInterrupt) stops the running cells (`stop_cells`) and
    is raised again."""
    todo, running, codes = list(todo), {}, {}
    try:
        while todo or running:
            while todo and len(running) < jobs:
                cell = todo.pop(0)
                resume = states[cell.name] == "stopped"
                cmd = [sys.executable, str(experiment), *cell.command(resume)]
                with open(logs / f"{cell.name}.log", "a") as log:
                    running[cell.name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
                print(f"start {cell.name}{' (resume)' if resume else ''}", flush=True)
            for name, proc in list(running.items()):
                if proc.poll() is not None:
                    codes[name] = running.pop(name).returncode
                    print(f"{'done ' if codes[name] == 0 else 'FAILED'} {name} "
                          f"(exit {codes[name]})")  # fmt: skip
            time.sleep(0.5)
    except KeyboardInterrupt:
        stop_cells(list(running.values()))
        raise
    return codes


def stop_cells(processes: list[subprocess.Popen]) -> None:
    """Send each running cell SIGINT (a terminal's Ctrl-C reached them already; a signal
    sent to the grid alone did not) and wait while they save their checkpoints; a second
    Ctrl-C stops the wait and kills them (each resumes from its last checkpoint)."""
    for proc in processes:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    print(f"stopping {len(processes)} running cell(s): each saves a checkpoint "
          "(Ctrl-C again to kill them)", flush=True)  # fmt: skip
    try:
        for proc in processes:
            proc.wait()
    except KeyboardInterrupt:
        for proc in processes:
            proc.kill()
            proc.wait()


def resumable_note(cells: list[Cell], out_dir: str, argv: list[str]) -> str:
    """What a stopped grid prints: each cell not finished, and the command that resumes it."""
    lines = []
    for cell in cells:
        state = status(cell, out_dir)
        if state in ("stopped", "new"):
            what = "resumes from its checkpoint" if state == "stopped" else "starts over"
            lines.append(f"  {cell.name} ({what})")
    if not lines:
        return "stopped; every cell had finished"
    rerun = shlex.join([PROG, *argv])
    return "\n".join([f"stopped; {len(lines)} cell(s) to run, resumed by running the same "
                      f"command again:\n  {rerun}", *lines])  # fmt: skip


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
    if not args.seeds:
        raise GridError("--seeds names no seed: give at least one (--seeds 0 1 2), or drop "
                        "--seeds for seed 0")  # fmt: skip
    if len(set(args.seeds)) < len(args.seeds):
        twice = ", ".join(map(str, sorted({s for s in args.seeds if args.seeds.count(s) > 1})))
        raise GridError(f"--seeds {' '.join(map(str, args.seeds))}: seed {twice} is given "
                        "twice (one run each); give each seed once")  # fmt: skip
    exp = experiment_module(experiment_file(args.experiment))
    for item in extra:
        name = item.split("=", 1)[0].removeprefix("--").replace("-", "_")
        if item.startswith("--") and name in OWNED:
            raise GridError(f"{item} after --: the grid sets {flag(name)} for every cell"
                            f"{' (give --seeds)' if name == 'seed' else ''}")  # fmt: skip
    settings = parse_settings(args.set, exp)
    return args, make_cells(settings, args.seeds, args, extra)


@quiet_on_closed_stdout
def main(argv: list[str] | None = None) -> int:
    """``metalearn-grid``: plan, run and summarise the grid; a mistake in its command line is
    one line on stderr and exit status 2, Ctrl-C lists the cells a rerun resumes (status
    130)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args, cells = plan(argv)
    except GridError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # while the cells' recipes were built: nothing ran
        print("stopped before any cell started")
        return 128 + signal.SIGINT
    try:
        codes = run_all(cells, args)
    except KeyboardInterrupt:
        print(resumable_note(cells, args.out_dir, argv))
        return 128 + signal.SIGINT
    print(summary(cells, args.out_dir))
    failed = [name for name, code in codes.items() if code != 0]
    if failed:
        print(f"{len(failed)} failed; their logs are in {args.out_dir}/{args.group}-logs/")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
