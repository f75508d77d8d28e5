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

The file reads top to bottom: the arguments (`Args`, each a flag) and presets; the loop's
steps (`meta_step`, `validate`, `test`); and `main`, which builds the data, model and
learner from the run's recipe and runs the loop, the same few lines as
``experiments/omniglot_maml.py``'s. What no experiment rewrites (argument checks, the run
folder's lock, resuming, signals, W&B, the progress bar, atomic checkpoints, torchrun) is
`metalearn.runs.run.Run`. The run's recipe (`metalearn.runs.recipe`) records the data set,
its decoding and the network, so `metalearn.deploy` and ``scripts/evaluate.py`` rebuild it
from the checkpoint alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from metalearn import distributed
from metalearn.algorithms import MetaLearner, StepMetrics
from metalearn.algorithms.registry import can, complete_arguments, make_learner
from metalearn.data import EpisodicSampler
from metalearn.data.benchmarks import image_options, image_shape
from metalearn.runs import experiment
from metalearn.runs.arguments import (
    DataArgs,
    ExperimentArgs,
    LearnerArgs,
    ModelArgs,
    TrackingArgs,
    TrainingArgs,
)
from metalearn.runs.cli import replace_flat
from metalearn.runs.evaluation import TEST_SEED, VAL_SEED, evaluate_tasks
from metalearn.runs.experiment import Experiment
from metalearn.runs.lifecycle import UserError, require, run_cli
from metalearn.runs.metrics import (
    PERF_STEP_S,
    PERF_TASKS_PER_S,
    PERF_VECTORIZED_TASKS,
    TEST_ACC,
    TEST_ACC_CI95,
    TEST_BEST_ITERATION,
    TRAIN_ACC,
    TRAIN_LOSS,
    TRAIN_OUTER_LR,
    TRAIN_SKIPPED,
    VAL_ACC,
    VAL_ACC_CI95,
    VAL_BEST_ACC,
    curvature_probe,
    measure_curvature,
)
from metalearn.runs.outer_loop import (
    build_outer_optimizer,
    check_finite_gradient,
    clamp_meta_gradient,
    my_tasks,
    scheduled_lr,
    solver_metrics,
)
from metalearn.runs.recipe import Recipe, build_model
from metalearn.runs.run import Run, load_samplers, meta_gradient
from metalearn.runs.seeding import seed_everything

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
    """The network: MAML's Conv4, ResNet-12 or R2-D2's encoder."""

    backbone: Literal["conv4", "resnet12", "rrnet"] = "conv4"
    """Network: MAML's Conv4, ResNet-12 or R2-D2's encoder (96-192-384-512 at --hidden 64)."""
    head: Literal["flatten", "mean"] = "flatten"
    """Conv4's classifier input: every final position flattened (MAML's mini-ImageNet
    net) or their mean."""
    pool: Literal["max", "stride"] = "max"
    """Conv4's down-sampling: 2x2 max-pool (mini-ImageNet) or stride 2 (MAML's Omniglot)."""


