"""Per-image inference latency of the deployed forms of one model, as a markdown table.

Each form (eager, eager under ``torch.inference_mode``, the exported program, the
AOTInductor package, a TensorRT engine) is called on the same images: a few warm-up calls
(first-call allocation, lazy initialisation), then ``repeats`` timed calls; the median is
reported, divided by the batch size. CUDA calls are synchronised before the clock is read.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import Tensor

from metalearn.deploy.program import sibling_path

__all__ = [
    "LATENCY_SUFFIX",
    "check_repeats",
    "latency_table",
    "latency_table_path",
    "measure_latency",
]

LATENCY_SUFFIX = ".latency.md"
"""Beside the package folder: ``adapted/`` -> ``adapted.latency.md``."""


def latency_table_path(out: str | os.PathLike) -> Path:
    """Where the latency table of the package folder ``out`` goes (beside it)."""
    return sibling_path(out, LATENCY_SUFFIX)


def check_repeats(repeats: int, warmup: int) -> None:
    """Raise ``ValueError`` unless ``repeats >= 1`` and ``warmup >= 0``."""
    if repeats < 1 or warmup < 0:
        raise ValueError(
            f"latency needs repeats >= 1 and warmup >= 0, got {repeats} and {warmup}; "
            "pass e.g. --latency-repeats 50"
        )


def measure_latency(
    runners: Mapping[str, tuple[Callable[[Tensor], Tensor], Tensor]],
    *,
    repeats: int,
    warmup: int = 5,
) -> dict[str, float]:
    """The median seconds per image of each runner on its input.

    Args:
        runners: name -> ``(run, x)``: ``run(x)`` classifies images ``x [B, C, H, W]``
            (each runner gets its own ``x``, on its own device).
        repeats: timed calls per runner (>= 1).
        warmup: untimed calls first.

    Returns:
        Name -> median wall-clock seconds of one call divided by ``B``, in ``runners``' order.

    Raises:
        ValueError: ``repeats < 1`` or ``warmup < 0``.
    """
    check_repeats(repeats, warmup)
    return {
        name: _median_call(run, x, repeats, warmup) / len(x) for name, (run, x) in runners.items()
    }


def _median_call(run: Callable[[Tensor], Tensor], x: Tensor, repeats: int, warmup: int) -> float:
    """Median wall-clock seconds of ``run(x)`` after ``warmup`` calls."""
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    for _ in range(warmup):
        run(x)
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run(x)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def latency_table(
    latencies: Mapping[str, float],
    *,
    batch: int,
    repeats: int,
    warmup: int,
    devices: Mapping[str, str],
) -> str:
    """A markdown table of `measure_latency`'s result, with what was measured on top.

    Args:
        latencies: name -> seconds per image; the first row is the reference (``1x``).
        batch: images per call.
        repeats: timed calls per row.
        warmup: untimed calls before them.
        devices: name -> the device the row ran on (``"cpu"``, ``"cuda"``).

    Returns:
        A caption line, a blank line and the table (``| form | device | ms per image |
        speed-up vs <first form> |``), ending in a newline.
    """
    caption = (
        f"Per-image latency: batch {batch}, median of {repeats} calls after {warmup} warm-up "
        f"calls, torch {torch.__version__}, torch.get_num_threads() = {torch.get_num_threads()}."
    )
    first, reference = next(iter(latencies.items()))
    rows = [f"| form | device | ms per image | speed-up vs {first} |", "|---|---|---|---|"]
    for name, seconds in latencies.items():
        rows.append(
            f"| {name} | {devices[name]} | {seconds * 1e3:.4g} | {reference / seconds:.3g}x |"
        )
    return "\n".join([caption, "", *rows]) + "\n"
