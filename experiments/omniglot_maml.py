"""MAML (and family) on Omniglot, N-way K-shot, tracked in Weights & Biases.

What: meta-trains the conv4 network of Finn et al. (2017) on Omniglot with the chosen
algorithm, validates during training and keeps the best-validation weights, then reports
the test accuracy over 600 test tasks with a 95% confidence interval.

Command:
    python experiments/omniglot_maml.py                         # CPU-sized default run
    python experiments/omniglot_maml.py --preset paper-5w1s     # the paper's setting (GPU)
    python experiments/omniglot_maml.py --algorithm anil --ways 20 --shots 1
    python experiments/omniglot_maml.py --resume                # continue a stopped run
    python experiments/omniglot_maml.py --help                  # every option
    torchrun --nproc_per_node=2 experiments/omniglot_maml.py    # 2 processes (docs/distributed.md)

Data: ``--data-root`` or ``$METALEARN_DATA`` pointing at the extracted Omniglot folder
(``images_background/``, ``images_evaluation/``); downloaded when absent and the network
allows. Expected result of the default run (5-way 1-shot, 2 CPU cores, see README.md):
about 15 minutes, test accuracy printed as ``test/acc: 0.9xx ± 0.00x``.

Under ``torchrun`` each rank computes the meta-gradient of its share of every meta-batch
and the shares are averaged (`metalearn.distributed`); every rank draws the same global
meta-batch, so N processes train on exactly the tasks one process sees. Rank 0 alone logs,
writes checkpoints and shows progress; evaluation tasks are split across ranks.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm

from metalearn import distributed, tune_malloc
from metalearn.algorithms import MetaLearner, build_learner
from metalearn.checkpoint import load_checkpoint, save_checkpoint
from metalearn.cli import parse_dataclass
from metalearn.data import EpisodicSampler, load_omniglot, omniglot_samplers
from metalearn.tracking import graceful_shutdown, init_run


@dataclass
class Args:
    """Arguments of the Omniglot experiment (each is a --flag; see --help)."""

    preset: Literal["cpu", "paper-5w1s", "paper-5w5s", "paper-20w1s", "paper-20w5s"] = "cpu"
    """Named configuration: cpu (about 15 min on 2 cores) or the MAML paper's settings."""
    algorithm: Literal["maml", "fomaml", "anil", "metasgd", "mamlpp", "imaml", "reptile"] = "maml"
    """Meta-learning algorithm."""
    ways: int = 5
    """N: classes per task."""
    shots: int = 1
    """K: support examples per class."""
    query: int = 5
    """Query examples per class during meta-training."""
    eval_query: int = 15
    """Query examples per class for validation and test tasks."""
    meta_batch: int = 16
    """Tasks per meta-step."""
    iterations: int = 2500
    """Meta-steps."""
    inner_lr: float = 0.4
    """Inner-loop learning rate (MAML's alpha)."""
    inner_steps: int = 1
    """Inner steps during meta-training."""
    eval_inner_steps: int = 10
    """Inner steps at validation and test time."""
    outer_lr: float = 1e-3
    """Adam learning rate of the meta-update (Reptile: its epsilon, with SGD)."""
    hidden: int = 64
    """Filters per conv layer."""
    vectorize: Literal["auto", "vmap", "loop"] = "auto"
    """How a meta-batch runs: vmap, a Python loop, or auto (by workload)."""
    split: Literal["maml", "alphabet"] = "maml"
    """maml: 1100/100/423 characters with rotations; alphabet: background vs evaluation."""
    val_every: int = 250
    """Meta-steps between validations (the best-validation weights are tested)."""
    val_tasks: int = 200
    """Validation tasks per validation."""
    test_tasks: int = 600
    """Test tasks for the final accuracy and its 95% confidence interval."""
    checkpoint_every: int = 250
    """Meta-steps between checkpoints (also written on Ctrl-C / SIGTERM)."""
    seed: int = 0
    """Seeds the initial weights and the task sampling."""
    data_root: str | None = None
    """Omniglot folder; default $METALEARN_DATA, else the cache dir (downloaded)."""
    out_dir: str = "runs"
    """Where checkpoints and the W&B folder go."""
    run_name: str | None = None
    """Run name (default: algorithm-NwKs-seedS); --resume looks for it in out_dir."""
    resume: bool = False
    """Continue the run named run_name from its last checkpoint."""
    track: bool = True
    """Log to Weights & Biases (--no-track to skip)."""
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """auto: online when logged in and reachable, else offline."""
    wandb_project: str = "metalearn-omniglot"
    """W&B project."""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """Torch device."""
    threads: int = 1
    """Torch CPU threads (0: torch's default). 1 is robust on small shared machines: with
    other load, 2 threads made tiny per-task ops up to 7x slower here."""
    tune_malloc: bool = True
    """Keep freed memory for reuse (`metalearn.tune_malloc`, glibc only): a meta-step's
    large activations stop costing page faults; resident memory stays near its peak.
    --no-tune-malloc keeps malloc's defaults."""
    dist_timeout: float = 600.0
    """Under torchrun: seconds a rank waits for the others in a collective before the job
    fails, so a stalled rank ends the job (then --resume) instead of hanging it."""


