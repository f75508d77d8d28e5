"""MAML (and family) on the few-shot image benchmarks, N-way K-shot, tracked in W&B.

What: meta-trains a Conv4 or ResNet-12 on mini-ImageNet, tiered-ImageNet, CIFAR-FS, FC100,
CUB, a folder of labelled images or Omniglot with the chosen algorithm, validates during
training and keeps the best-validation weights, then reports the test accuracy over
``--test-tasks`` tasks with a 95% confidence interval.

Command:
    python experiments/fewshot_maml.py --dataset mini-imagenet --data-root /data/mini-imagenet
    python experiments/fewshot_maml.py --preset paper-miniimagenet-5w1s --data-root DIR  # (GPU)
    python experiments/fewshot_maml.py --preset paper-miniimagenet-5w5s-fo --data-root DIR
    python experiments/fewshot_maml.py --dataset cifar-fs --data-root DIR --backbone resnet12 \\
        --hidden 64 --first-order --checkpoint --chunk-size 2   # trade time for memory
    python experiments/fewshot_maml.py --resume --run-name NAME  # continue a stopped run
    torchrun --nproc_per_node=2 experiments/fewshot_maml.py ...  # 2 processes

Data: ``--data-root`` is the data set's folder in the layout docs/datasets.md gives for it
(required, except for Omniglot, which falls back to ``$METALEARN_DATA``). Expected result
of the paper presets: the MAML paper (Finn et al., 2017, Table 2) reports 48.70 ± 1.84%
(5-way 1-shot) and 63.11 ± 0.92% (5-way 5-shot) on mini-ImageNet, 48.07% and 63.15% first
order; printed as ``test/acc: 0.4xxx ± 0.0xxx``. The default ``cpu`` preset is a short run
of the same network, not a reproduction.

The run itself (argument checks, resume, the train loop, validation and test, checkpoints,
W&B, torchrun) is `metalearn.runs.loop`'s, shared with ``experiments/omniglot_maml.py``;
this file holds what is particular to these data sets: the arguments, the presets, the
data and the network. The network is recorded in the run's arguments (``backbone``,
``channels``, ``image_size``, ``hidden``, ``pool``, ``head``), so `metalearn.deploy` and
``scripts/evaluate.py`` rebuild it from the checkpoint alone.
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
from metalearn.data import EpisodicSampler, image_set_samplers
from metalearn.data.benchmarks import image_options, image_shape
from metalearn.runs import loop as experiment
from metalearn.runs.lifecycle import UserError, require, run_cli
from metalearn.runs.loop import Experiment, default_run_name
from metalearn.runs.seeding import seed_everything

Dataset = Literal["mini-imagenet", "tiered-imagenet", "cifar-fs", "fc100", "cub", "folder",
                  "omniglot"]  # fmt: skip


@dataclass
class Args:
    """Arguments of the few-shot experiment (each is a --flag, also as --flag_name=VALUE)."""

    preset: Literal["cpu", "paper-miniimagenet-5w1s", "paper-miniimagenet-5w5s",
                    "paper-miniimagenet-5w1s-fo", "paper-miniimagenet-5w5s-fo"] = "cpu"  # fmt: skip
    """Named configuration: cpu (a short run) or the MAML paper's mini-ImageNet settings
    (-fo: first order)."""
    dataset: Dataset = "mini-imagenet"
    """The data set (docs/datasets.md gives each one's layout on disk)."""
    data_root: str | None = None
    """The data set's folder; required but for omniglot ($METALEARN_DATA then)."""
    algorithm: Literal[
        "maml", "fomaml", "anil", "metasgd", "mamlpp", "imaml", "reptile", "protomaml", "lora"
    ] = "maml"
    """Meta-learning algorithm."""
    first_order: bool = False
    """First-order meta-gradient for maml, anil, metasgd, mamlpp, protomaml, lora (maml: the
    same as --algorithm fomaml): no second derivatives, less memory and time."""
    ways: int = 5
    """N: classes per task."""
    shots: int = 1
    """K: support examples per class."""
    query: int = 15
    """Query examples per class during meta-training."""
    eval_query: int = 15
    """Query examples per class for validation and test tasks."""
    meta_batch: int = 4
    """Tasks per meta-step."""
    iterations: int = 2000
    """Meta-steps (may be raised on --resume to extend a run)."""
    inner_lr: float | None = 0.01
    """Inner-loop learning rate (MAML's alpha; 0.01 in the paper's mini-ImageNet runs);
    none: the algorithm's Omniglot value (0.4; iMAML 0.1)."""
    inner_steps: int | None = 5
    """Inner steps during meta-training; none: the algorithm's Omniglot value."""
    cg_damping: float | None = None
    """iMAML only: damping added to the conjugate-gradient system; none: 10."""
    lora_rank: int | None = None
    """LoRA only: rank of the low-rank adapters the inner loop adapts; none: 4."""
    eval_inner_steps: int = 10
    """Inner steps at validation and test time."""
    outer_lr: float = 1e-3
    """Adam learning rate of the meta-update (Reptile: its epsilon, with SGD)."""
    backbone: Literal["conv4", "resnet12"] = "conv4"
    """Network: MAML's Conv4 or ResNet-12."""
    hidden: int = 32
    """Conv4: filters per block; ResNet-12: first stage width (stages h, 2.5h, 5h, 10h)."""
    head: Literal["flatten", "mean"] = "flatten"
    """Conv4's classifier input: every final position flattened (MAML's mini-ImageNet
    net) or their mean."""
    pool: Literal["max", "stride"] = "max"
    """Conv4's down-sampling: 2x2 max-pool (mini-ImageNet) or stride 2 (MAML's Omniglot)."""
    channels: int | None = None
    """Image channels; none: the data set's (1 Omniglot, 3 others); folder may use 1."""
    image_size: int | None = None
    """Image side in pixels; none: the data set's (84; CIFAR-FS and FC100 32; Omniglot 28).
    mini-ImageNet's image folder, CUB, folder and Omniglot are decoded at any size."""
    augment: bool = False
    """Augment training tasks with the data set's standard augmentation (never val/test)."""
    checkpoint: bool = False
    """Recompute each inner step in the backward pass (gradient checkpointing): activation
    memory of one step instead of all, at about one more forward pass."""
    chunk_size: int | None = None
    """Tasks vectorised at once; none: chosen from the memory available. Smaller: less
    memory, more time."""
    vectorize: Literal["auto", "vmap", "loop"] = "auto"
    """How a meta-batch runs: vmap, a Python loop, or auto (by workload)."""
    compile: bool = False
    """Compile the training meta-gradient with torch.compile (`metalearn.engine.compiled`): each
    vmapped chunk's meta-loss and its gradient as one graph, else the per-task meta-loss.
    Same meta-gradient (float32 rounds differently); the first steps spend minutes
    compiling on a CPU, where it then ran slower than eager (docs/benchmarks.md). Validation
    and test stay eager. Not for imaml, reptile or --checkpoint."""
    val_every: int = 200
    """Meta-steps between validations (the best-validation weights are tested)."""
    val_tasks: int = 200
    """Validation tasks per validation."""
    test_tasks: int = 600
    """Test tasks for the final accuracy and its 95% confidence interval."""
    checkpoint_every: int = 200
    """Meta-steps between checkpoints (also written on Ctrl-C / SIGTERM)."""
    curvature_every: int = 0
    """Meta-steps between curvature measurements (curv/ metrics: support and meta-loss
    Hessians' top eigenvalues, the meta-loss Hessian's trace); 0: off."""
    curvature_tasks: int = 4
    """Fixed probe tasks (drawn once from the training split) curvature is measured on."""
    seed: int = 0
    """Seeds the initial weights and the task sampling."""
    out_dir: str = "runs"
    """Where checkpoints and the W&B folder go."""
    run_name: str | None = None
    """Run name (default: dataset-backbone-algorithm-NwKs-lrLR-stepsS-seedS)."""
    resume: bool = False
    """Continue the run named run_name from its last checkpoint, with its saved arguments;
    only --iterations (to extend), --checkpoint-every, --checkpoint, --chunk-size,
    --compile, --device, --threads, --tune-malloc, --track, --wandb-mode, --wandb-group,
    --log-model, --dist-timeout, --data-root, --out-dir may change."""
    track: bool = True
    """Log to Weights & Biases (--no-track to skip)."""
    log_model: bool = False
    """Log the final checkpoint as a W&B artifact (type model, aliases best and latest)."""
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """auto: online when logged in and reachable, else offline."""
    wandb_project: str = "metalearn-fewshot"
    """W&B project."""
    wandb_group: str | None = None
    """W&B group (default: algorithm-NwKs)."""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """Torch device."""
    threads: int = 1
    """Torch CPU threads (0: torch's default)."""
    tune_malloc: bool = True
    """Keep freed memory for reuse (`metalearn.tune_malloc`, glibc only)."""
    dist_timeout: float = 600.0
    """Under torchrun: seconds a rank waits for the others in a collective."""


# The MAML paper's mini-ImageNet settings (Finn et al., 2017, Sec. 5.2 and appendix A.1):
# Conv4 of 32 filters with max-pooling and a flattened head, 5 inner steps of 0.01 in
# training and 10 at test, 15 queries per class, 60k meta-steps of Adam 1e-3.
PAPER = dict(dataset="mini-imagenet", backbone="conv4", hidden=32, head="flatten", pool="max",
             iterations=60_000, query=15, eval_query=15, inner_lr=0.01, inner_steps=5,
             eval_inner_steps=10, outer_lr=1e-3, val_every=1000, checkpoint_every=1000,
             val_tasks=600, test_tasks=600, ways=5)  # fmt: skip
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {},
    "paper-miniimagenet-5w1s": {**PAPER, "shots": 1, "meta_batch": 4},
    "paper-miniimagenet-5w5s": {**PAPER, "shots": 5, "meta_batch": 2},
    "paper-miniimagenet-5w1s-fo": {**PAPER, "shots": 1, "meta_batch": 4, "algorithm": "fomaml"},
    "paper-miniimagenet-5w5s-fo": {**PAPER, "shots": 5, "meta_batch": 2, "algorithm": "fomaml"},
}  # fmt: skip
# What --resume may change: how long, where, how fast and with how much memory the run goes
# on (compiling, checkpointing and chunking compute the same meta-gradient), not what it
# computes.
RESUMABLE = (
    "iterations", "checkpoint_every", "checkpoint", "chunk_size", "compile", "device", "threads",
    "tune_malloc", "track", "wandb_mode", "wandb_group", "log_model", "dist_timeout",
    "data_root", "out_dir", "resume",
)  # fmt: skip


