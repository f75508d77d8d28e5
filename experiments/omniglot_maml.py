"""MAML (and family) on Omniglot, N-way K-shot, tracked in Weights & Biases.

What: meta-trains the conv4 network of Finn et al. (2017) on Omniglot with the chosen
algorithm (the default ``cpu`` preset: Proto-MAML, MAML whose head starts each task at the
support set's prototypes), validates during training and keeps the best-validation
weights, then reports the test accuracy over the test tasks with a 95% confidence interval.
``--eval-protocol within-alphabet`` tests as Lake et al. (2015) did (``--preset cpu-20w1s``).

Command:
    python experiments/omniglot_maml.py                         # CPU-sized default run
    python experiments/omniglot_maml.py --preset cpu-20w1s      # Lake et al.'s 20-way protocol
    python experiments/omniglot_maml.py --preset paper-5w1s     # the paper's setting (GPU)
    python experiments/omniglot_maml.py --algorithm anil --ways 20 --shots 1
    python experiments/omniglot_maml.py --resume --run-name NAME  # continue a stopped run
    python experiments/omniglot_maml.py --preset paper-20w1s --help  # options, preset values
    wandb sweep experiments/sweeps/omniglot_maml.yaml           # a W&B sweep (then wandb agent)
    python scripts/grid.py --seeds 0 1 2 --set inner_lr=0.1,0.4  # a grid without a W&B server
    torchrun --nproc_per_node=2 experiments/omniglot_maml.py    # 2 processes (docs/distributed.md)

Data: ``--data-root`` or ``$METALEARN_DATA`` pointing at the extracted Omniglot folder
(``images_background/``, ``images_evaluation/``); without either, the cache folder is used
and filled by a download when the network allows. Expected result of the default run
(5-way 1-shot Proto-MAML, 2 CPU cores, see README.md): about 15 minutes, test accuracy
printed as ``test/acc: 0.9xx ± 0.00x``.

A run is its arguments: they are checked before any data loads, the learner's open ones
(``--inner-lr``, ``--inner-steps``, ``--cg-damping``) are filled from the per-algorithm table
in `metalearn.algorithms.build`, and the result is what W&B and the checkpoint record.
``--resume`` continues the saved run with the saved arguments; only the RESUMABLE ones may
be changed (see `metalearn.runs.lifecycle` for how no logged metric is lost across a kill
and resume).

Under ``torchrun`` each rank computes the meta-gradient of its share of every meta-batch
and the shares are averaged (`metalearn.distributed`); every rank draws the same global
meta-batch, so N processes train on exactly the tasks one process sees. Rank 0 alone logs,
writes checkpoints and shows progress; evaluation tasks are split across ranks.

This file holds what is Omniglot's (its arguments, presets, data and network);
`metalearn.runs.loop` runs it, as it runs ``experiments/fewshot_maml.py``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from metalearn import distributed
from metalearn.algorithms import MetaLearner
from metalearn.algorithms.build import build_learner, resolve_learner_args
from metalearn.data import (
    EpisodicSampler,
    load_omniglot,
    omniglot_samplers,
    standard_augmentation,
)
from metalearn.data.omniglot import root_is_default
from metalearn.data.within_alphabet import within_alphabet_samplers
from metalearn.runs import loop as experiment
from metalearn.runs.lifecycle import UserError, require, run_cli
from metalearn.runs.loop import Experiment
from metalearn.runs.seeding import seed_everything


@dataclass
class Args:
    """Arguments of the Omniglot experiment (each is a --flag, also as --flag_name=VALUE)."""

    preset: Literal[
        "cpu", "cpu-20w1s", "gpu-20w1s", "paper-5w1s", "paper-5w5s", "paper-20w1s", "paper-20w5s"
    ] = "cpu"
    """Named configuration: cpu (5-way 1-shot Proto-MAML, about 15 min on 2 cores),
    cpu-20w1s (Lake et al.'s within-alphabet 20-way 1-shot, under an hour on 2 cores),
    gpu-20w1s (the same recipe, longer), or the MAML paper's settings."""
    algorithm: Literal[
        "maml", "fomaml", "anil", "metasgd", "mamlpp", "imaml", "reptile", "protomaml", "lora"
    ] = "maml"
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
    """Meta-steps (may be raised on --resume to extend a run)."""
    inner_lr: float | None = None
    """Inner-loop learning rate (MAML's alpha); none: the algorithm's (0.4; iMAML 0.1)."""
    inner_steps: int | None = None
    """Inner steps during meta-training; none: the algorithm's (1; iMAML and Reptile 5)."""
    cg_damping: float | None = None
    """iMAML only: damping added to the conjugate-gradient system; none: 10 (conv4's
    adapted support Hessian has eigenvalues below -lambda)."""
    lora_rank: int | None = None
    """LoRA only: rank of the low-rank adapters the inner loop adapts; none: 4."""
    eval_inner_steps: int = 10
    """Inner steps at validation and test time."""
    outer_lr: float = 1e-3
    """Adam learning rate of the meta-update (Reptile: its epsilon, with SGD)."""
    hidden: int = 64
    """Filters per conv layer."""
    vectorize: Literal["auto", "vmap", "loop"] = "auto"
    """How a meta-batch runs: vmap, a Python loop, or auto (by workload)."""
    compile: bool = False
    """Compile the training meta-gradient with torch.compile (`metalearn.engine.compiled`): each
    vmapped chunk's meta-loss and its gradient as one graph, else the per-task meta-loss.
    Same meta-gradient (float32 rounds differently); the first steps spend minutes
    compiling on a CPU, where it then ran slower than eager (docs/benchmarks.md). Validation
    and test stay eager. Not for imaml, reptile or --checkpoint."""
    split: Literal["maml", "alphabet"] = "maml"
    """maml: 1100/100/423 characters with rotations; alphabet: background vs evaluation."""
    eval_protocol: Literal["episodic", "within-alphabet"] = "episodic"
    """Validation and test tasks: episodic (classes from anywhere in the split) or
    within-alphabet (--split alphabet only; Lake et al., 2015: one alphabet per task,
    support and query by different drawers)."""
    train_tasks: Literal["episodic", "within-alphabet"] = "episodic"
    """Training tasks, drawn as by --eval-protocol (within-alphabet: --split alphabet only)."""
    augment: bool = False
    """Distort training images with small random affine maps (`metalearn.data.SmallAffine`:
    rotation, shear, scale, shift, as Koch et al.'s Siamese net); never validation or test."""
    val_every: int = 250
    """Meta-steps between validations (the best-validation weights are tested)."""
    val_tasks: int = 200
    """Validation tasks per validation."""
    test_tasks: int = 600
    """Test tasks for the final accuracy and its 95% confidence interval."""
    checkpoint_every: int = 250
    """Meta-steps between checkpoints (also written on Ctrl-C / SIGTERM)."""
    curvature_every: int = 0
    """Meta-steps between curvature measurements (curv/ metrics: support and meta-loss
    Hessians' top eigenvalues, the meta-loss Hessian's trace); 0: off."""
    curvature_tasks: int = 4
    """Fixed probe tasks (drawn once from the training split) curvature is measured on."""
    seed: int = 0
    """Seeds the initial weights and the task sampling."""
    data_root: str | None = None
    """Omniglot folder (must exist); default $METALEARN_DATA, else the cache dir (downloaded)."""
    out_dir: str = "runs"
    """Where checkpoints and the W&B folder go."""
    run_name: str | None = None
    """Run name (default: algorithm-NwKs-lrLR-stepsS-seedS); --resume looks for it in out_dir."""
    resume: bool = False
    """Continue the run named run_name from its last checkpoint, with its saved arguments;
    only --iterations (to extend), --checkpoint-every, --compile, --device, --threads,
    --tune-malloc, --track, --wandb-mode, --wandb-group, --log-model, --dist-timeout,
    --data-root, --out-dir may change."""
    track: bool = True
    """Log to Weights & Biases (--no-track to skip)."""
    log_model: bool = False
    """Log the final checkpoint as a W&B artifact (type model, aliases best and latest)."""
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """auto: online when logged in and reachable, else offline."""
    wandb_project: str = "metalearn-omniglot"
    """W&B project."""
    wandb_group: str | None = None
    """W&B group (default: algorithm-NwKs); scripts/grid.py puts a whole grid in one."""
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
# Lake et al.'s 20-way 1-shot within one alphabet, trained on the background alphabets:
# the recipe of the ablation in docs/benchmarks.md ("Omniglot the hard way").
LAKE = dict(algorithm="protomaml", ways=20, shots=1, split="alphabet", augment=True,
            eval_protocol="within-alphabet", train_tasks="within-alphabet", query=3)  # fmt: skip
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {"algorithm": "protomaml"},
    "cpu-20w1s": {**LAKE, "meta_batch": 8, "iterations": 3000, "val_every": 500},
    "gpu-20w1s": {**LAKE, "meta_batch": 32, "iterations": 30_000, "val_every": 1000,
                  "checkpoint_every": 1000, "val_tasks": 600},
    "paper-5w1s": {**PAPER, "ways": 5, "shots": 1, "meta_batch": 32, "inner_lr": 0.4},
    "paper-5w5s": {**PAPER, "ways": 5, "shots": 5, "meta_batch": 32, "inner_lr": 0.4},
    "paper-20w1s": {**PAPER, "ways": 20, "shots": 1, "meta_batch": 16, "inner_lr": 0.1,
                    "inner_steps": 5},
    "paper-20w5s": {**PAPER, "ways": 20, "shots": 5, "meta_batch": 16, "inner_lr": 0.1,
                    "inner_steps": 5},
}  # fmt: skip
# What --resume may change: how long, where and how fast the run goes on (--compile computes
# the same meta-gradient), not what it computes.
RESUMABLE = (
    "iterations", "checkpoint_every", "compile", "device", "threads", "tune_malloc", "track",
    "wandb_mode", "wandb_group", "log_model", "dist_timeout", "data_root", "out_dir", "resume",
)  # fmt: skip


