"""Environment steps per second of metalearn.rl's 2D navigation sampler.

Rolls out the paper's Gaussian MLP policy (100-100 ReLU) in `metalearn.rl.Navigation2D`
(horizon 100) for K tasks x B episodes, with one parameter set for every task (the
pre-adaptation rollout) and with per-task adapted parameters (the post-adaptation rollout,
the policy under `torch.func.vmap` over tasks); the noise is drawn per episode from its seed
outside the timed rollout, then separately timed. Steps counted: K x B x 100 per rollout.

    .venv/bin/python scripts/bench_rl.py --shapes 40x20 10x20 --repeats 3 --threads 1
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from benchtools import markdown_table, parse_args_as, run_header, usage_error

from metalearn.rl import GaussianMLPPolicy, Navigation2D, derive_seeds, episode_noise, rollout


@dataclass
class Args:
    """The sampler's workloads and how often each is timed."""

    shapes: tuple[str, ...] = ("40x20", "10x20")
    """Workloads as TASKSxEPISODES (K tasks of B episodes each)."""
    repeats: int = 3
    """Timed rollouts per workload (the median is reported)."""
    horizon: int = 100
    """Steps per episode."""
    threads: int = 1
    """Torch CPU threads."""


def parse_shape(text: str) -> tuple[int, int]:
    """``"40x20"`` -> ``(40, 20)``; anything else is refused in one line (exit 2)."""
    tasks, _, episodes = text.partition("x")
    if not (tasks.isdigit() and episodes.isdigit()) or int(tasks) < 1 or int(episodes) < 1:
        usage_error(f"--shapes: a shape is TASKSxEPISODES, e.g. 40x20; got {text!r}")
    return int(tasks), int(episodes)


def parse_args(argv: Sequence[str] | None = None) -> Args:
    args = parse_args_as(Args, argv, __doc__)
    if args.repeats < 1 or args.horizon < 1 or args.threads < 1:
        usage_error("--repeats, --horizon and --threads must be >= 1")
    for shape in args.shapes:
        parse_shape(shape)
    return args


def measure(tasks: int, episodes: int, repeats: int, horizon: int) -> list[str]:
    """One table row: K x B, steps/s shared, steps/s per task, noise draws/s."""
    task = Navigation2D(horizon=horizon)
    torch.manual_seed(0)
    policy = GaussianMLPPolicy(2, 2)
    params = {k: v.detach() for k, v in policy.named_parameters()}
    stacked = {k: v.expand(tasks, *v.shape).clone() for k, v in params.items()}
    goals = task.sample_goals(derive_seeds(0, 0, count=tasks))
    seeds = [derive_seeds(0, k, 0, count=episodes) for k in range(tasks)]
    start = time.perf_counter()
    noise = episode_noise(policy, seeds, horizon, torch.float32)
    noise_s = time.perf_counter() - start
    steps = tasks * episodes * horizon
    rates = {}
    for per_task, p in ((False, params), (True, stacked)):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            rollout(task.make_env(goals, episodes), policy, p, noise, per_task=per_task)
            times.append(time.perf_counter() - start)
        rates[per_task] = steps / statistics.median(times)
    return [f"{tasks}x{episodes}", f"{rates[False]:,.0f}", f"{rates[True]:,.0f}",
            f"{tasks * episodes / noise_s:,.0f}"]  # fmt: skip


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [measure(*parse_shape(s), args.repeats, args.horizon) for s in args.shapes]
    print(run_header())
    header = [
        "tasks x episodes",
        "steps/s (shared)",
        "steps/s (per-task, vmap)",
        "episodes/s (noise)",
    ]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
