"""Environment steps per second of metalearn.rl's 2D navigation sampler.

Rolls out the paper's Gaussian MLP policy (100-100 ReLU) in `metalearn.rl.Navigation2D`
(horizon 100) for K tasks x B episodes, with one parameter set for every task (the
pre-adaptation rollout) and with per-task adapted parameters (the post-adaptation rollout,
the policy under `torch.func.vmap` over tasks); the noise is drawn per episode from its seed
outside the timed rollout, then separately timed. Steps counted: K x B x 100 per rollout.

    .venv/bin/python scripts/bench_rl.py --shapes 40x20 10x20 --repeats 3 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from benchtools import markdown_table, run_header

from metalearn.rl import GaussianMLPPolicy, Navigation2D, derive_seeds, episode_noise, rollout


def parse_shape(text: str) -> tuple[int, int]:
    tasks, _, episodes = text.partition("x")
    if not (tasks.isdigit() and episodes.isdigit()) or int(tasks) < 1 or int(episodes) < 1:
        raise argparse.ArgumentTypeError(f"a shape is TASKSxEPISODES, e.g. 40x20; got {text!r}")
    return int(tasks), int(episodes)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=[(40, 20), (10, 20)])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--horizon", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.repeats < 1 or args.horizon < 1 or args.threads < 1:
        parser.error("--repeats, --horizon and --threads must be >= 1")
    torch.set_num_threads(args.threads)
    rows = [measure(k, b, args.repeats, args.horizon) for k, b in args.shapes]
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