def check_args(args: Args) -> None:
    """Refuse a --data-root that does not exist, or Lake's protocol on MAML's split (the
    shared checks run first)."""
    protocols = (("--eval-protocol", args.eval_protocol), ("--train-tasks", args.train_tasks))
    for flag, value in protocols:
        require(value == "episodic" or args.split == "alphabet",
                f"{flag} {value} draws each task from one alphabet of the alphabet split; "
                "add --split alphabet")  # fmt: skip
    if args.data_root is not None:
        require(Path(args.data_root).expanduser().is_dir(),
                f"--data-root {args.data_root} does not exist; give the folder holding "
                "images_background/ and images_evaluation/, or drop --data-root")  # fmt: skip


def make_samplers(args: Args) -> dict[str, EpisodicSampler]:
    """Train, validation and test task samplers (validation and test with eval_query)."""
    try:
        with distributed.main_first():  # one process per machine fills the cache (or downloads)
            data = load_omniglot(args.data_root, download=root_is_default(args.data_root))
    except (FileNotFoundError, ValueError) as err:  # ValueError: a corrupt drawing, named
        raise UserError(" ".join(str(err).split())) from None
    common = dict(ways=args.ways, shots=args.shots, device=args.device)
    augment = standard_augmentation("character") if args.augment else None
    draw = {"episodic": omniglot_samplers, "within-alphabet": within_alphabet_samplers}
    samplers = draw[args.train_tasks](data, args.split, queries=args.query, augment=augment,
                                      **common)  # fmt: skip
    evaluation = draw[args.eval_protocol](data, args.split, queries=args.eval_query, **common)
    samplers.update({k: v for k, v in evaluation.items() if k != "train"})
    return samplers


