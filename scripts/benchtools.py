"""Measuring helpers the benchmark scripts share: device sync, interleaved timing, peak memory.

``bench_hvp.py``, ``bench_maml.py`` and ``bench_chunks.py`` import this module by name: a
script run as ``python scripts/x.py`` has ``scripts/`` first on ``sys.path``.

Timing: `time_round_robin` interleaves the compared functions within each repeat, so drift
on a noisy machine hits all of them alike, and every ratio is against a baseline measured
in the same run.

Peak memory: `peak_memory_bytes` counts tensor memory (the CUDA allocator's peak, or on the
CPU the same quantity rebuilt from ``torch.profiler`` memory events); `peak_step_mb` counts
what a whole step costs the process (RSS high-water mark on the CPU).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile


def sync(device: torch.device | str) -> None:
    """Wait for a CUDA device's queued kernels (nothing to wait for on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_round_robin(
    fns: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int,
    device: torch.device | str,
    clock: Callable[[], float],
    collect: bool = False,
) -> dict[str, list[float]]:
    """Seconds per call of each function, the functions interleaved within each repeat.

    The starting function rotates from repeat to repeat, so no method always runs right
    after the same neighbour (cache state, allocator state). ``collect=True`` runs the
    garbage collector before each timed call, outside the timing, so one method's garbage
    is not freed in another's time.

    Returns:
        ``{name: [seconds of repeat 0, ..., seconds of repeat repeats-1]}``.
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            if collect:
                gc.collect()
            start = clock()
            fns[name]()
            sync(device)
            times[name].append(clock() - start)
    return times


def peak_memory_bytes(fn: Callable[[], object], device: torch.device | str) -> int:
    """Peak bytes of tensor memory live during ``fn()`` above what was live before it.

    On CUDA, ``torch.cuda.max_memory_allocated`` above the bytes allocated before the call.
    On the CPU, the highest running sum of bytes allocated minus bytes freed through
    PyTorch's allocator during the call (``torch.profiler`` memory events): a lower bound on
    RSS growth, since oneDNN scratch buffers and Python objects are not counted.
    """
    device = torch.device(device)
    if device.type == "cuda":
        sync(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - before
    with (
        _quiet_profiler_log(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        fn()
    # Each event carries the bytes allocated minus freed by itself (not its children);
    # "[memory]" events are allocations/frees outside any operator (e.g. tensors dying).
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    live = itertools.accumulate(e.self_cpu_memory_usage for e in events)
    return max(0, max(live, default=0))


def retained_bytes(fn: Callable[[], object]) -> tuple[object, int]:
    """``fn()``'s result and the CPU tensor bytes allocated during the call still live after it.

    The same ``torch.profiler`` memory events as `peak_memory_bytes`, summed to the end
    instead of maximised: the result itself and whatever it keeps alive (e.g. the autograd
    graph's saved tensors) while the caller holds it.
    """
    with (
        _quiet_profiler_log(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        result = fn()
    return result, sum(e.self_cpu_memory_usage for e in prof.events())


@contextlib.contextmanager
def _quiet_profiler_log() -> Iterator[None]:
    """Drop the profiler's C++ status lines ("USDT: ... profiler_start") from stderr.

    They are written straight to file descriptor 2, so stderr is sent to a temporary file
    for the duration and everything else in it is written back afterwards.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            for line in tmp.read().decode(errors="replace").splitlines(keepends=True):
                if not _PROFILER_CHATTER.match(line):
                    sys.stderr.write(line)


_PROFILER_CHATTER = re.compile(r"^(USDT|STAGE):\S* \S* \d+:\d+ \S+\.cpp:\d+\]")


def status_kb(key: str) -> int:
    """One ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{key}:\s+(\d+) kB", f.read(), re.M).group(1))


def peak_step_mb(step: Callable[[], None], device: torch.device | str = "cpu") -> float:
    """Peak memory above the start of ``step()`` after one warm-up call, MB (this process):
    RSS on the CPU, the CUDA caching allocator's allocated bytes on a GPU.

    The warm-up takes Adam state, lazy initialisation and any compiling out of the peak.
    """
    step()
    if torch.device(device).type == "cuda":
        return peak_memory_bytes(step, device) / 2**20
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS (Linux >= 4.0)
    start = status_kb("VmRSS")
    step()
    return (status_kb("VmHWM") - start) / 1024


def run_header() -> str:
    """One line naming what a measurement ran on: torch, its threads, the load average
    (``os.getloadavg``: 1, 5 and 15 minutes) and the metalearn commit imported."""
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    return (f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), load average "
            f"{load}, metalearn {metalearn_commit()}")  # fmt: skip


def metalearn_commit() -> str:
    """The short commit of the imported ``metalearn`` package's checkout, ``+changes`` when
    its files differ from that commit; ``unknown`` outside a git checkout."""
    import metalearn

    package = os.path.dirname(metalearn.__file__)
    git = ["git", "-C", package]
    try:
        commit = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()  # fmt: skip
        changed = subprocess.run(git + ["status", "--porcelain", "--", "."], capture_output=True,
                                 text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+changes" if changed else "")
