"""MAML, LoRA-MAML or ANIL on few-shot sequence classification, a stock transformer.

What: meta-trains a small `nn.TransformerEncoder` classifier (`metalearn.models.sequence`)
on N-way K-shot tasks whose classes are random Markov chains over a few tokens
(`metalearn.data.sequences`: every class new, the tasks generated from the seed), with
second-order MAML by default; then reports the query accuracy after adaptation on held-out
tasks with a 95% interval. ``--algorithm`` takes any learner with an inner loop. Second
order through attention runs its math kernel in the inner loop, first order the fused one
(`metalearn.attention`).

Command:
    python experiments/sequence_maml.py                           # a few minutes on 2 CPU cores
    python experiments/sequence_maml.py --algorithm lora          # LoRA-MAML: adapters + head
    python experiments/sequence_maml.py --help

Expected result: the test accuracy is well above chance (1 / ways) after adaptation;
docs/benchmarks.md ("Transformers on a few-shot sequence task") has MAML beside LoRA-MAML
(``scripts/bench_sequence.py``).

The file reads top to bottom: the arguments (`Args`), the network and the learner
(`make_model`, `make_learner`), the loop's steps (`meta_step`, `test`) and `main`, which runs
the loop itself.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Literal

import torch
from tqdm import tqdm

from metalearn.algorithms import MetaLearner, StepMetrics
from metalearn.algorithms.registry import Algorithm, can, learner_arguments
from metalearn.algorithms.registry import make_learner as build_learner
from metalearn.data.sequences import MarkovSequenceTasks
from metalearn.models.sequence import SequenceTransformer
from metalearn.runs.cli import parse_dataclass
from metalearn.runs.evaluation import TEST_SEED, accuracy_interval
from metalearn.runs.lifecycle import Stopped, UserError, require, run_cli
from metalearn.runs.seeding import seed_everything
from metalearn.runs.tracking import check_mode, graceful_shutdown, init_run


@dataclass
class Args:
    """Arguments of the sequence experiment (each is a --flag; see --help)."""

    algorithm: Algorithm = "maml"
    """The meta-learner, any with an inner loop (``lora``: LoRA-MAML); the tests hold MAML's,
    ANIL's and LoRA-MAML's meta-gradients on this network to a written-out reference."""
    iterations: int = 600
    """Meta-steps."""
    meta_batch: int = 8
    """Tasks per meta-step."""
    ways: int = 5
    """Classes per task."""
    shots: int = 5
    """Support sequences per class."""
    queries: int = 5
    """Query sequences per class."""
    vocab: int = 8
    """Tokens of the Markov chains."""
    length: int = 16
    """Tokens per sequence."""
    sharpness: float = 2.0
    """Scale of the chains' transition logits (0: every class the uniform chain)."""
    width: int = 32
    """The transformer's width."""
    heads: int = 2
    """Attention heads."""
    layers: int = 1
    """Encoder layers."""
    ffn: int = 64
    """Feed-forward width of each layer."""
    inner_lr: float = 0.1
    """Inner-loop learning rate on the mean support loss."""
    inner_steps: int = 1
    """Inner steps in training."""
    test_steps: int = 3
    """Inner steps at test time."""
    lora_rank: int = 4
    """LoRA-MAML's adapter rank."""
    outer_lr: float = 1e-3
    """Adam learning rate of the meta-update."""
    eval_tasks: int = 300
    """Held-out tasks for the reported accuracy."""
    vectorize: Literal["auto", "vmap", "loop"] = "auto"
    """How a meta-batch runs (second order through layer norm runs the loop)."""
    seed: int = 0
    """Seeds the weights and the training tasks (the test tasks have their own seed)."""
    threads: int = 1
    """Torch CPU threads (0: torch's default)."""
    out_dir: str = "runs"
    """Where the W&B folder goes."""
    track: bool = True
    """Log to Weights & Biases (--no-track to skip)."""
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """auto: online when logged in and reachable, else offline."""
    wandb_project: str = "metalearn-sequence"
    """W&B project."""


def make_model(args: Args) -> SequenceTransformer:
    """The classifier: embedding, a stock transformer encoder, mean pooling, a linear head."""
    return SequenceTransformer(args.vocab, args.ways, args.length, width=args.width,
                               heads=args.heads, layers=args.layers, ffn=args.ffn)  # fmt: skip


def make_learner(args: Args, model: SequenceTransformer) -> MetaLearner:
    """The chosen meta-learner on ``model`` (LoRA-MAML holds its own adapted copy), given the
    settings below that its constructor takes, the others at its defaults."""
    offered = dict(inner_lr=args.inner_lr, inner_steps=args.inner_steps,
                   vectorize=args.vectorize, lora_rank=args.lora_rank)  # fmt: skip
    taken = learner_arguments(args.algorithm)
    try:
        return build_learner(
            args.algorithm, model, {k: v for k, v in offered.items() if k in taken}
        )
    except ValueError as error:
        raise UserError(f"--algorithm {args.algorithm}: {error}") from None


