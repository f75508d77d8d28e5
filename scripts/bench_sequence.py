"""Full MAML beside LoRA-MAML on the few-shot sequence task, a stock transformer, one run.

Both learners train ``--iterations`` meta-steps of ``experiments/sequence_maml.py`` (its own
`meta_step`, `make_model`, `make_learner` and `test`, loaded by path) from the same seed on
the same tasks, then are tested on the same held-out tasks. Printed, one row each: time per
meta-step (median over ``--repeats`` meta-steps timed round robin, the two learners
interleaved, on a fixed meta-batch), peak tensor memory of one meta-step above its start
(`benchtools.peak_memory_bytes`: the autograd graph of the meta-batch, the profiler's memory
events), the parameters the inner loop adapts, and the test accuracy with its 95% interval.
The meta-steps timed are not training steps: training starts after them from where they
left the learners, identically for both.

Command:
    python scripts/bench_sequence.py                   # about 8 minutes on 2 CPU cores
    python scripts/bench_sequence.py --iterations 20 --eval-tasks 20   # a smoke run
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from benchtools import (
    markdown_table,
    parse_args_as,
    peak_memory_bytes,
    run_header,
    time_round_robin,
    usage_error,
)

from metalearn.data.sequences import MarkovSequenceTasks
from metalearn.tools.experiments import load_file

# The experiment's own steps, from the experiment file beside scripts/ (loaded by its path).
ROOT = Path(__file__).resolve().parents[1]
experiment = load_file(ROOT / "experiments" / "sequence_maml.py", "sequence_maml")
LEARNERS = ("maml", "lora")  # full MAML, LoRA-MAML


@dataclass
class Args:
    """Arguments of bench_sequence.py (each is a --flag; see --help)."""

    iterations: int = 600
    """Meta-steps each learner trains."""
    eval_tasks: int = 300
    """Held-out test tasks."""
    repeats: int = 15
    """Timed meta-steps per learner."""
    threads: int = 1
    """Torch CPU threads."""
    seed: int = 0
    """Seeds the weights and the training tasks."""


def _run_args(a: Args, algorithm: str):
    return dataclasses.replace(experiment.Args(), algorithm=algorithm, iterations=a.iterations,
                               eval_tasks=a.eval_tasks, seed=a.seed, threads=a.threads,
                               track=False)  # fmt: skip


def parse_args(argv: Sequence[str] | None = None) -> Args:
    """The flags, each count checked (one line, exit status 2)."""
    a = parse_args_as(Args, argv, __doc__)
    for name in ("iterations", "eval_tasks", "repeats", "threads"):
        if getattr(a, name) < 1:
            usage_error(f"--{name.replace('_', '-')} {getattr(a, name)}: must be at least 1")
    return a


def main(argv: Sequence[str] | None = None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    runs = {name: _run_args(a, name) for name in LEARNERS}
    base = runs["maml"]
    data = MarkovSequenceTasks(ways=base.ways, shots=base.shots, queries=base.queries,
                               vocab=base.vocab, length=base.length,
                               sharpness=base.sharpness)  # fmt: skip
    learners, opts = {}, {}
    for name, args in runs.items():
        torch.manual_seed(a.seed)  # the same base weights for both
        learners[name] = experiment.make_learner(args, experiment.make_model(args))
        opts[name] = torch.optim.Adam(learners[name].parameters(), lr=args.outer_lr)
    fixed = data.batch(base.meta_batch, torch.Generator().manual_seed(a.seed + 100))
    steps = {n: (lambda n=n: experiment.meta_step(learners[n], opts[n], fixed)) for n in LEARNERS}
    times = time_round_robin(steps, a.repeats, 1, "cpu", time.perf_counter)
    peaks = {n: peak_memory_bytes(steps[n], "cpu") / 2**20 for n in LEARNERS}
    rows, started = [], time.perf_counter()
    for name in LEARNERS:
        gen = torch.Generator().manual_seed(a.seed)  # the same training tasks for both
        for _ in range(a.iterations):
            experiment.meta_step(learners[name], opts[name], data.batch(base.meta_batch, gen))
        acc, ci95 = experiment.test(learners[name], data, runs[name])
        adapted = learners[name].inner_loop().adapt_keys
        params = dict(learners[name].model.named_parameters())
        inner = sum(params[k].numel() for k in (adapted if adapted is not None else params))
        total = sum(p.numel() for p in params.values())
        rows.append([name, f"{1000 * statistics.median(times[name]):.0f}",
                     f"{peaks[name]:.1f}", f"{inner:,} of {total:,}",
                     f"{acc:.3f} ± {ci95:.3f}"])  # fmt: skip
    print(run_header())
    print(f"{base.ways}-way {base.shots}-shot Markov sequences (vocab {base.vocab}, length "
          f"{base.length}), transformer width {base.width}, {base.layers} layer(s); "
          f"{a.iterations} meta-steps of {base.meta_batch} tasks, inner lr {base.inner_lr}, "
          f"{base.inner_steps} step(s), test {base.test_steps} steps on {a.eval_tasks} tasks; "
          f"training took {(time.perf_counter() - started) / 60:.1f} min")  # fmt: skip
    ms = statistics.median(times["lora"]) / statistics.median(times["maml"])
    print(markdown_table(["learner", "ms / meta-step", "peak MB", "inner-loop parameters",
                          "test accuracy (95%)"], rows))  # fmt: skip
    print(f"LoRA-MAML's meta-step over MAML's: {ms:.2f}")


if __name__ == "__main__":
    main()
