"""Peak memory and time of one mini-ImageNet-sized meta-step on one machine.

What: one full meta-step (the learner's ``backward`` over a meta-batch, then Adam) on random
3x84x84 images, 5-way 1-shot with ``--query`` examples per class, ``--tasks`` tasks and
``--inner-steps`` inner steps (inner learning rate 0.01, MAML's for mini-ImageNet), for

* ``--model conv4-84``: MAML's mini-ImageNet network, ``Conv4(in_channels=3, ways=5,
  hidden=32, pool="max", head="flatten", image_size=84)`` (32,901 parameters);
* ``--model resnet12``: ``ResNet12(in_channels=3, ways=5)`` (widths 64-160-320-640,
  12,427,525 parameters);
* ``--model conv4-28``: MAML's Omniglot network, ``Conv4(in_channels=1, ways=5, hidden=64,
  pool="stride")`` (112,261 parameters), on 1x28x28 images (the rest as above, inner
  learning rate included: time and memory do not depend on it);

and ``--algorithm maml`` (exact second order), ``fomaml`` (first order) or ``anil`` (the head
adapted, second order through it). ``--chunk-size`` and ``--checkpoint`` are the learner's
(`metalearn.algorithms.MetaLearner`): tasks per chunk of the meta-batch (``auto``, ``none``
for one graph, or a number) and recomputing inner steps in the backward pass (loop only).

How: each configuration runs in a fresh subprocess, which takes one warm-up meta-step,
resets the RSS high-water mark (``/proc/self/clear_refs``), and runs ``--repeats`` more
(`benchtools.peak_step_mb`, as ``bench_maml.py`` measures). The table gives the process's
peak RSS during the measured step (VmHWM: what must fit in the machine's memory, torch
itself and the Adam state included), the peak above the RSS at that step's start, and the
median seconds of the timed steps. glibc's mmap threshold is pinned in the subprocess so
freed tensors return to the kernel and RSS follows live memory. ``--limit-gb`` caps each
subprocess's data size (``RLIMIT_DATA``), so a configuration that needs more fails with
"over N GB" instead of pushing a shared machine into swap or the OOM killer. Linux only.

Command (the rows of the mini-ImageNet memory table)::

    .venv/bin/python scripts/bench_memory.py --suite --threads 1 --repeats 2 --limit-gb 12

or one configuration::

    .venv/bin/python scripts/bench_memory.py --model resnet12 --algorithm fomaml --chunk-size 1

Peak memory does not depend on the machine's load; the times do (on a shared machine read
them as upper bounds).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from benchtools import (
    markdown_table,
    parse_args_as,
    peak_step_mb,
    random_tasks,
    run_probe,
    status_kb,
    usage_error,
)
from torch import nn

from metalearn.algorithms import ANIL, FOMAML, MAML, MetaLearner
from metalearn.engine import ChunkSize, Task
from metalearn.models import Conv4, ResNet12

WAYS, SHOTS, IMAGE_SIZE, INNER_LR, OUTER_LR = 5, 1, 84, 0.01, 1e-3
Model = Literal["conv4-84", "resnet12", "conv4-28"]
MODELS: tuple[str, ...] = typing.get_args(Model)
Algorithm = Literal["maml", "fomaml", "anil"]
ALGORITHMS = {"maml": MAML, "fomaml": FOMAML, "anil": ANIL}
FITS_GB = 8.0
"""The budget the table's last column checks the peak RSS against."""


@dataclass(frozen=True)
class Config:
    """One row of the table: the network, the algorithm and how the meta-batch runs."""

    model: str
    algorithm: str
    chunk_size: ChunkSize = "auto"
    checkpoint: bool = False

    def argv(self) -> list[str]:
        """The command-line flags that select this configuration."""
        chunk = "none" if self.chunk_size is None else str(self.chunk_size)
        flags = ["--model", self.model, "--algorithm", self.algorithm, "--chunk-size", chunk]
        return flags + (["--checkpoint"] if self.checkpoint else [])


SUITE = (
    Config("conv4-84", "maml"),
    Config("conv4-84", "maml", chunk_size=1),
    Config("conv4-84", "maml", checkpoint=True),
    Config("conv4-84", "fomaml"),
    Config("resnet12", "fomaml", chunk_size=1),
    Config("resnet12", "anil", chunk_size=1),
    Config("resnet12", "maml", chunk_size=1, checkpoint=True),
)
"""``--suite``: second order Conv4 three ways, first order Conv4, and ResNet-12 task by task
(a vmapped chunk of 4 ResNet-12 tasks holds 4 tasks' activations at once)."""


