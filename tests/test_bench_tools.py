"""scripts/benchtools.py: interleaved timing order and the CPU peak-memory count (no timings)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import benchtools  # noqa: E402


def test_round_robin_rotates_the_starting_function_and_times_each_call() -> None:
    calls: list[str] = []
    ticks = iter(range(1000))
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = benchtools.time_round_robin(
        fns, repeats=3, warmup=1, device="cpu", clock=lambda: next(ticks)
    )
    # warm-up in the given order, then each repeat starts one function later
    assert calls == list("abc") + list("abc") + list("bca") + list("cab")
    # a call is timed as the difference of two clock reads taken around it alone
    assert times == {"a": [1, 1, 1], "b": [1, 1, 1], "c": [1, 1, 1]}


def test_cpu_peak_memory_counts_a_temporary_tensor() -> None:
    n = 1 << 20  # 4 MiB of float32, freed before the call returns

    def make_and_drop() -> None:
        x = torch.empty(n, dtype=torch.float32)
        x.fill_(1.0)

    peak = benchtools.peak_memory_bytes(make_and_drop, "cpu")
    assert 4 * n <= peak < 4 * n + 4096