# The MAML paper's Omniglot settings (Finn et al., 2017, Sec. 5.2 and appendix A.1).
PAPER = dict(iterations=60_000, query=1, eval_query=1, inner_steps=1, eval_inner_steps=10,
             outer_lr=1e-3, val_every=1000, checkpoint_every=1000, val_tasks=600)  # fmt: skip
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {},
    "paper-5w1s": {**PAPER, "ways": 5, "shots": 1, "meta_batch": 32, "inner_lr": 0.4},
    "paper-5w5s": {**PAPER, "ways": 5, "shots": 5, "meta_batch": 32, "inner_lr": 0.4},
    "paper-20w1s": {**PAPER, "ways": 20, "shots": 1, "meta_batch": 16, "inner_lr": 0.1,
                    "inner_steps": 5},
    "paper-20w5s": {**PAPER, "ways": 20, "shots": 5, "meta_batch": 16, "inner_lr": 0.1,
                    "inner_steps": 5},
}  # fmt: skip


def make_learner(args: Args) -> MetaLearner:
    """The algorithm around a fresh conv4 (seeded by args.seed).

    `metalearn.algorithms.build_learner` holds the construction (iMAML with ``cg_damping=10``:
    conv4's adapted support Hessian has eigenvalues below -lambda), so a deployed checkpoint
    is rebuilt exactly as it was trained.
    """
    torch.manual_seed(args.seed)
    return build_learner(dataclasses.asdict(args)).to(args.device)


def make_optimizer(args: Args, learner: MetaLearner) -> torch.optim.Optimizer:
    """Adam on every learnable tensor (Reptile: plain SGD, its outer step epsilon)."""
    if args.algorithm == "reptile":
        return torch.optim.SGD(learner.parameters(), lr=args.outer_lr)
    return torch.optim.Adam(learner.parameters(), lr=args.outer_lr)


def evaluate(
    learner: MetaLearner, sampler: EpisodicSampler, n_tasks: int, steps: int, seed: int
) -> tuple[float, float]:
    """Mean query accuracy over ``n_tasks`` tasks and its 95% confidence half-width.

    The tasks come from a generator seeded with ``seed``, so every evaluation of a run sees
    the same tasks and validation curves compare like with like.
    Under torchrun every rank draws the same tasks, evaluates its share of each chunk, and
    the accuracies are gathered in task order, so every rank returns the same numbers.
    """
    gen = torch.Generator().manual_seed(seed)  # the sampler draws indices on the CPU
    accs = []
    for start in range(0, n_tasks, 50):
        classes, examples = sampler.sample_indices(gen, min(50, n_tasks - start))
        part = distributed.shard_slice(len(classes))
        local = torch.empty(0)
        if part.stop > part.start:
            tasks = sampler.tasks_from_indices(classes[part], examples[part])
            local = learner.evaluate(tasks, steps=steps)[1]
        accs.append(distributed.gather_tensor(local.float()))
    acc = torch.cat(accs).double()
    half = 1.96 * acc.std().item() / math.sqrt(len(acc)) if len(acc) > 1 else float("nan")
    return acc.mean().item(), half


