"""MAML on sine-wave regression (Finn et al., 2017, Sec. 5.1), tracked in Weights & Biases.

What: meta-trains a 1-40-40-1 ReLU MLP so that one gradient step (lr 0.01) on K=10 points
of a new sine wave (amplitude 0.1-5, phase 0-pi, inputs in [-5, 5]) fits it; then reports the
query MSE after 1 and 10 adaptation steps on held-out tasks, against the same network
trained from scratch on the same points with the same steps, and saves a plot of adapted
curves.

Command:
    python experiments/sine_maml.py            # a few minutes on 2 CPU cores
    python experiments/sine_maml.py --help

Expected result: MAML's MSE after 1 step is far below the from-scratch network's (the paper's
Figure 2 shows the adapted curve tracking the sine after one step); the PNG is written to
``runs/sine_maml.png`` and logged to W&B.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from tqdm import tqdm

from metalearn.algorithms import MAML
from metalearn.data import SineTasks, sine
from metalearn.files import write_atomically
from metalearn.models import MLP
from metalearn.runs.cli import parse_dataclass
from metalearn.runs.lifecycle import Stopped, require, run_cli
from metalearn.runs.seeding import seed_everything
from metalearn.runs.tracking import check_mode, graceful_shutdown, init_run


@dataclass
class Args:
    """Arguments of the sine experiment (each is a --flag; see --help)."""

    iterations: int = 20_000
    """Meta-steps (the paper trains 70k)."""
    meta_batch: int = 25
    """Tasks per meta-step."""
    shots: int = 10
    """K: support (and query) points per task."""
    inner_lr: float = 0.01
    """Inner-loop learning rate alpha."""
    inner_steps: int = 1
    """Inner steps during meta-training."""
    outer_lr: float = 1e-3
    """Adam learning rate of the meta-update."""
    eval_tasks: int = 600
    """Held-out tasks for the reported MSE."""
    vectorize: Literal["auto", "vmap", "loop"] = "auto"
    """How a meta-batch runs."""
    seed: int = 0
    """Seeds weights and tasks."""
    threads: int = 1
    """Torch CPU threads; 1 is fastest for this tiny MLP (0: torch's default)."""
    out_dir: str = "runs"
    """Where the plot and the W&B folder go."""
    track: bool = True
    """Log to Weights & Biases (--no-track to skip)."""
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """auto: online when logged in and reachable, else offline."""
    wandb_project: str = "metalearn-sine"
    """W&B project."""


def make_model() -> torch.nn.Module:
    """MAML's regression network: two hidden layers of 40 ReLU units."""
    return MLP(1, [40, 40], 1)


def train(args: Args, learner: MAML, tasks: SineTasks, run: Any) -> None:
    """Meta-train with Adam; logs the meta-batch's query MSE."""
    opt = torch.optim.Adam(learner.parameters(), lr=args.outer_lr)
    gen = torch.Generator().manual_seed(args.seed)
    bar = tqdm(range(args.iterations), desc="meta-train", unit="step", dynamic_ncols=True)
    for it in bar:
        opt.zero_grad(set_to_none=True)
        metrics = learner.backward(tasks.batch(args.meta_batch, gen))
        opt.step()
        if it % 100 == 0:
            bar.set_postfix(mse=f"{metrics.loss:.3f}")
            if run is not None:
                run.log({"train/mse": metrics.loss}, step=it)


def evaluate(learner: MAML, scratch: MAML, tasks: SineTasks, n: int) -> dict[str, float]:
    """Query MSE after 1 and 10 steps, MAML's initialisation against a random one."""
    held_out = tasks.batch(n, torch.Generator().manual_seed(12345))
    results = {}
    for steps in (0, 1, 10):
        results[f"test/mse_{steps}step"] = learner.evaluate(held_out, steps=steps)[0].mean().item()
        results[f"test/scratch_mse_{steps}step"] = (
            scratch.evaluate(held_out, steps=steps)[0].mean().item()
        )
    return results


def plot(learner: MAML, scratch: MAML, tasks: SineTasks, path: Path) -> Path | None:
    """Three held-out tasks: truth, support points, and the adapted predictions; None (the
    plot skipped, said on stdout) where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install matplotlib): skipping the plot")
        return None

    gen = torch.Generator().manual_seed(7)
    x = torch.linspace(-5, 5, 200).unsqueeze(1)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax in axes:
        amplitude, phase = tasks.sample_function(gen)
        task = tasks.task(amplitude, phase, gen)
        ax.plot(x, sine(x, amplitude, phase), "k", lw=2, label="true")
        ax.plot(*task.support, "^", color="C3", label=f"{tasks.shots} support points")
        for steps, style in ((0, ":"), (1, "-"), (10, "--")):
            fast = learner.adapt(task, steps=steps)
            y = torch.func.functional_call(learner.model, fast, (x,)).detach()
            ax.plot(x, y, style, color="C0", label=f"MAML, {steps} step{'s' * (steps != 1)}")
        fast = scratch.adapt(task, steps=10)
        y = torch.func.functional_call(scratch.model, fast, (x,)).detach()
        ax.plot(x, y, "--", color="C2", label="scratch, 10 steps")
        ax.set(xlabel="x", title=f"A={amplitude:.2f}, phase={phase:.2f}")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    write_atomically(path, lambda file: fig.savefig(file, format="png", dpi=110), what="plot")
    plt.close(fig)
    return path


def main(args: Args) -> dict[str, float]:
    """Meta-train, evaluate against the scratch baseline, plot, log; returns the MSEs."""
    for name in ("iterations", "meta_batch", "shots", "inner_steps", "eval_tasks"):
        require(
            getattr(args, name) >= 1,
            f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1",
        )
    for name in ("inner_lr", "outer_lr"):
        require(
            getattr(args, name) > 0,
            f"--{name.replace('_', '-')} {getattr(args, name)}: must be positive",
        )
    require(
        args.threads >= 0, f"--threads {args.threads}: must be at least 1, or 0 for torch's default"
    )
    if args.track:
        check_mode(args.wandb_mode)  # online needs a key: refused before training
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    seed_everything(args.seed)
    common = dict(inner_lr=args.inner_lr, inner_steps=args.inner_steps, loss_fn=F.mse_loss,
                  vectorize=args.vectorize)  # fmt: skip
    learner, scratch = MAML(make_model(), **common), MAML(make_model(), **common)
    tasks = SineTasks(shots=args.shots)
    run = None
    if args.track:
        run = init_run(dataclasses.asdict(args), project=args.wandb_project,
                       mode=args.wandb_mode, dir=args.out_dir, group="sine-maml",
                       tags=["maml", "sine"])  # fmt: skip
    started, exit_code = time.perf_counter(), 1
    try:
        with graceful_shutdown():
            train(args, learner, tasks, run)
        results = evaluate(learner, scratch, tasks, args.eval_tasks)
        results["perf/train_minutes"] = (time.perf_counter() - started) / 60
        png = plot(learner, scratch, tasks, Path(args.out_dir) / "sine_maml.png")
        if run is not None:
            run.summary.update(results)
            if png is not None:
                import wandb

                run.log({"test/adapted_curves": wandb.Image(str(png))})
        exit_code = 0
    except Stopped as stop:  # SIGTERM / Ctrl-C: the W&B run ends failed, with the signal's code
        exit_code = stop.exit_code
        raise
    finally:
        if run is not None:
            run.finish(exit_code=exit_code)
    print(f"{'steps':>5} {'MAML MSE':>10} {'scratch MSE':>12}")
    for steps in (0, 1, 10):
        print(f"{steps:>5} {results[f'test/mse_{steps}step']:>10.3f}"
              f" {results[f'test/scratch_mse_{steps}step']:>12.3f}")  # fmt: skip
    if png is not None:
        print(f"plot: {png}")
    return results


if __name__ == "__main__":
    run_cli(main, lambda: parse_dataclass(Args, description=__doc__.split("\n\n")[0]))