@dataclass
class Args(ExperimentArgs):
    """Arguments of the few-shot experiment (each is a --flag, also as --flag_name=VALUE)."""

    preset: Literal["cpu", "paper-miniimagenet-5w1s", "paper-miniimagenet-5w5s",
                    "paper-miniimagenet-5w1s-fo", "paper-miniimagenet-5w5s-fo",
                    "reptile-miniimagenet-5w1s", "reptile-miniimagenet-5w5s",
                    "r2d2-miniimagenet", "r2d2-cifarfs", "metaoptnet-miniimagenet",
                    "mamlpp-miniimagenet-5w1s", "mamlpp-miniimagenet-5w5s"] = "cpu"  # fmt: skip
    """Named configuration: cpu (the defaults: a short run), the MAML paper's
    mini-ImageNet settings (-fo: first order), MAML++'s final mini-ImageNet configurations,
    or another algorithm's reference commands (docs/algorithms.md)."""
    data: FewshotData = field(default_factory=lambda: FewshotData(query=15))
    """Data options."""
    model: FewshotModel = field(default_factory=lambda: FewshotModel(hidden=32))
    """Model options."""
    learner: LearnerArgs = field(default_factory=lambda: LearnerArgs(algorithm="maml"))
    """Learner options (inner_lr and inner_steps left open: 0.05 on the mean loss and 5, the
    MAML paper's mini-ImageNet runs, for a learner whose own are Omniglot's; `with_open_values`)."""
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
# Conv4 of 32 filters with max-pooling and a flattened head, 5 inner steps in training and
# 10 at test (update_lr 0.01 on the sum over N K examples over K: 5 x 0.01 = 0.05 on the
# mean loss, `MAML`'s docstring), 60k meta-steps of Adam 1e-3. Queries as cbfinn/maml's main.py
# draws them: 15 per class in training (`DataGenerator(FLAGS.update_batch_size+15, ...)`),
# K at test (`DataGenerator(FLAGS.update_batch_size*2, ...)`). Each meta-gradient entry
# clamped to [-10, 10] on mini-ImageNet (maml.py line 148, `tf.clip_by_value`).
PAPER = dict(dataset="mini-imagenet", backbone="conv4", hidden=32, head="flatten", pool="max",
             iterations=60_000, query=15, inner_lr=0.05, inner_steps=5,
             eval_inner_steps=10, outer_lr=1e-3, val_every=1000, checkpoint_every=1000,
             val_tasks=600, test_tasks=600, ways=5, grad_clamp=10.0)  # fmt: skip
# Reptile's mini-ImageNet commands (openai/supervised-reptile, README.md): MAML's network
# (32 filters, max-pool), --train-shots 15 examples a class in the inner loop (one query a
# class drawn beside them for the held-out training metrics), 8 Adam iterations at 1e-3 on
# mini-batches of 10, meta-batch 5, meta-step 1 annealed to 0 over 100,000 steps, 50
# evaluation iterations, 10,000 test tasks.
REPTILE = dict(dataset="mini-imagenet", backbone="conv4", hidden=32, head="flatten", pool="max",
               algorithm="reptile", train_shots=15, query=1, inner_lr=1e-3, inner_steps=8,
               inner_batch=10, meta_batch=5, outer_lr=1.0, iterations=100_000,
               eval_inner_steps=50, val_every=1000, checkpoint_every=1000, val_tasks=600,
               test_tasks=10_000, ways=5)  # fmt: skip
# MAML++'s final mini-ImageNet configurations (HowToTrainYourMAMLPytorch at 86964701,
# experiment_config/mini-imagenet_maml++-mini-imagenet_{1,5}_2_0.01_48_5_0.json): 48 filters,
# max-pool, leaky ReLU, a flattened head on 84x84 images; meta-batch 2; 15 queries per class
# (num_target_samples); 5 inner steps in training and evaluation at 0.1 (the argparse
# default task_learning_rate: the configs' init_inner_loop_learning_rate 0.01 is never read);
# MSL over 15 epochs of 500; second order throughout; Adam 1e-3 over 100 epochs (its cosine
# runs to min_learning_rate 0.001, the start: a constant step); each network meta-gradient
# entry clamped to [-10, 10] on ImageNet (`meta_update`); tested as an ensemble of the 5 best
# validations (experiment_builder.py).
MAMLPP = dict(algorithm="mamlpp", dataset="mini-imagenet", backbone="conv4", hidden=48,
              head="flatten", pool="max", activation="leaky_relu", ways=5, query=15,
              eval_query=15, inner_lr=0.1, inner_steps=5, eval_inner_steps=5, msl_steps=7500,
              meta_batch=2, iterations=50_000, outer_lr=1e-3, val_every=500,
              checkpoint_every=500, val_tasks=600, test_tasks=600, grad_clamp=10.0,
              ensemble_top_k=5)  # fmt: skip
