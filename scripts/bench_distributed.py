"""Benchmark distributed meta-training: meta-steps per second with 1 and 2 processes.

What: the experiment's meta-step (`experiments/omniglot_maml.py` under ``torchrun``) on
Omniglot-shaped random data: MAML's Conv4 (112k parameters), second order, 5-way 1-shot,
``--query`` per class, one inner step, Adam. A global meta-batch of ``--meta-batch`` tasks
is drawn from the same seeded generator on every rank; each rank builds its share of the
tasks, fills ``.grad`` with `MetaLearner.backward` and `metalearn.distributed` averages it
(`average_gradients` + `average_metrics`, what `average_meta_step` does). Each process
runs with one torch thread, so N processes use N cores.

It launches ``torchrun --standalone --nproc_per_node=N`` of this script for N = 1 and 2
(1 process: no process group, no collective: the plain single-process step), ``--rounds``
times in alternation, and reports per N the median wall time of a step over the measured
steps (rank 0's clock; collectives make the ranks step together), its split into compute
(sampling + meta-gradient) and communication (the all_reduces, including waiting for the
slower rank), the CPU seconds each process spent per step, and the bytes all-reduced per
step, counted from the buffers the library actually sends. Last line:
``scaling_efficiency: X`` = (steps/s with 2 processes) / (2 x steps/s with 1).

Command::

    .venv/bin/python scripts/bench_distributed.py                 # ~1-2 min on 2 cores
    .venv/bin/python scripts/bench_distributed.py --meta-batch 16 --query 5 --steps 20

Expected: on a 2-core machine the efficiency is below 1 (the two processes share the
machine with the launcher and with each other's memory bandwidth; vmap's batched kernels
on half the tasks are less efficient); on a quiet machine with a core per process it
should approach 1, since one all_reduce of 449 KB takes 0.4 ms here (2 gloo processes,
after a barrier) against a step of hundreds of ms.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from benchtools import parse_args_as, usage_error

from metalearn import distributed
from metalearn.algorithms import MAML
from metalearn.data import EpisodicSampler
from metalearn.models import Conv4

WAYS, SHOTS, INNER_LR, OUTER_LR = 5, 1, 0.4, 1e-3


def make_sampler(query: int, seed: int = 0) -> EpisodicSampler:
    """Random uint8 images shaped like Omniglot's background set (964 classes x 20, 28x28)."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (964, 20, 1, 28, 28), generator=g, dtype=torch.uint8)
    return EpisodicSampler(images, ways=WAYS, shots=SHOTS, queries=query)


def worker(args: Args) -> None:
    """One rank: time ``--warmup + --steps`` meta-steps; rank 0 writes the JSON result."""
    torch.set_num_threads(1)
    info = distributed.init_from_env(device="cpu", timeout_s=300)
    sampler = make_sampler(args.query)
    torch.manual_seed(0)
    learner = MAML(Conv4(ways=WAYS), inner_lr=INNER_LR, inner_steps=1)
    distributed.broadcast_params(learner)
    opt = torch.optim.Adam(learner.parameters(), lr=OUTER_LR)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for step in range(args.warmup + args.steps):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        classes, examples = sampler.sample_indices(gen, args.meta_batch)
        part = distributed.shard_slice(args.meta_batch)
        tasks = sampler.tasks_from_indices(classes[part], examples[part])
        opt.zero_grad(set_to_none=True)
        metrics = learner.backward(tasks)
        wall1 = time.perf_counter()
        sync = distributed.average_gradients(learner.parameters(), len(tasks))
        metrics = distributed.average_metrics(metrics, len(tasks))
        wall2 = time.perf_counter()
        opt.step()
        wall3, cpu3 = time.perf_counter(), time.process_time()
        if step >= args.warmup:
            rows.append([wall3 - wall0, wall1 - wall0, wall2 - wall1, cpu3 - cpu0])
    local = torch.tensor(rows, dtype=torch.float64)
    every = distributed.gather_tensor(local).view(info.world_size, args.steps, 4)
    if info.is_main:
        metric_bytes = 8 * (len(dataclasses.fields(metrics)) + 1)  # float64, plus the weight
        result = {
            "processes": info.world_size,
            "step_s": statistics.median(every[0, :, 0].tolist()),
            "compute_s": statistics.median(every[0, :, 1].tolist()),
            "comm_s": statistics.median(every[0, :, 2].tolist()),
            "cpu_s_per_process": statistics.median(every[:, :, 3].flatten().tolist()),
            "allreduce_bytes": sync.bytes + (metric_bytes if info.distributed else 0),
            "grad_bytes": sync.bytes,
            "vectorized_tasks": metrics.vectorized,
            "loss": metrics.loss,
        }
        Path(args.out).write_text(json.dumps(result))
    distributed.cleanup()