def make_learner(args: Args) -> MetaLearner:
    """The algorithm around a fresh conv4 (seeded by args.seed), built exactly as recorded.

    `metalearn.algorithms.build.build_learner` holds the construction, so a deployed
    checkpoint is rebuilt exactly as it was trained. ``args`` are resolved already in a run
    (`resolve_args`); resolving again changes nothing and lets callers pass open ones.
    """
    seed_everything(args.seed)
    return build_learner(resolve_learner_args(dataclasses.asdict(args))).to(args.device)


EXPERIMENT = Experiment(
    Args, __doc__, PRESETS, RESUMABLE, make_samplers, make_learner,
    dataset=lambda args: "omniglot", check=check_args, tags=lambda args: [args.split],
)  # fmt: skip


def resolve_args(args: Args) -> Args:
    """Checked ``args`` with the learner's open values and the run name filled in."""
    return experiment.resolve_args(EXPERIMENT, args)


def parse_args(argv: Sequence[str] | None = None) -> Args:
    """The command line as `Args`; ``--resume --run-name NAME`` alone continues that run."""
    return experiment.parse_args(EXPERIMENT, argv)


def main(args: Args) -> dict[str, float]:
    """Meta-train, test the best-validation weights, log everything; returns the results.

    Raises:
        UserError: a bad argument, a resume that changes the run, missing data (nothing
            has been written then).
        Stopped: SIGINT/SIGTERM; the run was checkpointed and marked failed in W&B.
    """
    return experiment.main(EXPERIMENT, args)


if __name__ == "__main__":
    run_cli(main, parse_args)
