"""Sharpness during full-batch gradient descent, tracked with metalearn's HVP tools.

What: trains a small tanh MLP by full-batch gradient descent on a fixed regression set and,
every few steps, measures the Hessian's top eigenvalue (Lanczos on forward-over-reverse
HVPs) and its trace (Hutchinson). Cohen et al. (2021, "Gradient Descent on Neural Networks
Typically Occurs at the Edge of Stability") observed that the top eigenvalue rises until it
reaches 2 / learning-rate and then hovers there; this run lets you see that for yourself.

Command:
    python experiments/curvature_demo.py            # about a minute on 2 CPU cores
    python experiments/curvature_demo.py --help     # every option

Expected result: the printed "sharpness" column climbs towards 2/lr (40 at lr 0.05) while the
loss falls, then stays near it; a PNG of both curves is written to ``runs/``. The run is
logged to Weights & Biases (offline unless you are logged in; ``--wandb-mode disabled`` to
skip it).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad
from tqdm import tqdm

from metalearn import hessian_trace, top_eigenvalues
from metalearn.files import write_atomically
from metalearn.runs.cli import parse_dataclass
from metalearn.runs.lifecycle import run_cli
from metalearn.runs.metrics import TRAIN_LOSS
from metalearn.runs.tracking import check_mode, init_run


@dataclass
class Config:
    """Arguments of the curvature demo (each becomes a --flag)."""

    steps: int = 1500
    """Full-batch gradient-descent steps."""
    lr: float = 0.05
    """Learning rate; the edge of stability sits at sharpness 2 / lr."""
    width: int = 64
    """Hidden units in each of the two tanh layers."""
    n_points: int = 256
    """Training points, drawn once from a fixed sine mixture on [-5, 5]."""
    measure_every: int = 50
    """Steps between curvature measurements."""
    lanczos_iters: int = 20
    """HVPs per top-eigenvalue estimate."""
    trace_samples: int = 10
    """Rademacher probes per Hutchinson trace estimate."""
    seed: int = 0
    """Seeds data, initial weights and probes."""
    out_dir: str = "runs"
    """Where the plot (and the W&B offline run) is written."""
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """auto: $WANDB_MODE if set, else online when logged in and reachable, else offline."""
    wandb_project: str = "metalearn"
    """W&B project name."""


def make_data(cfg: Config, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Inputs [n, 1] and targets [n, 1] from a fixed mixture of three sines."""
    x = torch.rand(cfg.n_points, 1, generator=generator) * 10 - 5
    y = torch.sin(x) + 0.5 * torch.sin(2.3 * x + 1.0) + 0.3 * torch.cos(4.1 * x)
    return x, y


def make_model(cfg: Config) -> nn.Module:
    """A 1 -> width -> width -> 1 tanh MLP."""
    return nn.Sequential(
        nn.Linear(1, cfg.width), nn.Tanh(), nn.Linear(cfg.width, cfg.width), nn.Tanh(),
        nn.Linear(cfg.width, 1),
    )  # fmt: skip


def measure(loss_fn, params: dict[str, Tensor], cfg: Config, gen: torch.Generator) -> dict:
    """Top Hessian eigenvalue and Hutchinson trace at ``params``."""
    top = top_eigenvalues(loss_fn, params, k=1, max_iter=cfg.lanczos_iters, generator=gen)
    trace = hessian_trace(loss_fn, params, samples=cfg.trace_samples, generator=gen)
    return {
        "curvature/sharpness": float(top.eigenvalues[0]),
        "curvature/trace": trace.estimate,
        "curvature/trace_stderr": trace.std_error,
    }


def train(cfg: Config, run=None) -> list[dict]:
    """Full-batch GD with periodic curvature measurements; returns the measured rows."""
    gen = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    x, y = make_data(cfg, gen)
    model = make_model(cfg)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_fn(p: dict[str, Tensor]) -> Tensor:
        return 0.5 * ((functional_call(model, p, (x,)) - y) ** 2).mean()

    rows = []
    bar = tqdm(range(cfg.steps + 1), desc="GD", unit="step")
    for step in bar:
        if step % cfg.measure_every == 0:
            row = {"step": step, TRAIN_LOSS: float(loss_fn(params))}
            row.update(measure(loss_fn, params, cfg, gen))
            rows.append(row)
            bar.set_postfix(loss=f"{row['train/loss']:.4f}", sharp=row["curvature/sharpness"])
            if run is not None:
                run.log(row, step=step)
        if step < cfg.steps:
            g = grad(loss_fn)(params)
            params = {k: p - cfg.lr * g[k] for k, p in params.items()}
            if not math.isfinite(float(loss_fn(params))):
                raise FloatingPointError(f"loss became non-finite at step {step}; lower --lr")
    return rows


def plot(rows: list[dict], cfg: Config, path: Path) -> Path | None:
    """Loss and sharpness against step, with the 2/lr line; None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install matplotlib): skipping the plot")
        return None
    steps = [r["step"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.5))
    ax1.semilogy(steps, [r[TRAIN_LOSS] for r in rows])
    ax1.set(xlabel="step", ylabel="training loss", title="loss")
    ax2.plot(steps, [r["curvature/sharpness"] for r in rows], label="top eigenvalue")
    ax2.axhline(2 / cfg.lr, color="k", ls="--", label="2 / lr")
    ax2.set(xlabel="step", ylabel="sharpness", title="Hessian top eigenvalue (Lanczos)")
    ax2.legend()
    fig.tight_layout()
    write_atomically(path, lambda file: fig.savefig(file, format="png", dpi=120), what="plot")
    plt.close(fig)
    return path


def main(cfg: Config) -> list[dict]:
    """Run the demo: train, print a table, save a plot, log to W&B."""
    check_mode(cfg.wandb_mode)  # online needs a key: refused before training
    run = init_run(
        dataclasses.asdict(cfg), project=cfg.wandb_project, mode=cfg.wandb_mode,
        dir=cfg.out_dir, group="curvature_demo", tags=["hvp", "curvature"],
    )  # fmt: skip
    start = time.perf_counter()
    try:
        rows = train(cfg, run)
    finally:
        if run is not None:
            run.finish()
    print(f"\n{'step':>6} {'loss':>10} {'sharpness':>10} {'2/lr':>6} {'trace':>16}")
    for r in rows:
        trace = f"{r['curvature/trace']:.1f} ± {r['curvature/trace_stderr']:.1f}"
        print(
            f"{r['step']:>6} {r['train/loss']:>10.5f} {r['curvature/sharpness']:>10.2f}"
            f" {2 / cfg.lr:>6.1f} {trace:>16}"
        )
    png = plot(rows, cfg, Path(cfg.out_dir) / "curvature_demo.png")
    print(f"\n{time.perf_counter() - start:.1f} s" + (f"; plot: {png}" if png else ""))
    return rows


def parse_args(argv: list[str] | None = None) -> Config:
    """Build a Config from --flags named after its fields (help text from the docstrings)."""
    return parse_dataclass(Config, argv, description=__doc__.split("\n\n")[0])


if __name__ == "__main__":
    run_cli(main, parse_args)