def train(args: Args, learner: MetaLearner, samplers: dict, state: dict, run: Any) -> dict:
    """Meta-train from ``state`` (fresh or resumed); returns the final state."""
    opt = make_optimizer(args, learner)
    if (saved_opt := state.pop("optimizer", None)) is not None:
        opt.load_state_dict(saved_opt)
    gen = torch.Generator().manual_seed(args.seed)
    if (saved_gen := state.pop("generator", None)) is not None:
        gen.set_state(saved_gen)
    ckpt_path = Path(args.out_dir) / state["run_name"] / "checkpoint.pt"
    bar = tqdm(
        range(state["iteration"], args.iterations),
        initial=state["iteration"],
        total=args.iterations,
        desc="meta-train",
        unit="step",
        dynamic_ncols=True,
        disable=not distributed.is_main(),
    )
    snapshot = _snapshot(learner, opt, gen, state)
    try:
        for it in bar:
            start = time.perf_counter()
            tasks = _my_tasks(samplers["train"], args.meta_batch, gen)
            opt.zero_grad(set_to_none=True)
            metrics = learner.backward(tasks)
            metrics = distributed.average_meta_step(learner, metrics, len(tasks))
            opt.step()
            seconds = time.perf_counter() - start
            row = {
                "train/loss": metrics.loss,
                "train/acc": metrics.accuracy,
                "perf/step_s": seconds,
                "perf/tasks_per_s": args.meta_batch / seconds,
                "perf/vectorized_tasks": metrics.vectorized,
                "train/skipped": metrics.skipped,
            }
            if (it + 1) % args.val_every == 0 or it + 1 == args.iterations:
                row.update(validate(args, learner, samplers, state, it + 1))
            state["iteration"] = it + 1
            # Everything a resumed run needs, taken only at step boundaries, so an interrupt
            # anywhere inside a step resumes from the last *completed* one.
            snapshot = _snapshot(learner, opt, gen, state)
            if run is not None:
                run.log(row, step=state["iteration"])
            bar.set_postfix(loss=f"{metrics.loss:.3f}", acc=f"{metrics.accuracy:.3f}",
                            val=f"{state['best_val']:.3f}")  # fmt: skip
            if state["iteration"] % args.checkpoint_every == 0:
                distributed.check_same(learner.parameters())  # a diverged rank fails loudly
                if distributed.is_main():
                    save_checkpoint(ckpt_path, {"args": dataclasses.asdict(args), **snapshot})
    finally:
        # Ctrl-C / SIGTERM / an error: keep the last completed step, so --resume continues.
        # No collective here: the other ranks may be gone.
        if distributed.is_main():
            with _signals_held():
                save_checkpoint(ckpt_path, {"args": dataclasses.asdict(args), **snapshot})
    return state


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM until the block ends, then raise KeyboardInterrupt if one came.

    When one rank fails, torchrun sends SIGTERM to the others, often while rank 0 is
    writing its final checkpoint: without this the write is cut short (atomic, so the
    previous checkpoint survives, but the last steps are lost).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if held:
        raise KeyboardInterrupt(f"received signal {held[0]}")


def _my_tasks(sampler: EpisodicSampler, meta_batch: int, gen: torch.Generator) -> list:
    """This rank's share of the global meta-batch (all of it in a single process).

    Every rank draws the whole meta-batch's indices from the same generator (microseconds
    per task) and builds only its own tasks, so N ranks train on exactly the tasks one
    process would, and the generator state is the same on every rank (resume, any N).
    """
    classes, examples = sampler.sample_indices(gen, meta_batch)
    part = distributed.shard_slice(meta_batch)
    return sampler.tasks_from_indices(classes[part], examples[part])


def _snapshot(learner: MetaLearner, opt, gen: torch.Generator, state: dict) -> dict:
    """A copy of the run's state at a step boundary (CPU tensors; cheap next to a step)."""
    return copy.deepcopy({
        **state, "learner": _cpu_state(learner), "optimizer": opt.state_dict(),
        "generator": gen.get_state(), "torch_rng": torch.get_rng_state(),
    })  # fmt: skip


def validate(args: Args, learner: MetaLearner, samplers: dict, state: dict, iteration: int) -> dict:
    """Validation accuracy; remembers the best weights (or the latest, with no val split)."""
    sampler = samplers.get("val")
    if sampler is None:  # the alphabet split with no held-out alphabets: keep the latest
        state["best_learner"] = _cpu_state(learner)
        return {}
    acc, half = evaluate(learner, sampler, args.val_tasks, args.eval_inner_steps, seed=1)
    if acc > state["best_val"]:
        state["best_val"], state["best_iteration"] = acc, iteration
        state["best_learner"] = _cpu_state(learner)
    return {"val/acc": acc, "val/acc_ci95": half, "val/best_acc": state["best_val"]}


def _cpu_state(learner: MetaLearner) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in learner.state_dict().items()}


