"""What the benchmark scripts share: measuring (device sync, interleaved timing, peak memory),
the MAML Omniglot workload, and reporting.

The ``bench_*.py`` scripts import this module by name (a script run as ``python scripts/x.py``
has ``scripts/`` first on ``sys.path``) and no script imports another: whatever two of them
use lives here.

Timing: `time_round_robin` interleaves the compared functions within each repeat, so drift
on a noisy machine hits all of them alike, and every ratio is against a baseline measured
in the same run.

Peak memory: `peak_memory_bytes` counts tensor memory (the CUDA allocator's peak, or on the
CPU the same quantity rebuilt from ``torch.profiler`` memory events); `peak_step_mb` counts
what a whole step costs the process (RSS high-water mark on the CPU); `run_probe` runs such
a measurement in a fresh process whose RSS follows its live memory.

Command line: each script's flags are the fields of its ``Args`` dataclass, parsed by tyro
through `parse_args_as` (the parser of every metalearn command line,
`metalearn.runs.cli.parse_dataclass`); a value the types allow but the script does not is
refused by `usage_error`, in one line with exit status 2, like a parse error.

Workload (``bench_maml.py``, ``bench_chunks.py``): MAML's Omniglot Conv4 on random
1x28x28 tasks, 5-way 1-shot, one inner step at learning rate 0.4, in the settings
``q<query per class>-<first|second>``; `random_tasks` also draws other image shapes
(``bench_memory.py``'s 3x84x84).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, NoReturn, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import ProfilerActivity, profile

from metalearn.engine import Task
from metalearn.models import Conv4
from metalearn.runs.cli import parse_dataclass

T = TypeVar("T")

# ---------------------------------------------------------------------------- command line


def parse_args_as(cls: type[T], argv: Sequence[str] | None, doc: str | None) -> T:
    """``argv`` (``sys.argv[1:]`` when None) parsed into the dataclass ``cls``: each field is
    a flag, ``--field-name``, whose help is the string under the field; ``--help`` opens with
    the first paragraph of ``doc`` (the script's docstring). A parse error is one line on
    stderr and exit status 2."""
    return parse_dataclass(cls, argv, description=(doc or "").split("\n\n")[0])


def usage_error(message: str) -> NoReturn:
    """Refuse the command line in one line on stderr, ``<script>: error: <message>``, with
    exit status 2 (what a parse error gives)."""
    prog = os.path.basename(sys.argv[0]) or "bench"
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


# ---------------------------------------------------------------------------- measuring


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


def run_probe(cmd: list[str]) -> tuple[dict | None, subprocess.CompletedProcess[str]]:
    """Run a measuring command in a fresh process: the JSON record on its last line of
    stdout (None when it failed) and the finished process (whose stderr says why).

    A fixed mmap threshold stops glibc from keeping freed tensors in its heap, so RSS
    follows the live memory and a warmed-up step cannot hide its peak in reused pages.
    """
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        return None, out
    return json.loads(out.stdout.strip().splitlines()[-1]), out


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


# ---------------------------------------------------------------------------- workload

WAYS, SHOTS, INNER_LR = 5, 1, 0.4
"""MAML's Omniglot workload: 5-way 1-shot tasks, one inner step at learning rate 0.4."""


@dataclass(frozen=True)
class Setting:
    """One workload: query examples per class and the order of the meta-gradient."""

    query: int
    first_order: bool

    @property
    def name(self) -> str:
        return f"q{self.query}-{'first' if self.first_order else 'second'}"


SETTINGS = {
    s.name: s for s in (Setting(1, False), Setting(1, True), Setting(15, False), Setting(15, True))
}
"""The four workloads of the tables; `parse_setting` also takes any other ``q<N>-<order>``."""


def parse_setting(name: str) -> Setting:
    """``"q15-second"`` -> ``Setting(15, first_order=False)``."""
    match = re.fullmatch(r"q(\d+)-(first|second)", name)
    if match is None or int(match.group(1)) < 1:
        raise ValueError(
            f"unknown setting {name!r}; write q<query per class>-<first|second>, e.g. "
            f"{', '.join(SETTINGS)}"
        )
    return Setting(int(match.group(1)), match.group(2) == "first")


def omniglot_conv4(
    dtype: torch.dtype, seed: int, norm: Literal["meta", "fused"] = "meta", device: str = "cpu"
) -> Conv4:
    """MAML's Omniglot Conv4; ``norm="fused"`` swaps in ``nn.BatchNorm2d`` (same maths)."""
    torch.manual_seed(seed)
    model = Conv4(in_channels=1, ways=WAYS, hidden=64, pool="stride").to(device, dtype)
    if norm == "meta":
        return model
    fused = Conv4(
        in_channels=1, ways=WAYS, hidden=64, pool="stride",
        norm_layer=lambda c: nn.BatchNorm2d(c, track_running_stats=False),
    ).to(device, dtype)  # fmt: skip
    fused.load_state_dict(model.state_dict())  # same names: features.i.norm.{weight,bias}
    return fused


def random_tasks(
    n_tasks: int,
    ways: int,
    shots: int,
    query: int,
    image_shape: tuple[int, ...],
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> list[Task]:
    """``n_tasks`` tasks of uniform random images, ``ways``-way ``shots``-shot, ``query``
    query examples per class.

    Drawn on the CPU from a generator seeded ``seed + 1`` (the same tasks on every device),
    then moved to ``device``. Each task's support is ``[ways * shots, *image_shape]`` images
    with ``[ways * shots]`` labels, class by class; its query likewise with ``query``.
    """
    g = torch.Generator().manual_seed(seed + 1)
    labels = torch.arange(ways)

    def split(per_class: int) -> tuple[Tensor, Tensor]:
        x = torch.rand(ways * per_class, *image_shape, generator=g, dtype=dtype)
        return x.to(device), labels.repeat_interleave(per_class).to(device)

    return [Task(support=split(shots), query=split(query)) for _ in range(n_tasks)]


def omniglot_tasks(
    setting: Setting, n_tasks: int, dtype: torch.dtype, seed: int, device: str = "cpu"
) -> list[Task]:
    """``n_tasks`` random 5-way 1-shot tasks of 1x28x28 images, ``setting.query`` per class."""
    return random_tasks(n_tasks, WAYS, SHOTS, setting.query, (1, 28, 28), seed, dtype, device)


MetaGradient = Callable[[Sequence[Task]], None]
"""Fills ``.grad`` of the method's model parameters with the meta-gradient of the tasks."""


@dataclass
class MetaStep:
    """One method's meta-step on its own copy of the network: meta-gradient, then Adam."""

    model: nn.Module
    gradient: MetaGradient
    opt: torch.optim.Optimizer

    def __call__(self, tasks: Sequence[Task]) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.gradient(tasks)
        self.opt.step()


def learn2learn_gradient(model: nn.Module, setting: Setting) -> MetaGradient:
    """learn2learn's MAML (``clone`` / ``adapt``), one ``backward`` per task, as in its
    Omniglot example (learn2learn installed, see scripts/install_baselines.sh)."""
    import learn2learn as l2l

    maml = l2l.algorithms.MAML(model, lr=INNER_LR, first_order=setting.first_order)

    def run(tasks: Sequence[Task]) -> None:
        for task in tasks:
            learner = maml.clone()
            learner.adapt(F.cross_entropy(learner(task.support[0]), task.support[1]))
            loss = F.cross_entropy(learner(task.query[0]), task.query[1])
            (loss / len(tasks)).backward()

    return run


# ---------------------------------------------------------------------------- reporting


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table: the header row, its rule, then one line per row (cells as given)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
