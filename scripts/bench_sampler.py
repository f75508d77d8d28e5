"""Benchmark Omniglot loading and episodic sampling.

Measures (1) the first load, decoding every PNG into a fresh cache, in a process pool and
in this process, (2) the cached load, and (3) tasks per second of `EpisodicSampler` for
common N-way K-shot settings, sampling meta-batches of ``--tasks`` tasks.

    .venv/bin/python scripts/bench_sampler.py --data-root ../shared/data/omniglot

Expected on 2 shared CPU cores: first load 5-12 s, cached load about 0.5 s, and thousands
of tasks per second (a meta-batch of 32 tasks in a few ms, against hundreds of ms for a
MAML meta-step), so sampling is never the bottleneck.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from benchtools import parse_args_as, usage_error

from metalearn.data import EpisodicSampler, load_omniglot, omniglot_samplers

SETTINGS = [(5, 1, 15), (5, 5, 15), (20, 1, 5), (20, 5, 15)]  # (ways, shots, queries)


def time_loads(data_root: str | None, workers: list[int | None]) -> None:
    """Print first-load (cold cache) and cached-load times."""
    for worker_count in workers:
        with tempfile.TemporaryDirectory() as cache:
            start = time.perf_counter()
            load_omniglot(data_root, cache_dir=cache, workers=worker_count, progress=False)
            first = time.perf_counter() - start
            start = time.perf_counter()
            load_omniglot(data_root, cache_dir=cache, progress=False)
            cached = time.perf_counter() - start
        label = "auto" if worker_count is None else worker_count
        print(f"load workers={label}: first {first:.2f} s, cached {cached:.2f} s")


def make_sampler(data, split: str, ways: int, shots: int, queries: int, device: str):
    """The train-set sampler, on real data or (``data=None``) on random Omniglot-shaped data."""
    if data is None:  # 1100 characters x 4 rotations, as MAML's train split
        images = torch.randint(0, 256, (1100, 20, 1, 28, 28), dtype=torch.uint8, device=device)
        rotations = (0, 1, 2, 3)
        return EpisodicSampler(images, ways=ways, shots=shots, queries=queries, rotations=rotations)
    samplers = omniglot_samplers(
        data, split, ways=ways, shots=shots, queries=queries, device=device
    )
    return samplers["train"]


def time_sampling(data, tasks: int, repeats: int, split: str, device: str) -> None:
    """Print median tasks/s per setting (meta-batches of ``tasks``)."""
    source = "random data" if data is None else f"{split} split"
    print(f"\n{source}, train set, {device}, meta-batch of {tasks} tasks, median of {repeats}:")
    print("| ways | shots | queries | classes | ms / meta-batch | tasks / s |")
    print("|---|---|---|---|---|---|")
    for ways, shots, queries in SETTINGS:
        sampler = make_sampler(data, split, ways, shots, queries, device)
        generator = torch.Generator().manual_seed(0)
        sampler.batch(tasks, generator)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            sampler.batch(tasks, generator)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        median = statistics.median(times)
        print(
            f"| {ways} | {shots} | {queries} | {sampler.num_classes} | {1e3 * median:.2f} "
            f"| {tasks / median:,.0f} |"
        )


@dataclass
class Args:
    """Arguments of bench_sampler.py (each is a --flag; see --help)."""

    data_root: str | None = None
    """Omniglot's folder (default: $METALEARN_DATA)."""
    tasks: int = 32
    """Tasks per meta-batch."""
    repeats: int = 50
    """Timed meta-batches."""
    split: Literal["maml", "alphabet"] = "maml"
    """Which split's train set is sampled."""
    threads: int = 1
    """Torch intra-op threads."""
    device: str = "cpu"
    """Where the images stay resident."""
    skip_load: bool = False
    """Only time sampling."""
    synthetic: bool = False
    """Random data, no Omniglot."""


def parse_args(argv: Sequence[str] | None = None) -> Args:
    args = parse_args_as(Args, argv, __doc__)
    if min(args.tasks, args.repeats, args.threads) < 1:
        usage_error(
            f"--tasks, --repeats and --threads must be at least 1, got {args.tasks}, "
            f"{args.repeats} and {args.threads}"
        )
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if not (args.skip_load or args.synthetic):
        time_loads(args.data_root, workers=[None, 0])
    data = None if args.synthetic else load_omniglot(args.data_root, progress=False)
    time_sampling(data, args.tasks, args.repeats, args.split, args.device)


if __name__ == "__main__":
    main()