# bertinetto/r2d2, scripts/train/experiments.sh (mini_r2d2, cifar_r2d2) and
# conf/fewshots.yaml: episodes of 240 images (mini-ImageNet 16-way, 15 a class; CIFAR-FS
# 20-way, 12 a class; 1-9 of them support), the output scale from 1e-4 (CIFAR-FS 10),
# dropout 0.1 (CIFAR-FS 0.4) after the encoder's blocks 3 and 4, Adam 5e-3 halved every 20
# epochs of 100 episodes (40,000 steps: see omniglot_maml.py's R2D2), tested 5-way on
# 10,000 tasks; its encoder (RRNet: --backbone rrnet at --hidden 64).
R2D2 = dict(algorithm="r2d2", ways=5, backbone="rrnet", hidden=64, shots=5, train_shots=9,
            train_min_shots=1, eval_query=15, meta_batch=1, outer_lr=5e-3, lr_schedule="step",
            step_size=20, gamma=0.5, schedule_every=100, iterations=40_000, val_every=100,
            checkpoint_every=1000, val_tasks=200, test_tasks=10_000)  # fmt: skip
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {},  # the defaults of Args
    "paper-miniimagenet-5w1s": {**PAPER, "shots": 1, "eval_query": 1, "meta_batch": 4},
    "paper-miniimagenet-5w5s": {**PAPER, "shots": 5, "eval_query": 5, "meta_batch": 2},
    "paper-miniimagenet-5w1s-fo": {**PAPER, "shots": 1, "eval_query": 1, "meta_batch": 4,
                                   "algorithm": "fomaml"},
    "paper-miniimagenet-5w5s-fo": {**PAPER, "shots": 5, "eval_query": 5, "meta_batch": 2,
                                   "algorithm": "fomaml"},
    "mamlpp-miniimagenet-5w1s": {**MAMLPP, "shots": 1},
    "mamlpp-miniimagenet-5w5s": {**MAMLPP, "shots": 5},
    "reptile-miniimagenet-5w1s": {**REPTILE, "shots": 1, "eval_inner_batch": 5},
    "reptile-miniimagenet-5w5s": {**REPTILE, "shots": 5, "eval_inner_batch": 15},
    "r2d2-miniimagenet": {**R2D2, "dataset": "mini-imagenet", "train_ways": 16, "query": 6,
                          "scale": 1e-4, "dropout": 0.1},
    "r2d2-cifarfs": {**R2D2, "dataset": "cifar-fs", "train_ways": 20, "query": 3,
                     "scale": 10.0, "dropout": 0.4},
    # kjunelee/MetaOptNet, README.md (the SVM command) and train.py: ResNet-12, 8 episodes
    # of 6 queries a class per step, SGD 0.1 with Nesterov momentum 0.9 and weight decay
    # 5e-4, 60 epochs of 1,000 steps, 2,000 validation episodes; the SVM head's defaults
    # (label smoothing 0.1). Its LambdaLR, stepped at each epoch's start, gives factors 1,
    # 0.06, 0.012, 0.0024 from 0-based epochs 0, 19, 39, 49. It trains 15-shot
    # (--train-shot 15) and validates 5-shot (--val-shot 5); test.py tests 1- and 5-shot.
    "metaoptnet-miniimagenet": {"dataset": "mini-imagenet", "algorithm": "metaoptnet",
                                "backbone": "resnet12", "hidden": 64, "ways": 5, "shots": 5,
                                "train_shots": 15, "query": 6,
                                "eval_query": 15, "meta_batch": 8, "outer_optimizer": "sgd",
                                "outer_lr": 0.1, "outer_momentum": 0.9, "nesterov": True,
                                "weight_decay": 5e-4, "lr_schedule": "piecewise",
                                "lr_milestones": (19, 39, 49),
                                "lr_factors": (1.0, 0.06, 0.012, 0.0024),
                                "schedule_every": 1000, "iterations": 60_000, "val_every": 1000,
                                "checkpoint_every": 1000, "val_tasks": 2000,
                                "test_tasks": 1000},
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


