"""Trace one meta-step of the default run: the files, lines and frames it runs through.

What: builds the default run of ``experiments/omniglot_maml.py`` (its default preset, as
``python experiments/omniglot_maml.py`` would, on Omniglot from ``--data-root`` or
``$METALEARN_DATA``), takes its first meta-step untraced, then traces the second with
``sys.settrace`` and prints:

* every project file the step executes (``metalearn/``, left out: ``models/``, ``data/``
  and ``__init__.py`` files, as the experiment itself), with its length and the lines of it
  that ran;
* the totals of those files' lengths and executed lines;
* the deepest stack of project frames (the experiment's and metalearn's) from the
  experiment's ``meta_step`` to the inner update (`metalearn.optim.sgd.sgd_update`, MAML's
  Eq. 1: ``p - lr * g``), frame by frame.

Command:
    python scripts/trace_meta_step.py [--data-root DIR] [--preset NAME]
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from metalearn.runs.cli import parse_dataclass
from metalearn.tools.experiments import load_experiment

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "metalearn"
LEFT_OUT = ("models", "data")
UPDATE = "sgd_update"  # the function that computes MAML's inner update p - lr * g


@dataclass
class Args:
    """Arguments of trace_meta_step.py (each is a --flag)."""

    data_root: str | None = None
    """Omniglot's folder (default: $METALEARN_DATA, else the cache)."""
    preset: str | None = None
    """A preset of omniglot_maml.py (default: the experiment's default preset)."""


def counted(path: Path) -> bool:
    """A file the trace counts: metalearn's, outside models/ and data/, no __init__.py."""
    try:
        relative = path.relative_to(PACKAGE)
    except ValueError:
        return False
    return relative.parts[0] not in LEFT_OUT and path.name != "__init__.py"


def project(path: Path) -> bool:
    """A frame of the project (metalearn or an experiment), for the depth."""
    return path.is_relative_to(PACKAGE) or path.is_relative_to(ROOT / "experiments")


class Tracer:
    """Records executed lines per file and the deepest meta_step -> update stack."""

    def __init__(self) -> None:
        self.lines: dict[Path, set[int]] = defaultdict(set)
        self.deepest: list[str] = []

    def __call__(self, frame: FrameType, event: str, arg: Any) -> Any:
        path = Path(frame.f_code.co_filename)
        if counted(path) and event in ("call", "line"):
            self.lines[path].add(frame.f_lineno)
        if event == "call" and frame.f_code.co_name == UPDATE:
            stack = self._stack(frame)
            if len(stack) > len(self.deepest):
                self.deepest = stack
        return self

    @staticmethod
    def _stack(frame: FrameType | None) -> list[str]:
        """Project frames from ``meta_step`` down to ``frame``."""
        names = []
        while frame is not None:
            path = Path(frame.f_code.co_filename)
            if project(path):
                names.append(f"{path.relative_to(ROOT)}:{frame.f_code.co_name}")
            if frame.f_code.co_name == "meta_step":
                return names[::-1]
            frame = frame.f_back
        return []


def main(argv: list[str] | None = None) -> None:
    args = parse_dataclass(Args, argv, description=__doc__.split("\n\n")[0])
    exp = load_experiment("omniglot_maml")
    flags = ["--no-track", "--iterations", "2", "--meta-batch", "16"]
    flags += [] if args.data_root is None else ["--data-root", args.data_root]
    flags += [] if args.preset is None else ["--preset", args.preset]
    parsed = exp.resolve_args(exp.parse_args(flags))
    from metalearn.algorithms.registry import make_learner
    from metalearn.runs.experiment import make_recipe
    from metalearn.runs.outer_loop import build_outer_optimizer
    from metalearn.runs.recipe import build_model
    from metalearn.runs.run import load_samplers

    recipe = make_recipe(exp.EXPERIMENT, parsed)
    torch.manual_seed(0)
    learner = make_learner(recipe.learner.algorithm, build_model(recipe), recipe.learner.arguments)
    opt = build_outer_optimizer(learner, recipe.training)
    sampler = load_samplers(recipe, "cpu")["train"]
    gen = torch.Generator().manual_seed(0)
    exp.meta_step(recipe, learner, opt, sampler, gen, step=0)  # the first step, untraced
    tracer = Tracer()
    sys.settrace(tracer)
    try:
        exp.meta_step(recipe, learner, opt, sampler, gen, step=1)
    finally:
        sys.settrace(None)
    total = executed = 0
    print(f"preset: {parsed.preset}, algorithm: {recipe.learner.algorithm}")
    print("| file | lines | lines run |\n|---|--:|--:|")
    for path in sorted(tracer.lines):
        length = len(path.read_text().splitlines())
        total, executed = total + length, executed + len(tracer.lines[path])
        print(f"| {path.relative_to(ROOT)} | {length} | {len(tracer.lines[path])} |")
    print(f"| **{len(tracer.lines)} files** | **{total}** | **{executed}** |")
    print(f"\nproject frames from meta_step to {UPDATE}: {len(tracer.deepest)}")
    for depth, name in enumerate(tracer.deepest, 1):
        print(f"  {depth:2d}. {name}")


if __name__ == "__main__":
    main()