@dataclass
class Workload:
    """What every configuration of a run shares."""

    inner_steps: int = 5
    query: int = 15
    tasks: int = 4
    threads: int = 0
    repeats: int = 3
    limit_gb: float = 0.0
    seed: int = 0


# ---------------------------------------------------------------------------- the step


def image_shape(model: str) -> tuple[int, int, int]:
    """The input of ``--model``: Omniglot's 1x28x28 for ``conv4-28``, else 3x84x84."""
    return (1, 28, 28) if model == "conv4-28" else (3, IMAGE_SIZE, IMAGE_SIZE)


def make_model(name: str) -> nn.Module:
    """The network of ``--model`` at its paper's size (`image_shape` input, 5 ways)."""
    if name == "conv4-28":
        return Conv4(in_channels=1, ways=WAYS, hidden=64, pool="stride")
    if name == "conv4-84":
        return Conv4(
            in_channels=3, ways=WAYS, hidden=32, pool="max", head="flatten", image_size=IMAGE_SIZE
        )
    return ResNet12(in_channels=3, ways=WAYS, widths=(64, 160, 320, 640))


def make_tasks(work: Workload, model: str = "conv4-84") -> list[Task]:
    """``work.tasks`` random 5-way 1-shot tasks of ``image_shape(model)`` images,
    ``work.query`` per class."""
    return random_tasks(work.tasks, WAYS, SHOTS, work.query, image_shape(model), work.seed)


def make_learner(config: Config, work: Workload) -> MetaLearner:
    torch.manual_seed(work.seed)
    return ALGORITHMS[config.algorithm](
        make_model(config.model),
        inner_lr=INNER_LR,
        inner_steps=work.inner_steps,
        chunk_size=config.chunk_size,
        gradient_checkpointing=config.checkpoint,
    )