def with_open_values(args: Args) -> Args:
    """``args`` with open ``channels`` and ``image_size`` set to the data set's, and, for a
    learner whose inner loop is gradient descent by default at its reference's Omniglot
    values (MAML's family, iMAML: `MetaLearner.omniglot_inner_defaults`), open ``inner_lr``
    and ``inner_steps`` set to the MAML paper's mini-ImageNet values (0.05 on the mean loss,
    its 0.01 on N times it; 5 steps);
    the rest is the learner's own (its constructor: Reptile's Adam at 1e-3, whose
    mini-ImageNet commands are the ``reptile-miniimagenet-*`` presets; Proto-MAML's
    meta-dataset values; BOIL's CIFAR-FS ones)."""
    channels, side = image_shape(args.data.dataset, args.data.image_size, args.data.channels)
    inner = {}
    algorithm = args.learner.algorithm
    own = complete_arguments(algorithm, {})
    if (
        can(algorithm, "omniglot_inner_defaults")
        and can(algorithm, "inner_loop")
        and own.get("inner_optimizer", "sgd") == "sgd"
    ):
        lr, steps = args.learner.inner_lr, args.learner.inner_steps
        inner = {"inner_lr": 0.05 if lr is None else lr, "inner_steps": steps or 5}
    return replace_flat(args, channels=channels, image_size=side, **inner)


EXPERIMENT = Experiment(
    "fewshot_maml", Args, __doc__, PRESETS, check=check_data, resolve=with_open_values,
    tags=lambda args: [args.model.backbone],
)  # fmt: skip


def resolve_args(args: Args) -> Args:
    """Checked ``args`` with the open values and the run name filled in."""
    return experiment.resolve_args(EXPERIMENT, args)


def parse_args(argv: Sequence[str] | None = None) -> Args:
    """The command line as `Args`; ``--resume --run-name NAME`` alone continues that run."""
    return experiment.parse_args(EXPERIMENT, argv)


# --------------------------------------------------------------------------- the loop's steps


def meta_step(
    recipe: Recipe,
    learner: MetaLearner,
    opt: torch.optim.Optimizer,
    sampler: EpisodicSampler,
    gen: torch.Generator,
    backward: Callable[[list], StepMetrics] | None = None,
    step: int = 0,
) -> dict[str, float]:
    """Meta-step ``step`` (0-based) on this rank's share of a meta-batch; its metrics.

    The learner is handed the step first (`MetaLearner.schedule`: MAML++'s loss weights and
    derivative order, ...) and the outer step size is set from it
    (`MetaLearner.outer_lr_factor`: Reptile's annealing), so a resumed run is where an
    uninterrupted one would be. ``backward`` fills ``.grad`` with the meta-gradient (Finn et
    al., 2017, Eq. 2 summed over the tasks; default ``learner.backward``).
    """
    t = recipe.training
    start = time.perf_counter()
    scheduled = learner.schedule(step, t.iterations)
    # the run's schedule (--lr-schedule, metalearn.runs.outer_loop) times the learner's own
    lr = scheduled_lr(t, step) * learner.outer_lr_factor(step, t.iterations)
    for group in opt.param_groups:
        group["lr"] = lr
    tasks = my_tasks(sampler, t.meta_batch, gen)
    opt.zero_grad(set_to_none=True)
    metrics = (learner.backward if backward is None else backward)(tasks)
    metrics = distributed.average_meta_step(learner, metrics, len(tasks))
    check_finite_gradient(learner)  # before the optimizer writes NaN into the weights
    clamp_meta_gradient(learner, t.grad_clamp)  # --grad-clamp (MAML++ on mini-ImageNet)
    opt.step()
    seconds = time.perf_counter() - start
    return {
        TRAIN_LOSS: metrics.loss, TRAIN_ACC: metrics.accuracy, TRAIN_OUTER_LR: lr, **scheduled,
        PERF_STEP_S: seconds, PERF_TASKS_PER_S: t.meta_batch / seconds,
        PERF_VECTORIZED_TASKS: metrics.vectorized, TRAIN_SKIPPED: metrics.skipped,
        **solver_metrics(metrics),  # iMAML's CG: converged, met non-positive curvature
    }  # fmt: skip