def launch(processes: int, args: Args) -> dict:
    """Run this script's worker under torchrun with ``processes`` ranks; rank 0's result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={processes}", __file__, "--worker", "--out", str(out),
            "--meta-batch", str(args.meta_batch), "--query", str(args.query),
            "--steps", str(args.steps), "--warmup", str(args.warmup),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise RuntimeError(f"{processes}-process run failed:\n{done.stderr[-3000:]}")
        return json.loads(out.read_text())


def main(args: Args) -> str:
    started = time.perf_counter()
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for _ in range(args.rounds):  # alternate, so slow spells of a shared machine hit both
        for n in (1, 2):
            runs[n].append(launch(n, args))
    print(f"MAML meta-step, Conv4, {WAYS}-way {SHOTS}-shot, {args.query} query/class, "
          f"{args.meta_batch} tasks per step (global), second order, 1 thread per process, "
          f"median of {args.steps} steps x {args.rounds} rounds")  # fmt: skip
    print()
    print("| processes | step ms | steps/s | compute ms | all_reduce ms | CPU ms/process "
          "| bytes all-reduced/step | vmapped tasks |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    summary = {}
    for n, results in runs.items():
        med = {k: statistics.median(r[k] for r in results) for k in results[0]}
        summary[n] = med
        print(f"| {n} | {1e3 * med['step_s']:.1f} | {1 / med['step_s']:.2f} | "
              f"{1e3 * med['compute_s']:.1f} | {1e3 * med['comm_s']:.2f} | "
              f"{1e3 * med['cpu_s_per_process']:.1f} | {int(med['allreduce_bytes']):,} | "
              f"{int(med['vectorized_tasks'])} |")  # fmt: skip
    efficiency = summary[1]["step_s"] / (2 * summary[2]["step_s"])
    grad = int(summary[2]["grad_bytes"])
    print()
    print(f"communication per step: one all_reduce of {grad:,} bytes (the meta-gradient, "
          f"float32, plus weight and flags) and one of {int(summary[2]['allreduce_bytes']) - grad}"
          f" bytes (metrics); a ring all_reduce sends 2(N-1)/N of that per rank: {grad:,} "
          f"bytes at N=2")  # fmt: skip
    work = summary[1]["cpu_s_per_process"] / (2 * summary[2]["cpu_s_per_process"])
    print(f"CPU work ratio (1-process CPU per step / total CPU of 2 processes): {work:.2f}; "
          "on a busy machine this shows what the wall-clock ratio cannot: how much work "
          "distributing adds")  # fmt: skip
    print(f"total wall time {time.perf_counter() - started:.0f} s")
    line = f"scaling_efficiency: {efficiency:.2f}"
    print(line)
    return line


@dataclasses.dataclass
class Args:
    """Arguments of bench_distributed.py (each is a --flag; see --help)."""

    meta_batch: int = 32
    """Global tasks per meta-step (at least 2, to shard over 2 processes)."""
    query: int = 1
    """Query examples per class."""
    steps: int = 20
    """Timed meta-steps per run."""
    warmup: int = 3
    """Untimed meta-steps first."""
    rounds: int = 2
    """Alternating 1- and 2-process runs."""
    worker: bool = False
    """Internal: run as one torchrun rank (the launcher passes it)."""
    out: str | None = None
    """Internal: where rank 0 writes its JSON result (the launcher passes it)."""


def parse_args(argv: Sequence[str] | None = None) -> Args:
    a = parse_args_as(Args, argv, __doc__)
    if a.meta_batch < 2:
        usage_error(f"--meta-batch must be >= 2 to shard over 2 processes, got {a.meta_batch}")
    if min(a.query, a.steps, a.rounds) < 1 or a.warmup < 0:
        usage_error(
            "--query, --steps and --rounds must be at least 1 and --warmup at least 0, got "
            f"{a.query}, {a.steps}, {a.rounds} and {a.warmup}"
        )
    if a.worker and a.out is None:
        usage_error("--worker needs --out, the file rank 0 writes its result to")
    return a


if __name__ == "__main__":
    parsed = parse_args()
    worker(parsed) if parsed.worker else main(parsed)