def initial_state(args: Args, learner: MetaLearner) -> dict:
    """A fresh run's state, or the checkpoint's when resuming."""
    name = args.run_name or f"{args.algorithm}-{args.ways}w{args.shots}s-seed{args.seed}"
    path = Path(args.out_dir) / name / "checkpoint.pt"
    # Rank 0 reads (only its machine need hold the file) and every rank gets its answer.
    saved = distributed.from_main(_read_start, path, args.resume)
    if saved is not None:
        learner.load_state_dict(saved.pop("learner"))
        torch.set_rng_state(saved.pop("torch_rng"))
        saved.pop("args")
        return saved
    return {"run_name": name, "iteration": 0, "best_val": -1.0, "best_iteration": 0,
            "best_learner": None, "wandb_id": None}  # fmt: skip


def _read_start(path: Path, resume: bool) -> dict | None:
    """The checkpoint to resume from, or None for a fresh run (refusing to overwrite one)."""
    if resume:
        return load_checkpoint(path)  # raises FileNotFoundError naming the path and fix
    if path.exists():
        raise FileExistsError(
            f"{path} exists: pass --resume to continue that run, or --run-name NEW for a new one"
        )
    return None


def main(args: Args) -> dict[str, float]:
    """Meta-train, test the best-validation weights, log everything; returns the results."""
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.tune_malloc:
        tune_malloc()
    dist = distributed.init_from_env(device=args.device, timeout_s=args.dist_timeout)
    try:
        return _main(dataclasses.replace(args, device=str(dist.device)) if dist.distributed
                     else args, dist)  # fmt: skip
    finally:
        distributed.cleanup()


def _main(args: Args, dist: distributed.DistInfo) -> dict[str, float]:
    if args.meta_batch < dist.world_size:
        raise ValueError(
            f"meta_batch={args.meta_batch} is below the {dist.world_size} processes: every "
            "rank needs a task; raise --meta-batch or launch fewer processes"
        )
    with distributed.main_first():  # one process per machine fills the cache (or downloads)
        data = load_omniglot(args.data_root)
    samplers = omniglot_samplers(data, args.split, ways=args.ways, shots=args.shots,
                                 queries=args.query, device=args.device)  # fmt: skip
    eval_samplers = omniglot_samplers(data, args.split, ways=args.ways, shots=args.shots,
                                      queries=args.eval_query, device=args.device)  # fmt: skip
    samplers.update({k: v for k, v in eval_samplers.items() if k != "train"})
    learner = make_learner(args)
    state = initial_state(args, learner)
    distributed.broadcast_params(learner)  # every rank starts from rank 0's weights
    run = None
    if args.track and dist.is_main:
        run = init_run(
            {**dataclasses.asdict(args), "dataset": "omniglot", "params": _count(learner),
             "world_size": dist.world_size},
            project=args.wandb_project, mode=args.wandb_mode, name=state["run_name"],
            group=f"{args.algorithm}-{args.ways}w{args.shots}s",
            tags=[args.algorithm, "omniglot", f"{args.ways}w{args.shots}s", args.split],
            dir=args.out_dir, run_id=state.get("wandb_id"),
        )  # fmt: skip
        state["wandb_id"] = run.id if run is not None else None
    started = time.perf_counter()
    try:
        with graceful_shutdown():
            state = train(args, learner, samplers, state, run)
            results = test(args, learner, samplers, state)
        results["perf/total_minutes"] = (time.perf_counter() - started) / 60
        if run is not None:
            run.summary.update(results)
    except (KeyboardInterrupt, distributed.PeerError):
        where = f"rank {dist.rank}: " if dist.distributed else ""
        print(
            f"\n{where}stopped at step {state['iteration']}; continue with --resume "
            f"--run-name {state['run_name']}"
        )
        raise
    finally:
        if run is not None:
            run.finish()
    if dist.is_main:
        print(" ".join(f"{k}: {v:.4f}" for k, v in results.items() if k != "test/acc_ci95"))
        print(f"test/acc: {results['test/acc']:.4f} ± {results['test/acc_ci95']:.4f}")
    return results


def test(args: Args, learner: MetaLearner, samplers: dict, state: dict) -> dict[str, float]:
    """Accuracy of the best-validation weights on ``args.test_tasks`` test tasks."""
    if state.get("best_learner") is not None:
        learner.load_state_dict(state["best_learner"])
    acc, half = evaluate(learner, samplers["test"], args.test_tasks, args.eval_inner_steps, 2)
    return {"test/acc": acc, "test/acc_ci95": half, "test/best_iteration": state["best_iteration"]}


def _count(learner: MetaLearner) -> int:
    return sum(p.numel() for p in learner.parameters())


if __name__ == "__main__":
    main(parse_dataclass(Args, description=__doc__.split("\n\n")[0], presets=PRESETS))
