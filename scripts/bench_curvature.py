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

import argparse
import statistics
import sys
from pathlib import Path

import torch
from benchtools import markdown_table

from metalearn.algorithms.curvature import PROBE_SEED
from metalearn.data import load_omniglot, omniglot_samplers
from metalearn.runs.arguments import ExperimentArgs
from metalearn.runs.cli import flatten, replace_flat
from metalearn.runs.metrics import measure_curvature
from metalearn.runs.recipe import build_learner, recipe_from_args, resolve_learner_args

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import omniglot_maml as experiment  # noqa: E402  (the experiment's own meta-step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-root", default=None, help="Omniglot (default: $METALEARN_DATA)")
    p.add_argument("--every", type=int, default=100, help="N of --curvature-every")
    p.add_argument("--probe-tasks", type=int, default=4, help="tasks of the probe batch")
    p.add_argument("--steps", type=int, default=10, help="timed meta-steps on each side")
    p.add_argument("--repeats", type=int, default=3, help="timed curvature measurements")
    p.add_argument("--meta-batch", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    if min(a.every, a.probe_tasks, a.steps, a.repeats, a.meta_batch, a.hidden, a.threads) < 1:
        p.error("every count must be at least 1")
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