def validate(recipe: Recipe, learner: MetaLearner, sampler: Any, run: Run) -> dict[str, float]:
    """Accuracy on the validation tasks (the same ones every time); the run keeps the best
    weights (the latest, for a split with no validation classes)."""
    if sampler is None:
        run.keep_best(learner, None)
        return {}
    run.phase("validate")
    t = recipe.training
    gen = torch.Generator().manual_seed(VAL_SEED)
    acc, half = evaluate_tasks(learner, sampler, t.val_tasks, t.eval_inner_steps, gen,
                               progress=run.bar.update)  # fmt: skip
    return {VAL_ACC: acc, VAL_ACC_CI95: half, VAL_BEST_ACC: run.keep_best(learner, acc)}


def test(recipe: Recipe, learner: MetaLearner, sampler: Any, run: Run) -> dict[str, float]:
    """Accuracy of the best-validation weights (with --ensemble-top-k K: the ensemble of the K
    best, `metalearn.runs.evaluation`) on the test tasks, with its 95% interval."""
    run.load_best(learner)
    run.phase("test")
    t = recipe.training
    gen = torch.Generator().manual_seed(TEST_SEED)
    acc, half = evaluate_tasks(learner, sampler, t.test_tasks, t.eval_inner_steps, gen,
                               progress=run.bar.update, ensemble=run.ensemble())  # fmt: skip
    return {TEST_ACC: acc, TEST_ACC_CI95: half, TEST_BEST_ITERATION: run.state.best_iteration}


# --------------------------------------------------------------------------- main


def main(args: Args) -> dict[str, float]:
    """Meta-train, test the best-validation weights, log everything; returns the results.

    Raises:
        UserError: a bad argument, a resume that changes the run, missing data (nothing
            has been written then); a run that diverged.
        Stopped: SIGINT/SIGTERM; the run was checkpointed and marked failed in W&B.
    """
    with Run(EXPERIMENT, args) as run:  # checked, resolved, locked; resumed if asked
        recipe, t, device = run.recipe, run.recipe.training, run.args.system.device
        # Data: the train, validation and test tasks of the recipe's split and protocols.
        samplers = load_samplers(recipe, device)
        # Model and learner, seeded by --seed; the outer optimizer the recipe names.
        seed_everything(t.seed)
        model = build_model(recipe)
        learner = make_learner(recipe.learner.algorithm, model, recipe.learner.arguments)
        learner = learner.to(device)
        opt = build_outer_optimizer(learner, t)  # --outer-optimizer (none: the learner's)
        gen = torch.Generator().manual_seed(t.seed)  # draws the training tasks
        backward = meta_gradient(run.args, learner)  # learner.backward; compiled: --compile
        probe = curvature_probe(recipe, learner, samplers["train"])  # None: not measured
        run.start(learner, opt, gen, validates="val" in samplers)
        for step in run.steps():
            row = meta_step(recipe, learner, opt, samplers["train"], gen, backward, step)
            if probe is not None and (step + 1) % t.curvature_every == 0:
                run.phase("curvature")
                row.update(measure_curvature(learner, probe))
            if (step + 1) % t.val_every == 0 or step + 1 == t.iterations:
                row.update(validate(recipe, learner, samplers.get("val"), run))
            run.log(row)  # history, W&B, progress; a checkpoint every --checkpoint-every
        return run.finish(test(recipe, learner, samplers["test"], run))


if __name__ == "__main__":
    run_cli(main, parse_args)
