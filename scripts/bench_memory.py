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

import argparse
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from benchtools import markdown_table, peak_step_mb, random_tasks, run_probe, status_kb
from torch import nn

from metalearn.algorithms import ANIL, FOMAML, MAML, MetaLearner
from metalearn.engine import ChunkSize, Task
from metalearn.models import Conv4, ResNet12

WAYS, SHOTS, IMAGE_SIZE, INNER_LR, OUTER_LR = 5, 1, 84, 0.01, 1e-3
MODELS = ("conv4-84", "resnet12", "conv4-28")
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
        checkpoint=config.checkpoint,
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


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _chunk_size(text: str) -> ChunkSize:
    """``auto`` -> "auto", ``none`` -> None (one graph), ``N`` -> N."""
    if text in ("auto", "none"):
        return None if text == "none" else "auto"
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--chunk-size: expected auto, none or a positive integer, got {text!r}")
    return int(text)


def parse_args(argv: Sequence[str] | None = None) -> tuple[list[Config], Workload, bool]:
    """Configurations, workload, and whether this process is a subprocess's probe."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=MODELS, default=None, help="default conv4-84")
    p.add_argument("--algorithm", choices=list(ALGORITHMS), default=None, help="default maml")
    p.add_argument("--chunk-size", default=None, help="auto (default), none or N tasks")
    p.add_argument("--checkpoint", action="store_true", default=None)
    p.add_argument("--suite", action="store_true", help="the table's seven configurations")
    p.add_argument("--inner-steps", type=_positive_int, default=Workload.inner_steps)
    p.add_argument("--query", type=_positive_int, default=Workload.query, help="per class")
    p.add_argument("--tasks", type=_positive_int, default=Workload.tasks)
    p.add_argument("--threads", type=int, default=Workload.threads, help="0: torch's default")
    p.add_argument("--repeats", type=_positive_int, default=Workload.repeats)
    p.add_argument("--limit-gb", type=float, default=Workload.limit_gb, help="0: no limit")
    p.add_argument("--seed", type=int, default=Workload.seed)
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    chosen = {"--model": ns.model, "--algorithm": ns.algorithm, "--chunk-size": ns.chunk_size,
              "--checkpoint": ns.checkpoint}  # fmt: skip
    if ns.suite and (given := [flag for flag, value in chosen.items() if value is not None]):
        p.error(f"--suite chooses each row's model, algorithm, chunk and checkpoint; drop {given}")
    if ns.threads < 0 or ns.limit_gb < 0:
        p.error("--threads and --limit-gb must be >= 0 (0: torch's default / no limit)")
    work = Workload(ns.inner_steps, ns.query, ns.tasks, ns.threads, ns.repeats, ns.limit_gb,
                    ns.seed)  # fmt: skip
    if ns.suite:
        return list(SUITE), work, False
    try:
        chunk = _chunk_size(ns.chunk_size or "auto")
    except ValueError as error:
        p.error(str(error))
    config = Config(ns.model or "conv4-84", ns.algorithm or "maml", chunk, bool(ns.checkpoint))
    return [config], work, ns.probe


if __name__ == "__main__":
    configs, work, is_probe = parse_args()
    if work.threads:
        torch.set_num_threads(work.threads)
    if is_probe:
        print(json.dumps(probe(configs[0], work)))
    else:
        main(configs, work)