def meta_step(learner: MetaLearner, opt: torch.optim.Optimizer, tasks: list) -> StepMetrics:
    """One outer step: the meta-gradient of the meta-batch into ``.grad``, then Adam."""
    opt.zero_grad(set_to_none=True)
    metrics = learner.backward(tasks)
    opt.step()
    return metrics


def test(learner: MetaLearner, data: MarkovSequenceTasks, args: Args) -> tuple[float, float]:
    """Query accuracy after ``test_steps`` inner steps on held-out tasks, and its 95% interval."""
    tasks = data.batch(args.eval_tasks, torch.Generator().manual_seed(TEST_SEED))
    accuracies = torch.cat([learner.evaluate(tasks[i : i + 50], steps=args.test_steps)[1]
                            for i in range(0, len(tasks), 50)])  # fmt: skip
    return accuracies.mean().item(), accuracy_interval(accuracies)


def check(args: Args) -> None:
    """Refuse arguments out of range, one line each (exit status 2)."""
    for name in ("iterations", "meta_batch", "ways", "shots", "queries", "length", "width",
                 "heads", "layers", "ffn", "inner_steps", "lora_rank", "eval_tasks"):  # fmt: skip
        value = getattr(args, name)
        require(value >= 1, f"--{name.replace('_', '-')} {value}: must be at least 1")
    require(can(args.algorithm, "inner_loop"), f"--algorithm {args.algorithm}: has no inner "
            "loop; this experiment adapts by one (maml, for instance)")  # fmt: skip
    require(args.test_steps >= 0, f"--test-steps {args.test_steps}: must be at least 0")
    require(args.vocab >= 2, f"--vocab {args.vocab}: a Markov chain needs at least 2 tokens")
    require(args.sharpness >= 0, f"--sharpness {args.sharpness}: must be at least 0")
    require(args.width % args.heads == 0,
            f"--width {args.width}: must be divisible by --heads {args.heads}")  # fmt: skip
    for name in ("inner_lr", "outer_lr"):
        value = getattr(args, name)
        require(value > 0, f"--{name.replace('_', '-')} {value}: must be positive")
    require(args.threads >= 0,
            f"--threads {args.threads}: must be at least 1, or 0 for torch's default")  # fmt: skip


def main(args: Args) -> dict[str, float]:
    """Meta-train, test, log; returns the test accuracy, its interval and the step time."""
    check(args)
    if args.track:
        check_mode(args.wandb_mode)  # online needs a key: refused before training
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    data = MarkovSequenceTasks(ways=args.ways, shots=args.shots, queries=args.queries,
                               vocab=args.vocab, length=args.length,
                               sharpness=args.sharpness)  # fmt: skip
    learner = make_learner(args, make_model(args))
    opt = torch.optim.Adam(learner.parameters(), lr=args.outer_lr)
    gen = torch.Generator().manual_seed(args.seed)
    run = None
    if args.track:
        run = init_run(dataclasses.asdict(args), project=args.wandb_project,
                       mode=args.wandb_mode, dir=args.out_dir, group=f"sequence-{args.algorithm}",
                       tags=[args.algorithm, "sequence"])  # fmt: skip
    exit_code, results = 1, {}
    try:
        with graceful_shutdown():
            started = time.perf_counter()
            bar = tqdm(range(args.iterations), desc=args.algorithm, unit="step", dynamic_ncols=True)
            for step in bar:
                metrics = meta_step(learner, opt, data.batch(args.meta_batch, gen))
                if step % 50 == 0:
                    bar.set_postfix(loss=f"{metrics.loss:.3f}", acc=f"{metrics.accuracy:.3f}")
                    if run is not None:
                        run.log({"train/loss": metrics.loss, "train/acc": metrics.accuracy},
                                step=step)  # fmt: skip
            step_s = (time.perf_counter() - started) / args.iterations
        acc, ci95 = test(learner, data, args)
        results = {"test/acc": acc, "test/acc_ci95": ci95, "perf/step_s": step_s}
        if run is not None:
            run.summary.update(results)
        exit_code = 0
    except Stopped as stop:  # SIGTERM / Ctrl-C: the W&B run ends failed, with the signal's code
        exit_code = stop.exit_code
        raise
    finally:
        if run is not None:
            run.finish(exit_code=exit_code)
    print(f"{args.algorithm}: test/acc: {acc:.3f} ± {ci95:.3f} ({args.eval_tasks} tasks, "
          f"{args.ways}-way {args.shots}-shot, {args.test_steps} steps; "
          f"{1000 * step_s:.0f} ms per meta-step)")  # fmt: skip
    return results


if __name__ == "__main__":
    run_cli(main, lambda: parse_dataclass(Args, description=__doc__.split("\n\n")[0]))
