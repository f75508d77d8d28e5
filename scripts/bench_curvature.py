"""Cost of ``--curvature-every N``: one curvature measurement against N meta-steps.

The experiments' curvature tracking (`metalearn.runs.metrics.measure_curvature`: Lanczos on the
support losses and on the second-order meta-loss, Hutchinson's trace) runs every N meta-steps
on a fixed probe batch. This times it against the meta-step it rides on, on the default
Omniglot workload (MAML, conv4, 5-way 1-shot, 5 query per class, meta-batch 16), in one
process: meta-steps, then measurements, then meta-steps again, so drift hits both.

Command:
    .venv/bin/python scripts/bench_curvature.py --data-root ../shared/data/omniglot
    .venv/bin/python scripts/bench_curvature.py --every 500 --threads 2

Expected output: a markdown table of median seconds, and as the last line
``curvature_fraction: F``, the measurement's share of training time at ``--every``
(``measurement_s / (every * step_s)``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from benchtools import markdown_table, parse_args_as, usage_error

from metalearn.algorithms.curvature import PROBE_SEED
from metalearn.data import load_omniglot, omniglot_samplers
from metalearn.runs.arguments import ExperimentArgs
from metalearn.runs.cli import flatten, replace_flat
from metalearn.runs.metrics import measure_curvature
from metalearn.runs.recipe import build_learner, recipe_from_args, resolve_learner_args
from metalearn.tools.experiments import load_experiment

# The experiment's own meta-step, from the experiment file beside scripts/.
experiment = load_experiment("omniglot_maml", Path(__file__).resolve().parents[1])


@dataclass
class Args:
    """Arguments of bench_curvature.py (each is a --flag; see --help)."""

    data_root: str | None = None
    """Omniglot's folder (default: $METALEARN_DATA)."""
    every: int = 100
    """N of the experiments' --curvature-every: meta-steps per curvature measurement."""
    probe_tasks: int = 4
    """Tasks of the probe batch."""
    steps: int = 10
    """Timed meta-steps on each side of the measurements."""
    repeats: int = 3
    """Timed curvature measurements."""
    meta_batch: int = 16
    """Tasks per meta-step."""
    hidden: int = 64
    """Conv4's channels."""
    threads: int = 1
    """Torch CPU threads."""


def parse_args(argv: Sequence[str] | None = None) -> Args:
    a = parse_args_as(Args, argv, __doc__)
    if min(a.every, a.probe_tasks, a.steps, a.repeats, a.meta_batch, a.hidden, a.threads) < 1:
        usage_error("every count must be at least 1")
    return a


def main(argv: Sequence[str] | None = None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    sampler = omniglot_samplers(load_omniglot(a.data_root), ways=5, shots=1, queries=5)["train"]
    run = replace_flat(ExperimentArgs(), algorithm="maml", hidden=a.hidden, meta_batch=a.meta_batch)
    recipe = recipe_from_args("omniglot_maml", resolve_learner_args(flatten(run)))
    learner = build_learner(recipe)
    opt = learner.outer_optimizer(recipe.training.outer_lr)
    gen = torch.Generator().manual_seed(0)
    probe = sampler.batch(a.probe_tasks, torch.Generator().manual_seed(PROBE_SEED))

    def steps(n: int) -> list[float]:
        return [experiment.meta_step(recipe, learner, opt, sampler, gen)["perf/step_s"]
                for _ in range(n)]  # fmt: skip

    steps(2)  # warm-up
    step_s = steps(a.steps)
    curv_s = [measure_curvature(learner, probe)["perf/curvature_s"]
              for _ in range(a.repeats)]  # fmt: skip
    step_s += steps(a.steps)
    step, curv = statistics.median(step_s), statistics.median(curv_s)
    print(f"threads {a.threads}, meta-batch {a.meta_batch}, probe tasks {a.probe_tasks}\n")
    print(markdown_table(
        ["what", "median s", "min s", "max s", "n"],
        [["meta-step", f"{step:.3f}", f"{min(step_s):.3f}", f"{max(step_s):.3f}", str(len(step_s))],
         ["curvature measurement", f"{curv:.2f}", f"{min(curv_s):.2f}", f"{max(curv_s):.2f}",
          str(len(curv_s))]],
    ))  # fmt: skip
    print(f"\ncurvature_fraction: {curv / (a.every * step):.4f}")


if __name__ == "__main__":
    main()
