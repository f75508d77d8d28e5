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
(``--inner-lr``, ``--inner-steps``, ``--cg-damping``, ...) are filled once
(`metalearn.runs.recipe.resolve_learner_args`), and the resolved arguments become the run's
recipe (`metalearn.runs.recipe`), which W&B and the checkpoint record and from which
evaluation and deployment rebuild the run. ``--resume`` continues the saved run with the
saved arguments; only `metalearn.runs.loop.RESUMABLE` ones may change (see
`metalearn.runs.lifecycle` for how no logged metric is lost across a kill and resume).

Under ``torchrun`` each rank computes the meta-gradient of its share of every meta-batch
and the shares are averaged (`metalearn.distributed`); every rank draws the same global
meta-batch, so N processes train on exactly the tasks one process sees. Rank 0 alone logs,
writes checkpoints and shows progress; evaluation tasks are split across ranks.

This file holds what is Omniglot's (its own arguments, presets and refusals);
`metalearn.runs.loop` runs it, as it runs ``experiments/fewshot_maml.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from metalearn.runs import loop
from metalearn.runs.arguments import DataArgs, ExperimentArgs
from metalearn.runs.lifecycle import require, run_cli
from metalearn.runs.loop import Experiment


@dataclass
class OmniglotData(DataArgs):
    """The tasks: Omniglot's split and protocols, classes, shots and queries."""

    split: Literal["maml", "alphabet"] = "maml"
    """maml: 1100/100/423 characters with rotations; alphabet: background vs evaluation."""
    eval_protocol: Literal["episodic", "within-alphabet"] = "episodic"
    """Validation and test tasks: episodic (classes from anywhere in the split) or
    within-alphabet (--split alphabet only; Lake et al., 2015: one alphabet per task,
    support and query by different drawers)."""
    train_tasks: Literal["episodic", "within-alphabet"] = "episodic"
    """Training tasks, drawn as by --eval-protocol (within-alphabet: --split alphabet only)."""


@dataclass
class Args(ExperimentArgs):
    """Arguments of the Omniglot experiment (each is a --flag, also as --flag_name=VALUE)."""

    preset: Literal[
        "cpu", "cpu-20w1s", "gpu-20w1s", "paper-5w1s", "paper-5w5s", "paper-20w1s", "paper-20w5s"
    ] = "cpu"
    """Named configuration: cpu (the defaults: 5-way 1-shot Proto-MAML, about 15 min on 2
    cores), cpu-20w1s (Lake et al.'s within-alphabet 20-way 1-shot, under an hour on 2
    cores), gpu-20w1s (the same recipe, longer), or the MAML paper's settings."""
    data: OmniglotData = field(default_factory=OmniglotData)
    """Data options."""


# The MAML paper's Omniglot settings (Finn et al., 2017, Sec. 5.2 and appendix A.1).
PAPER = dict(iterations=60_000, query=1, eval_query=1, inner_steps=1, eval_inner_steps=10,
             outer_lr=1e-3, val_every=1000, checkpoint_every=1000, val_tasks=600,
             algorithm="maml")  # fmt: skip
# Lake et al.'s 20-way 1-shot within one alphabet, trained on the background alphabets:
# the best recipe measured at 3,000 steps in docs/benchmarks.md ("Omniglot the hard way"):
# ProtoNet on 60-way training tasks (Snell et al.'s), augmented; 60 classes exceed an
# alphabet, so the training tasks are episodic.
LAKE = dict(algorithm="protonet", ways=20, train_ways=60, shots=1, split="alphabet",
            augment=True, eval_protocol="within-alphabet", train_tasks="episodic",
            query=3)  # fmt: skip
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {},  # the defaults of Args
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


def check_args(args: Args) -> None:
    """Refuse a --data-root that does not exist, or Lake's protocol on MAML's split (the
    shared checks run first)."""
    data = args.data
    for name, value in (("--eval-protocol", data.eval_protocol),
                        ("--train-tasks", data.train_tasks)):  # fmt: skip
        require(value == "episodic" or data.split == "alphabet",
                f"{name} {value} draws each task from one alphabet of the alphabet split; "
                "add --split alphabet")  # fmt: skip
    if data.data_root is not None:
        require(Path(data.data_root).expanduser().is_dir(),
                f"--data-root {data.data_root} does not exist; give the folder holding "
                "images_background/ and images_evaluation/, or drop --data-root")  # fmt: skip


EXPERIMENT = Experiment(
    "omniglot_maml", Args, __doc__, PRESETS, check=check_args,
    tags=lambda args: [args.data.split],
)  # fmt: skip


def resolve_args(args: Args) -> Args:
    """Checked ``args`` with the learner's open values and the run name filled in."""
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