def probe(config: Config, work: Workload) -> dict[str, object]:
    """Measure ``config`` in this process: peak RSS of a warmed-up step and step times."""
    if work.limit_gb:
        limit = int(work.limit_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    learner = make_learner(config, work)
    tasks = make_tasks(work, config.model)
    opt = torch.optim.Adam(learner.parameters(), lr=OUTER_LR)
    seconds: list[float] = []

    def step() -> None:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        learner.backward(tasks)
        opt.step()
        seconds.append(time.perf_counter() - start)

    above_start = peak_step_mb(step)  # a warm-up step, then the measured one
    peak_rss = status_kb("VmHWM") / 1024  # the measured step's high-water mark
    for _ in range(work.repeats - 1):
        step()
    chunks = learner.plan(tasks, learner.inner_loop())
    return {
        "peak_rss_mb": peak_rss,
        "above_start_mb": above_start,
        "seconds": seconds[1:],
        "ran": f"{chunks[0].mode}, {len(chunks)}x{len(chunks[0].tasks)}",
    }


# ---------------------------------------------------------------------------- the table


def run_in_subprocess(config: Config, work: Workload) -> dict[str, object] | str:
    """`probe` ``config`` in a fresh process: its record, or why there is none."""
    cmd = [
        sys.executable, os.path.abspath(__file__), "--probe", *config.argv(),
        "--inner-steps", str(work.inner_steps), "--query", str(work.query),
        "--tasks", str(work.tasks), "--threads", str(work.threads),
        "--repeats", str(work.repeats), "--limit-gb", str(work.limit_gb), "--seed", str(work.seed),
    ]  # fmt: skip
    record, out = run_probe(cmd)  # RSS follows live memory there (glibc's threshold pinned)
    if record is not None:
        return record
    if work.limit_gb and ("can't allocate memory" in out.stderr or "MemoryError" in out.stderr):
        return f"over {work.limit_gb:g} GB"
    return f"failed (exit {out.returncode}): {out.stderr.strip()[-300:]}"


def row(config: Config, record: dict[str, object] | str) -> list[str]:
    """One table row: the configuration, then its measurements or why there are none."""
    chunk = "none" if config.chunk_size is None else str(config.chunk_size)
    cells = [config.model, config.algorithm, chunk, "on" if config.checkpoint else "off"]
    if isinstance(record, str):
        return [*cells, "-", record, "-", "-", "no" if record.startswith("over") else "-"]
    peak = float(record["peak_rss_mb"])
    seconds = [float(s) for s in record["seconds"]]
    return [
        *cells,
        str(record["ran"]),
        f"{peak:.0f}",
        f"{float(record['above_start_mb']):.0f}",
        f"{statistics.median(seconds):.2f}",
        "yes" if peak <= FITS_GB * 1024 else "no",
    ]


HEADER = (
    "model", "algorithm", "chunk", "checkpoint", "ran", "peak RSS MB", "step peak above start MB",
    "median s/step", f"fits {FITS_GB:g} GB",
)  # fmt: skip


def main(configs: Sequence[Config], work: Workload) -> str:
    """Measure each configuration in its own process; print and return the markdown table."""
    print(
        f"# Meta-step memory, random images ({'x'.join(map(str, image_shape(configs[0].model)))}"
        f" for {configs[0].model}), {WAYS}-way {SHOTS}-shot, "
        f"{work.query} query per class, {work.tasks} tasks, {work.inner_steps} inner steps\n\n"
        f"torch {torch.__version__}, {work.threads or torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; one warm-up step, then "
        f"{work.repeats} timed (peak RSS from the first)\n",
        flush=True,
    )
    rows = []
    for config in configs:
        rows.append(row(config, run_in_subprocess(config, work)))
        print("measured: " + " | ".join(rows[-1]), flush=True)
    table = markdown_table(HEADER, rows)
    print("\n" + table)
    return table


# ---------------------------------------------------------------------------- arguments


@dataclass
class Args:
    """Arguments of bench_memory.py (each is a --flag; see --help)."""

    model: Model | None = None
    """The network (None: conv4-84)."""
    algorithm: Algorithm | None = None
    """The meta-learner (None: maml)."""
    chunk_size: str = "auto"
    """Tasks per vmapped chunk: auto, none (one graph) or N."""
    checkpoint: bool = False
    """Recompute the inner steps in the backward pass (loop only)."""
    suite: bool = False
    """The table's seven configurations (each row chooses its model, algorithm, chunk and
    checkpoint)."""
    inner_steps: int = Workload.inner_steps
    """Inner steps."""
    query: int = Workload.query
    """Query examples per class."""
    tasks: int = Workload.tasks
    """Tasks per meta-batch."""
    threads: int = Workload.threads
    """Torch threads (0: torch's default)."""
    repeats: int = Workload.repeats
    """Timed meta-steps after the warm-up."""
    limit_gb: float = Workload.limit_gb
    """Each subprocess's data-size cap in GB (0: no limit)."""
    seed: int = Workload.seed
    """Seeds the network and the tasks."""
    probe: bool = False
    """Internal: measure one configuration and print its JSON (the subprocess's mode)."""


def _chunk_size(text: str) -> ChunkSize:
    """``auto`` -> "auto", ``none`` -> None (one graph), ``N`` -> N."""
    if text in ("auto", "none"):
        return None if text == "none" else "auto"
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--chunk-size: expected auto, none or a positive integer, got {text!r}")
    return int(text)


def parse_args(argv: Sequence[str] | None = None) -> tuple[list[Config], Workload, bool]:
    """Configurations, workload, and whether this process is a subprocess's probe."""
    a = parse_args_as(Args, argv, __doc__)
    for flag, value in (("--inner-steps", a.inner_steps), ("--query", a.query),
                        ("--tasks", a.tasks), ("--repeats", a.repeats)):  # fmt: skip
        if value < 1:
            usage_error(f"{flag}: expected a positive integer, got {value}")
    chosen = {"--model": a.model, "--algorithm": a.algorithm,
              "--chunk-size": None if a.chunk_size == "auto" else a.chunk_size,
              "--checkpoint": a.checkpoint or None}  # fmt: skip
    if a.suite and (given := [flag for flag, value in chosen.items() if value is not None]):
        usage_error(
            f"--suite chooses each row's model, algorithm, chunk and checkpoint; drop {given}"
        )
    if a.threads < 0 or a.limit_gb < 0:
        usage_error("--threads and --limit-gb must be >= 0 (0: torch's default / no limit)")
    work = Workload(a.inner_steps, a.query, a.tasks, a.threads, a.repeats, a.limit_gb, a.seed)
    if a.suite:
        return list(SUITE), work, False
    try:
        chunk = _chunk_size(a.chunk_size)
    except ValueError as error:
        usage_error(str(error))
    config = Config(a.model or "conv4-84", a.algorithm or "maml", chunk, a.checkpoint)
    return [config], work, a.probe


if __name__ == "__main__":
    configs, work, is_probe = parse_args()
    if work.threads:
        torch.set_num_threads(work.threads)
    if is_probe:
        print(json.dumps(probe(configs[0], work)))
    else:
        main(configs, work)
