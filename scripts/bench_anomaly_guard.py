"""The cost of `metalearn.debug.anomaly_guard` on one realistic MAML meta-step.

What: a full meta-step (meta-gradient of 16 tasks + Adam) of Conv4 (112k parameters) on
Omniglot-shaped random data, 5-way 1-shot, 5 query per class, 1 inner step, second order:
the default Omniglot run's meta-batch. Timed plain, under
``anomaly_guard(backward_origin=False)``, under ``anomaly_guard()`` (which also records
where each autograd node was created) and under torch's own
``torch.autograd.detect_anomaly()`` (backward NaN checks only). The four run round-robin
within each repeat (`benchtools.time_round_robin`), after one warm-up each; every ratio is
against the plain step of the same run.

Command::

    .venv/bin/python scripts/bench_anomaly_guard.py --threads 1 --clock cpu --repeats 5
    .venv/bin/python scripts/bench_anomaly_guard.py --threads 1 --clock cpu --repeats 5 \\
        --vectorize loop

Expected: a header line (torch, threads, load average, metalearn commit) and a markdown
table of median ms per meta-step and its ratio to the plain step. Measured numbers, with
their machine and commit: ``docs/deploy.md``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Literal

import torch
from benchtools import markdown_table, parse_args_as, run_header, time_round_robin, usage_error

from metalearn.algorithms import MAML
from metalearn.debug import anomaly_guard
from metalearn.engine import Task
from metalearn.models import Conv4

VARIANTS: dict[str, Callable[[], AbstractContextManager]] = {
    "plain": nullcontext,
    "anomaly_guard(backward_origin=False)": lambda: anomaly_guard(backward_origin=False),
    "anomaly_guard()": anomaly_guard,
    "torch.autograd.detect_anomaly()": torch.autograd.detect_anomaly,
}


def make_step(vectorize: str, tasks: int = 16) -> tuple[Callable[[], None], MAML]:
    """One MAML meta-step on Conv4: ``tasks`` tasks of 5-way 1-shot, 5 query per class
    (support ``[5, 1, 28, 28]``, query ``[25, 1, 28, 28]``), then an Adam update; and the
    learner it updates."""
    torch.manual_seed(0)
    learner = MAML(Conv4(ways=5), inner_lr=0.4, inner_steps=1, vectorize=vectorize)
    opt = torch.optim.Adam(learner.parameters(), lr=1e-3)
    labels = torch.arange(5)
    batch = [
        Task(support=(torch.rand(5, 1, 28, 28), labels),
             query=(torch.rand(25, 1, 28, 28), labels.repeat_interleave(5)))
        for _ in range(tasks)
    ]  # fmt: skip

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        learner.backward(batch)
        opt.step()

    return step, learner


def guarded(
    step: Callable[[], None], context: Callable[[], AbstractContextManager]
) -> Callable[[], None]:
    """``step`` run inside a fresh ``context()``."""

    def run() -> None:
        with context():
            step()

    return run


@dataclass
class Args:
    """Arguments of bench_anomaly_guard.py (each is a --flag; see --help)."""

    repeats: int = 7
    """Timed steps per variant."""
    threads: int = 1
    """Torch CPU threads."""
    clock: Literal["cpu", "wall"] = "cpu"
    """Process CPU time or wall time."""
    vectorize: Literal["auto", "loop", "vmap"] = "auto"
    """How MAML runs the tasks of the meta-batch."""


def parse_args(argv: Sequence[str] | None = None) -> Args:
    a = parse_args_as(Args, argv, __doc__)
    if a.repeats < 1 or a.threads < 1:
        usage_error(f"--repeats {a.repeats}, --threads {a.threads}: both must be at least 1")
    return a


def main(argv: Sequence[str] | None = None) -> dict[str, float]:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    step, _ = make_step(a.vectorize)
    fns = {name: guarded(step, context) for name, context in VARIANTS.items()}
    times = time_round_robin(fns, a.repeats, 1, "cpu", clock, collect=True)
    medians = {name: statistics.median(t) for name, t in times.items()}
    base = medians["plain"]
    print(f"{run_header()}; vectorize={a.vectorize}, {a.clock} clock, median of {a.repeats}\n")
    rows = [[name, f"{m * 1e3:.1f}", f"{m / base:.2f}"] for name, m in medians.items()]
    print(markdown_table(["meta-step run", "median ms", "x plain"], rows))
    return {name: m / base for name, m in medians.items()}


if __name__ == "__main__":
    main()