def check_data(args: Args) -> None:
    """Refuse a missing --data-root and an image shape the data set cannot give."""
    if args.dataset != "omniglot":
        require(args.data_root is not None,
                f"--dataset {args.dataset} needs --data-root: the folder holding it in the "
                "layout docs/datasets.md gives")  # fmt: skip
    if args.data_root is not None:
        require(Path(args.data_root).expanduser().is_dir(),
                f"--data-root {args.data_root} does not exist; give the {args.dataset} folder "
                "(see docs/datasets.md)")  # fmt: skip
    require(args.chunk_size is None or args.chunk_size >= 1,
            f"--chunk-size {args.chunk_size}: must be at least 1, or none")  # fmt: skip
    try:
        image_options(args.dataset, args.image_size, args.channels)
    except ValueError as err:
        raise UserError(str(err)) from None


def with_image_shape(args: Args) -> Args:
    """``args`` with open ``channels`` and ``image_size`` set to the data set's."""
    channels, side = image_shape(args.dataset, args.image_size, args.channels)
    return dataclasses.replace(args, channels=channels, image_size=side)


def make_samplers(args: Args) -> dict[str, EpisodicSampler]:
    """Train (``query``, augmented with --augment), validation and test (``eval_query``)
    samplers, as `metalearn.data.image_set_samplers` builds them from the arguments."""
    try:
        with distributed.main_first():  # one process per machine fills the decoded cache
            return image_set_samplers(
                args.dataset, args.data_root, ways=args.ways, shots=args.shots,
                queries=args.query, eval_queries=args.eval_query, augment=args.augment,
                image_size=args.image_size, channels=args.channels, device=args.device,
            )  # fmt: skip
    except (FileNotFoundError, ValueError, ImportError) as err:  # ImportError: h5py absent
        raise UserError(" ".join(str(err).split())) from None


def make_learner(args: Args) -> MetaLearner:
    """The algorithm around a fresh backbone (seeded by args.seed), built exactly as recorded
    (`metalearn.algorithms.build.build_learner`); open values are resolved first."""
    seed_everything(args.seed)
    resolved = resolve_learner_args(dataclasses.asdict(with_image_shape(args)))
    return build_learner(resolved).to(args.device)


EXPERIMENT = Experiment(
    Args, __doc__, PRESETS, RESUMABLE, make_samplers, make_learner,
    dataset=lambda args: args.dataset, check=check_data, resolve=with_image_shape,
    run_name=lambda args: f"{args.dataset}-{args.backbone}-{default_run_name(args)}",
    tags=lambda args: [args.backbone],
)  # fmt: skip


def resolve_args(args: Args) -> Args:
    """Checked ``args`` with the open values and the run name filled in."""
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
