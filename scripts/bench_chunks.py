"""Grid behind the ``auto`` chunk rule: meta-step time by tasks per vmapped chunk.

What: for each workload (``q<query per class>-<first|second>``, as in ``bench_maml.py``:
conv4, 32 tasks, 5-way 1-shot, 1 inner step) the median time of a full meta-step for vmapped
chunks of 4, 8, 16 and 32 tasks (those within ``--max-examples``), what ``chunk_size="auto"``
picks, the per-task loop, and learn2learn when it is installed, interleaved round-robin in
one process. `metalearn.engine.plan.VMAP_CHUNK_EXAMPLES` comes from this table.

Command::

    .venv-baselines/bin/python scripts/bench_chunks.py                 # ~5 min on 2 cores
    .venv/bin/python scripts/bench_chunks.py --settings q1-second --malloc default

Expected (2 CPU cores, 2 threads, tuned malloc; docs/benchmarks.md): the fastest chunk holds about
320-640 examples (32 tasks of 10, 16 of 30, 8 of 80); ``auto`` lands on or next to it.

With ``--malloc default`` the columns are not independent: glibc raises its mmap threshold
to the largest block freed so far, so a big chunk timed earlier in a round spares the
smaller ones later in it their page faults. Compare configurations in fresh processes there.
"""

from __future__ import annotations

import functools
import importlib.util
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from benchtools import (
    INNER_LR,
    SHOTS,
    WAYS,
    MetaStep,
    Setting,
    learn2learn_gradient,
    markdown_table,
    omniglot_conv4,
    omniglot_tasks,
    parse_args_as,
    parse_setting,
    time_round_robin,
    usage_error,
)

from metalearn import tune_malloc
from metalearn.algorithms import FOMAML, MAML
from metalearn.engine import ChunkSize

CHUNKS = (4, 8, 16, 32)
DEFAULT_SETTINGS = "q1-second,q1-first,q5-second,q5-first,q15-second,q15-first"
"""bench_maml's four workloads and the default Omniglot run's (5 query per class)."""


def make_steps(
    setting: Setting, max_examples: int, device: str = "cpu"
) -> dict[str, Callable[[list], None]]:
    """One meta-step per configuration, each on its own copy of the same network."""
    per_task = WAYS * (SHOTS + setting.query)
    configs: dict[str, tuple[str, ChunkSize]] = {
        f"chunks of {c}": ("vmap", c) for c in CHUNKS if c * per_task <= max_examples
    }
    configs |= {"auto": ("auto", "auto"), "loop": ("loop", 1)}
    steps = {}
    for name, (vectorize, chunk) in configs.items():
        model = omniglot_conv4(torch.float32, seed=0, device=device)
        learner = (FOMAML if setting.first_order else MAML)(
            model, inner_lr=INNER_LR, inner_steps=1, vectorize=vectorize, chunk_size=chunk
        )
        steps[name] = MetaStep(model, learner.backward, torch.optim.Adam(model.parameters()))
    if importlib.util.find_spec("learn2learn") is not None:
        model = omniglot_conv4(torch.float32, seed=0, norm="fused", device=device)
        gradient = learn2learn_gradient(model, setting)
        steps["learn2learn"] = MetaStep(model, gradient, torch.optim.Adam(model.parameters()))
    else:
        print("learn2learn not installed: its column is skipped (scripts/install_baselines.sh)")
    return steps


def time_steps(
    steps: dict[str, Callable], tasks: list, repeats: int, device: str = "cpu"
) -> dict[str, float]:
    """Median seconds per step, round-robin with a rotating start, after one warm-up round."""
    fns = {name: functools.partial(step, tasks) for name, step in steps.items()}
    times = time_round_robin(fns, repeats, 1, torch.device(device), time.perf_counter, collect=True)
    return {n: statistics.median(t) for n, t in times.items()}


@dataclass
class Args:
    """Arguments of bench_chunks.py (each is a --flag; see --help)."""

    settings: str = DEFAULT_SETTINGS
    """Comma-separated settings, q<query per class>-<first|second>."""
    repeats: int = 5
    """Timed rounds."""
    threads: int = 0
    """Torch CPU threads (0: torch's default)."""
    max_examples: int = 1400
    """Largest chunk timed, in examples (tasks per chunk x examples per task)."""
    malloc: Literal["tuned", "default"] = "tuned"
    """glibc malloc tuned by metalearn.tune_malloc, or its defaults."""
    device: str = "cpu"
    """cpu or cuda (cuda:N)."""


def parse_args(argv: Sequence[str] | None = None) -> Args:
    args = parse_args_as(Args, argv, __doc__)
    if args.repeats < 1 or args.max_examples < 1 or args.threads < 0:
        usage_error(
            "--repeats and --max-examples must be at least 1 and --threads at least 0, got "
            f"{args.repeats}, {args.max_examples} and {args.threads}"
        )
    for name in args.settings.split(","):
        try:
            parse_setting(name)
        except ValueError as error:
            usage_error(f"--settings: {error}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    malloc = tune_malloc().reason if args.malloc == "tuned" else "glibc defaults"
    print(f"# chunk grid on {args.device}: {torch.get_num_threads()} threads; malloc: {malloc}\n")
    results: dict[str, dict[str, float]] = {}
    for name in args.settings.split(","):
        setting = parse_setting(name)
        steps = make_steps(setting, args.max_examples, args.device)
        tasks = omniglot_tasks(setting, 32, torch.float32, seed=0, device=args.device)
        results[name] = time_steps(steps, tasks, args.repeats, args.device)
        print(f"{name}: " + ", ".join(f"{k} {1e3 * v:.0f}" for k, v in results[name].items()))
    columns = list(dict.fromkeys(k for medians in results.values() for k in medians))
    columns.sort(key=lambda k: (not k.startswith("chunks"), k.startswith("chunks") and int(k[10:])))
    rows = [
        [name, str(WAYS * (SHOTS + parse_setting(name).query))]
        + [f"{1e3 * medians[k]:.0f}" if k in medians else "" for k in columns]
        for name, medians in results.items()
    ]
    print("\n## Meta-step time by chunk, median ms\n")
    print(markdown_table(["setting", "examples/task", *columns], rows))


if __name__ == "__main__":
    main()
