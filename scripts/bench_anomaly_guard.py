"""The cost of `metalearn.debug.anomaly_guard` on one realistic MAML meta-step.

What: a full meta-step (meta-gradient of 16 tasks + Adam) of conv4 (112k parameters) on
Omniglot-shaped random data, 5-way 1-shot, 5 query per class, 1 inner step, second order:
the default Omniglot run's step. Timed plain, under ``anomaly_guard(backward_origin=False)``,
under ``anomaly_guard()`` (which also records where each autograd node was created) and
under torch's own ``torch.autograd.detect_anomaly()`` (backward NaN checks only), the four
interleaved, median of ``--repeats`` after one warm-up each. Prints each one's ratio to the
plain step measured in the same run.

Command:
    python scripts/bench_anomaly_guard.py --threads 1 --clock cpu

Measured (torch 2.13 CPU, shared 2-core machine, 1 thread, CPU time): see docs/deploy.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from metalearn.algorithms import MAML
from metalearn.debug import anomaly_guard
from metalearn.models import Conv4
from metalearn.outer import Task


def make_step(vectorize: str) -> Callable[[], None]:
    """One meta-step of MAML on conv4, 16 tasks of 5-way 1-shot with 5 query per class."""
    torch.manual_seed(0)
    learner = MAML(Conv4(ways=5), inner_lr=0.4, inner_steps=1, vectorize=vectorize)
    opt = torch.optim.Adam(learner.parameters(), lr=1e-3)
    labels = torch.arange(5)
    tasks = [
        Task(support=(torch.rand(5, 1, 28, 28), labels),
             query=(torch.rand(25, 1, 28, 28), labels.repeat_interleave(5)))
        for _ in range(16)
    ]  # fmt: skip

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        learner.backward(tasks)
        opt.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per variant")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--clock", choices=["cpu", "wall"], default="cpu", help="cpu: process CPU time; wall"
    )
    parser.add_argument(
        "--vectorize", choices=["auto", "loop", "vmap"], default="auto", help="meta-batch path"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    step = make_step(args.vectorize)
    variants: dict[str, Callable[[], AbstractContextManager]] = {
        "plain": nullcontext,
        "anomaly_guard(backward_origin=False)": lambda: anomaly_guard(backward_origin=False),
        "anomaly_guard()": anomaly_guard,
        "torch.autograd.detect_anomaly()": torch.autograd.detect_anomaly,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for context in variants.values():  # warm-up
        with context():
            step()
    for _ in range(args.repeats):
        for name, context in variants.items():
            start = clock()
            with context():
                step()
            times[name].append(clock() - start)
    base = statistics.median(times["plain"])
    print(f"meta-step, {args.clock} time, {args.threads} thread(s), median of {args.repeats}:")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"  {name:40s} {median * 1e3:8.1f} ms  {median / base:5.2f}x plain")


if __name__ == "__main__":
    main()
