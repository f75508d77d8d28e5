"""What every claim shares: the run's settings, timing, tables and the results record."""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from bench_hvp import peak_memory_bytes, print_table, time_round_robin

import metalearn

__all__ = [
    "Config",
    "hardware",
    "median_ms",
    "peak_memory_bytes",
    "print_table",
    "progress",
    "ratio",
    "time_interleaved",
]


@dataclass
class Config:
    """Settings shared by every claim (see ``scripts/bench_claims.py --help``)."""

    quick: bool = False
    """Smaller sizes and fewer repeats: a minute-scale check that everything runs."""
    repeats: int = 11
    """Timed rounds per measurement; tables give the median."""
    warmup: int = 2
    """Untimed rounds before timing."""
    compile_steps: list[int] = field(default_factory=lambda: [1, 5])
    """Inner-step counts at which the meta-step is compiled (minutes each on 2 cores)."""
    checkpoint_steps: list[int] = field(default_factory=lambda: [1, 5, 10, 20])
    """Inner-step counts for the checkpointing comparison."""
    compile_float64: bool = False
    """Also compile each compiled method in float64 and compare it with the float64 loop."""
    tasks: int = 16
    """Tasks per meta-batch in claims 5 and 6."""
    hidden: int = 64
    """Conv4 filters in claims 5 and 6 (64 is MAML's; the smoke test uses fewer)."""
    results: dict[str, Any] = field(default_factory=dict)
    """Filled by each claim's ``run``: the numbers behind its tables (for JSON and plots)."""


def clock() -> float:
    """This process's CPU time: steadier than wall time on a shared machine (one thread)."""
    return time.process_time()


def time_interleaved(
    fns: dict[str, Callable[[], object]], repeats: int, warmup: int
) -> dict[str, list[float]]:
    """Seconds (CPU) per call of each function, interleaved; `bench_hvp.time_round_robin`."""
    gc.collect()
    return time_round_robin(fns, repeats, warmup, torch.device("cpu"), clock)


def median_ms(times: Sequence[float]) -> float:
    return 1e3 * statistics.median(times)


def ratio(times: Sequence[float], baseline: Sequence[float]) -> float:
    """Median over median: how many times the baseline's time this one takes."""
    return statistics.median(times) / statistics.median(baseline)


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def hardware() -> str:
    """One line: torch version, CPU, threads, load (the tables' numbers depend on all)."""
    return (
        f"torch {torch.__version__}, {cpu_model()}, "
        f"{torch.get_num_threads()} thread(s) of {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d')}; metalearn from "
        f"{os.path.dirname(os.path.dirname(metalearn.__file__))}"
    )


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (Linux), else the machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()
