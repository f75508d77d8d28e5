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
        --hidden 64 --first-order --gradient-checkpointing --chunk-size 2  # less memory
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
this file holds what is particular to these data sets: their own arguments (the data set,
image shape and backbone), the presets and the refusals. The run's recipe
(`metalearn.runs.recipe`) records the data set, its decoding and the network, so
`metalearn.deploy` and ``scripts/evaluate.py`` rebuild it from the checkpoint alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from metalearn.data.benchmarks import image_options, image_shape
from metalearn.runs import loop
from metalearn.runs.arguments import (
    DataArgs,
    ExperimentArgs,
    LearnerArgs,
    ModelArgs,
    TrackingArgs,
    TrainingArgs,
)
from metalearn.runs.cli import replace_flat
from metalearn.runs.lifecycle import UserError, require, run_cli
from metalearn.runs.loop import Experiment, default_run_name

Dataset = Literal["mini-imagenet", "tiered-imagenet", "cifar-fs", "fc100", "cub", "folder",
                  "omniglot"]  # fmt: skip


@dataclass
class FewshotData(DataArgs):
    """The tasks: which data set, its image shape, classes, shots and queries."""

    dataset: Dataset = "mini-imagenet"
    """The data set (docs/datasets.md gives each one's layout on disk)."""
    channels: int | None = None
    """Image channels; none: the data set's (1 Omniglot, 3 others); folder may use 1."""
    image_size: int | None = None
    """Image side in pixels; none: the data set's (84; CIFAR-FS and FC100 32; Omniglot 28).
    mini-ImageNet's image folder, CUB, folder and Omniglot are decoded at any size."""


@dataclass
class FewshotModel(ModelArgs):
    """The network: MAML's Conv4 or ResNet-12."""

    backbone: Literal["conv4", "resnet12"] = "conv4"
    """Network: MAML's Conv4 or ResNet-12."""
    head: Literal["flatten", "mean"] = "flatten"
    """Conv4's classifier input: every final position flattened (MAML's mini-ImageNet
    net) or their mean."""
    pool: Literal["max", "stride"] = "max"
    """Conv4's down-sampling: 2x2 max-pool (mini-ImageNet) or stride 2 (MAML's Omniglot)."""


@dataclass
class Args(ExperimentArgs):
    """Arguments of the few-shot experiment (each is a --flag, also as --flag_name=VALUE)."""

    preset: Literal["cpu", "paper-miniimagenet-5w1s", "paper-miniimagenet-5w5s",
                    "paper-miniimagenet-5w1s-fo", "paper-miniimagenet-5w5s-fo"] = "cpu"  # fmt: skip
    """Named configuration: cpu (the defaults: a short run) or the MAML paper's
    mini-ImageNet settings (-fo: first order)."""
    data: FewshotData = field(default_factory=lambda: FewshotData(query=15))
    """Data options."""
    model: FewshotModel = field(default_factory=lambda: FewshotModel(hidden=32))
    """Model options."""
    learner: LearnerArgs = field(
        default_factory=lambda: LearnerArgs(algorithm="maml", inner_lr=0.01, inner_steps=5)
    )
    """Learner options (inner_lr 0.01 and 5 steps: the MAML paper's mini-ImageNet runs)."""
    training: TrainingArgs = field(
        default_factory=lambda: TrainingArgs(
            meta_batch=4, iterations=2000, val_every=200, checkpoint_every=200
        )  # fmt: skip
    )
    """Training options."""
    tracking: TrackingArgs = field(
        default_factory=lambda: TrackingArgs(wandb_project="metalearn-fewshot")
    )
    """Tracking options."""


# The MAML paper's mini-ImageNet settings (Finn et al., 2017, Sec. 5.2 and appendix A.1):
# Conv4 of 32 filters with max-pooling and a flattened head, 5 inner steps of 0.01 in
# training and 10 at test, 15 queries per class, 60k meta-steps of Adam 1e-3.
PAPER = dict(dataset="mini-imagenet", backbone="conv4", hidden=32, head="flatten", pool="max",
             iterations=60_000, query=15, eval_query=15, inner_lr=0.01, inner_steps=5,
             eval_inner_steps=10, outer_lr=1e-3, val_every=1000, checkpoint_every=1000,
             val_tasks=600, test_tasks=600, ways=5)  # fmt: skip
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {},  # the defaults of Args
    "paper-miniimagenet-5w1s": {**PAPER, "shots": 1, "meta_batch": 4},
    "paper-miniimagenet-5w5s": {**PAPER, "shots": 5, "meta_batch": 2},
    "paper-miniimagenet-5w1s-fo": {**PAPER, "shots": 1, "meta_batch": 4, "algorithm": "fomaml"},
    "paper-miniimagenet-5w5s-fo": {**PAPER, "shots": 5, "meta_batch": 2, "algorithm": "fomaml"},
}  # fmt: skip


def check_data(args: Args) -> None:
    """Refuse a missing --data-root and an image shape the data set cannot give."""
    data = args.data
    if data.dataset != "omniglot":
        require(data.data_root is not None,
                f"--dataset {data.dataset} needs --data-root: the folder holding it in the "
                "layout docs/datasets.md gives")  # fmt: skip
    if data.data_root is not None:
        require(Path(data.data_root).expanduser().is_dir(),
                f"--data-root {data.data_root} does not exist; give the {data.dataset} folder "
                "(see docs/datasets.md)")  # fmt: skip
    try:
        image_options(data.dataset, data.image_size, data.channels)
    except ValueError as err:
        raise UserError(str(err)) from None


def with_image_shape(args: Args) -> Args:
    """``args`` with open ``channels`` and ``image_size`` set to the data set's."""
    channels, side = image_shape(args.data.dataset, args.data.image_size, args.data.channels)
    return replace_flat(args, channels=channels, image_size=side)


EXPERIMENT = Experiment(
    "fewshot_maml", Args, __doc__, PRESETS, check=check_data, resolve=with_image_shape,
    run_name=lambda args: f"{args.data.dataset}-{args.model.backbone}-{default_run_name(args)}",
    tags=lambda args: [args.model.backbone],
)  # fmt: skip


def resolve_args(args: Args) -> Args:
    """Checked ``args`` with the open values and the run name filled in."""
    return loop.resolve_args(EXPERIMENT, args)


def parse_args(argv: Sequence[str] | None = None) -> Args:
    """The command line as `Args`; ``--resume --run-name NAME`` alone continues that run."""
    return loop.parse_args(EXPERIMENT, argv)


def main(args: Args) -> dict[str, float]:
    """Meta-train, test the best-validation weights, log everything; returns the results.

    Raises:
        UserError: a bad argument, a resume that changes the run, missing data (nothing
            has been written then).
        Stopped: SIGINT/SIGTERM; the run was checkpointed and marked failed in W&B.
    """
    return loop.main(EXPERIMENT, args)


if __name__ == "__main__":
    run_cli(main, parse_args)
