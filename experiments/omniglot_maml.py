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
    python experiments/omniglot_maml.py --preset mamlpp-5w1s    # MAML++'s final config (GPU)
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

The file reads top to bottom: the arguments (`Args`, each a flag) and presets; the loop's
steps (`meta_step`, `validate`, `test`); and `main`, which builds the data, model and
learner from the run's recipe and runs the loop. Changing the meta-step (what it does with
the tasks, its outer step-size schedule) or the loop means editing this file alone. What no
experiment rewrites (argument checks, the run folder's lock, resuming at the right step,
signals, W&B, the progress bar, atomic checkpoints) is `metalearn.runs.run.Run`, which the
loop uses. A run is its arguments: the
learner's open ones (``--inner-lr``, ``--inner-steps``, ...) take the learner constructor's
defaults once, and the resolved arguments are the run's recipe (`metalearn.runs.recipe`),
recorded in W&B and the checkpoint, from which evaluation and deployment rebuild the run.
``--resume`` continues the saved run; only `metalearn.runs.experiment.RESUMABLE` arguments
may change.

Under ``torchrun`` each rank computes the meta-gradient of its share of every meta-batch
and the shares are averaged (`metalearn.distributed`); every rank draws the same global
meta-batch, so N processes train on exactly the tasks one process sees. Rank 0 alone logs,
writes checkpoints and shows progress; evaluation tasks are split across ranks.
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
from metalearn.algorithms.registry import make_learner
from metalearn.data import EpisodicSampler
from metalearn.runs import experiment
from metalearn.runs.arguments import DataArgs, ExperimentArgs, ModelArgs
from metalearn.runs.evaluation import TEST_SEED, VAL_SEED, evaluate_tasks
from metalearn.runs.experiment import Experiment
from metalearn.runs.lifecycle import require, run_cli
from metalearn.runs.metrics import (
    PERF_STEP_S,
    PERF_TASKS_PER_S,
    PERF_VECTORIZED_TASKS,
    TEST_ACC,
    TEST_ACC_CI95,
    TEST_ACC_ONE_TO_ONE,
    TEST_ACC_ONE_TO_ONE_CI95,
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
    trainval: bool = False
    """Train on the split's training and validation classes together for --iterations, with
    no validation, and test the last weights: Prototypical Networks' final model
    (run_trainval.py retrains so for the epochs its validation chose; docs/algorithms.md)."""


@dataclass
class OmniglotModel(ModelArgs):
    """The network: MAML's Omniglot Conv4 (stride 2, ReLU), MAML++'s (max-pool, leaky ReLU)
    or R2-D2's encoder."""

    backbone: Literal["conv4", "rrnet"] = "conv4"
    """Network: MAML's Conv4 or R2-D2's encoder (96-192-384-512 at --hidden 64)."""
    head: Literal["mean", "flatten"] = "mean"
    """Conv4's classifier input: the mean of its last 2x2 map or the map flattened (Reptile's
    Omniglot network)."""
    pool: Literal["stride", "max"] = "stride"
    """Conv4's down-sampling: stride 2 (MAML's Omniglot net) or 2x2 max-pool (MAML++'s)."""


@dataclass
class Args(ExperimentArgs):
    """Arguments of the Omniglot experiment (each is a --flag, also as --flag_name=VALUE)."""

    preset: Literal[
        "cpu", "cpu-20w1s", "gpu-20w1s", "paper-5w1s", "paper-5w5s", "paper-20w1s",
        "paper-20w5s", "mamlpp-5w1s", "mamlpp-5w5s", "mamlpp-20w1s", "mamlpp-20w5s",
        "cpu-mamlpp", "reptile-5w1s", "reptile-5w5s", "reptile-20w1s", "reptile-20w5s",
        "reptile-cpu", "protonet-5w-paper", "protonet-20w-paper", "r2d2-5w-paper",
        "r2d2-20w-paper", "imaml-5w1s", "imaml-5w1s-gpu", "imaml-cpu", "protomaml-5w1s",
        "protomaml-5w5s",
    ] = "cpu"  # fmt: skip
    """Named configuration: cpu (the default: 5-way 1-shot Proto-MAML as measured, at 0.4, 1
    step, second order, norm layers adapted; about 15 min on 2 cores), cpu-20w1s (Lake et
    al.'s within-alphabet 20-way 1-shot, under an hour on 2 cores), gpu-20w1s (the same
    recipe, longer), the MAML paper's settings (paper-*), MAML++'s final configurations
    (mamlpp-*, GPU), cpu-mamlpp (MAML++'s recipe with its schedules shrunk 100x: 500
    meta-steps, about 25 min on 2 cores), or another algorithm's reference commands
    (reptile-*, protonet-*-paper, r2d2-*-paper, imaml-5w1s, protomaml-5w*: meta-dataset's
    fo-Proto-MAML and its outer loop; docs/algorithms.md; reptile-cpu and imaml-cpu:
    CPU-sized runs of those recipes; imaml-5w1s-gpu: iMAML's command at the 20,000
    meta-steps its README names for replicating the paper)."""
    data: OmniglotData = field(default_factory=OmniglotData)
    """Data options."""
    model: OmniglotModel = field(default_factory=OmniglotModel)
    """Model options."""


# The MAML paper's Omniglot settings (Finn et al., 2017, Sec. 5.2 and appendix A.1), as
# cbfinn/maml's main.py runs them: K queries per class in training and test alike
# (`DataGenerator(FLAGS.update_batch_size*2, ...)`: K support and K query examples). Inner
# rates on the mean loss: its update_lr (0.4 at 5-way, 0.1 at 20-way) steps on the sum over
# the N K support examples over K, N times the mean, so 2.0 in all four (`MAML`'s docstring).
PAPER = dict(iterations=60_000, inner_steps=1, eval_inner_steps=10, outer_lr=1e-3,
             val_every=1000, checkpoint_every=1000, val_tasks=600, algorithm="maml")  # fmt: skip
# MAML++'s final Omniglot configurations (Antoniou et al., 2019; HowToTrainYourMAMLPytorch
# at 86964701, experiment_config/omniglot_maml++-omniglot_{1,5}_8_0.1_64_{5,20}_0.json): the
# learner's defaults (5 inner steps at 0.1, MSL over 10 epochs, second order, per-step batch
# norm, per-layer per-step rates), its network (64 filters, max-pool, leaky ReLU), meta-batch
# 8, one query per class (num_target_samples), 5 evaluation steps, Adam 1e-3 cosine-annealed
# to 1e-5 over 100 epochs of 500 meta-steps, stepped per epoch, validated every epoch on 600
# tasks; tested as an ensemble of its 5 best-validation epochs (experiment_builder.py).
MAMLPP = dict(algorithm="mamlpp", hidden=64, pool="max", activation="leaky_relu", query=1,
              eval_query=1, eval_inner_steps=5, meta_batch=8, iterations=50_000,
              outer_lr=1e-3, lr_schedule="cosine", eta_min=1e-5, schedule_every=500,
              val_every=500, checkpoint_every=500, val_tasks=600, test_tasks=600,
              ensemble_top_k=5)  # fmt: skip
# Lake et al.'s 20-way 1-shot within one alphabet, trained on the background alphabets:
# the best recipe measured at 3,000 steps in docs/benchmarks.md ("Omniglot the hard way"):
# ProtoNet on 60-way training tasks (Snell et al.'s), augmented; 60 classes exceed an
# alphabet, so the training tasks are episodic. Each query is classified on its own, its
# batch norm at the support set's statistics, as Lake et al. score (transductive=False);
# the test also reports the run's queries assigned one-to-one, beside it.
LAKE = dict(algorithm="protonet", ways=20, train_ways=60, shots=1, split="alphabet",
            augment=True, eval_protocol="within-alphabet", train_tasks="episodic",
            query=3, transductive=False)  # fmt: skip
# Reptile's Omniglot commands (openai/supervised-reptile, README.md, "to match latest version
# of the paper"): --train-shots 10 examples per class in the inner loop (one query a class
# drawn beside them for the held-out training metrics), --meta-batch 5, --meta-step 1
# annealed to 0 (--meta-step-final 0), --eval-iters 50, 10,000 test tasks; the learner's
# defaults are its 5-way values (Adam 1e-3 with beta1 0, 5 iterations on mini-batches of 10,
# evaluation mini-batches of 5, non-transductive); its network flattens the last 2x2x64 map
# (models.py).
REPTILE = dict(algorithm="reptile", train_shots=10, query=1, meta_batch=5, eval_inner_steps=50,
               head="flatten", outer_lr=1.0, val_every=1000, checkpoint_every=1000, val_tasks=600,
               test_tasks=10_000)  # fmt: skip
REPTILE_20W = dict(ways=20, inner_lr=5e-4, inner_steps=10, inner_batch=20, eval_inner_batch=10,
                   iterations=200_000)  # fmt: skip
# ProtoNet's and R2-D2's Omniglot training: 60-way episodes of 5 queries (R2-D2: 10 examples
# a class, 1-9 of them support), one a step, Adam halved every 20 epochs of 100 episodes,
# validated every epoch
# (jakesnell/prototypical-networks, scripts/train/few_shot/run_train.py; bertinetto/r2d2,
# scripts/train/experiments.sh and conf/fewshots.yaml). Both stop when validation has not
# improved for 200 epochs; 40,000 steps here, where the step is 2^-20 of its start and
# later steps move nothing (metalearn tests the best-validation weights). R2-D2's network is
# its encoder (RRNet, --backbone rrnet).
PROTONET = dict(algorithm="protonet", train_ways=60, shots=5, query=5, eval_query=15,
                meta_batch=1, outer_lr=1e-3, lr_schedule="step", step_size=20, gamma=0.5,
                schedule_every=100, iterations=40_000, val_every=100, checkpoint_every=1000,
                val_tasks=100, test_tasks=1000)  # fmt: skip
R2D2 = dict(algorithm="r2d2", backbone="rrnet", hidden=64, train_ways=60, shots=5,
            train_shots=9, train_min_shots=1, query=1, eval_query=15, meta_batch=1,
            outer_lr=5e-3, lr_schedule="step", step_size=20, gamma=0.5, schedule_every=100,
            iterations=40_000, val_every=100, checkpoint_every=1000, val_tasks=200,
            test_tasks=10_000)  # fmt: skip
# fo-Proto-MAML as google-research/meta-dataset (at 1676095) trains it, here on Omniglot: the
# learner's defaults are its learners/maml_init_with_proto_config.gin values (lines 9-16); the
# outer loop: Adam (trainer.py line 536) at 1e-4 (learners/learner_config.gin line 15),
# halved every 5,000 updates (decay_learning_rate = True, maml_init_with_proto_config.gin line
# 3; decay_every 5000, decay_rate 0.5, learner_config.gin lines 17-18; exponential_decay with
# staircase=True on the update count, trainer.py lines 524-530); weight_decay = 1e-4
# (maml_init_with_proto_config.gin line 7, overriding learner_config.gin line 11's 0.001), the
# penalty 1e-4 ||w||^2 of a Keras L2 regularizer on each convolution kernel
# (models/functional_backbones.py lines 422-429) added to the meta-loss (trainer.py lines
# 1413-1414), whose gradient 2e-4 w is torch's weight decay 2e-4 on the weights alone
# (--weight-decay-on weights; biases and batch norm undecayed); one episode an update
# (trainer.py lines 1403-1454), 75,000 updates, validation every 500 on 600 episodes
# (setups/trainer_config.gin lines 1, 3, 5), 15 queries a class (setups/fixed_way_and_shot.gin
# line 3), the training's 5 steps at evaluation (additional_evaluation_update_steps = 0,
# maml_init_with_proto_config.gin line 10); its four-layer convnet: 3x3 convolutions at stride
# 1, batch norm, ReLU, a 2x2 max-pool (functional_backbones.py lines 1212-1250: --pool max).
PROTOMAML = dict(algorithm="protomaml", pool="max", query=15, eval_query=15, meta_batch=1,
                 outer_lr=1e-4, lr_schedule="step", step_size=5000, gamma=0.5,
                 weight_decay=2e-4, weight_decay_on="weights", iterations=75_000,
                 eval_inner_steps=5, val_every=500, checkpoint_every=500, val_tasks=600,
                 test_tasks=600)  # fmt: skip
IMAML = dict(algorithm="imaml", ways=5, shots=1, query=1, eval_query=1, meta_batch=32,
             outer_lr=1e-3, eval_inner_steps=16, eval_lam=0.0, test_tasks=600)  # fmt: skip
PRESETS: dict[str, dict[str, Any]] = {
    # the learner the documented 97.5% was measured with (docs/benchmarks.md): Proto-MAML
    # at MAML's Omniglot rate and step count, second order, norm layers adapted, the query
    # normalised in its own batch; its own defaults are meta-dataset's fo-Proto-MAML. With
    # another --algorithm these are left out (`metalearn.runs.experiment.presets_for`):
    # that learner's defaults stand.
    "cpu": {"algorithm": "protomaml", "inner_lr": 0.4, "inner_steps": 1, "first_order": False,
            "adapt_norm": True, "transductive": True},
    "cpu-20w1s": {**LAKE, "meta_batch": 8, "iterations": 3000, "val_every": 500},
    "gpu-20w1s": {**LAKE, "meta_batch": 32, "iterations": 30_000, "val_every": 1000,
                  "checkpoint_every": 1000, "val_tasks": 600},
    "paper-5w1s": {**PAPER, "ways": 5, "shots": 1, "query": 1, "eval_query": 1,
                   "meta_batch": 32, "inner_lr": 2.0},
    "paper-5w5s": {**PAPER, "ways": 5, "shots": 5, "query": 5, "eval_query": 5,
                   "meta_batch": 32, "inner_lr": 2.0},
    "paper-20w1s": {**PAPER, "ways": 20, "shots": 1, "query": 1, "eval_query": 1,
                    "meta_batch": 16, "inner_lr": 2.0, "inner_steps": 5},
    "paper-20w5s": {**PAPER, "ways": 20, "shots": 5, "query": 5, "eval_query": 5,
                    "meta_batch": 16, "inner_lr": 2.0, "inner_steps": 5},
    "mamlpp-5w1s": {**MAMLPP, "ways": 5, "shots": 1},
    "mamlpp-5w5s": {**MAMLPP, "ways": 5, "shots": 5},
    "mamlpp-20w1s": {**MAMLPP, "ways": 20, "shots": 1},
    "mamlpp-20w5s": {**MAMLPP, "ways": 20, "shots": 5},
    # MAML++'s 5-way 1-shot recipe on a CPU budget: 100 epochs of 5 meta-steps instead of
    # 500 (the cosine and MSL's 10 epochs shrunk alike), 200 validation tasks, an ensemble
    # of the best 3 of its 5 validations (its test 2.5 minutes, the best alone 40 s). 2.6 s
    # a meta-step on 2 cores at load 4: about 27 minutes with validation and test.
    "cpu-mamlpp": {**MAMLPP, "ways": 5, "shots": 1, "iterations": 500, "schedule_every": 5,
                   "msl_steps": 50, "msl_epoch_length": 5, "val_every": 100,
                   "checkpoint_every": 100, "val_tasks": 200, "ensemble_top_k": 3},
    "reptile-5w1s": {**REPTILE, "ways": 5, "shots": 1, "iterations": 100_000},
    "reptile-5w5s": {**REPTILE, "ways": 5, "shots": 5, "iterations": 100_000},
    "reptile-20w1s": {**REPTILE, **REPTILE_20W, "shots": 1},
    "reptile-20w5s": {**REPTILE, **REPTILE_20W, "shots": 5},
    # reptile-5w1s at a 2-core budget: fewer meta-steps (the step still annealed to 0 over
    # them) and fewer evaluation tasks
    "reptile-cpu": {**REPTILE, "ways": 5, "shots": 1, "iterations": 1000,
                    "val_every": 250, "checkpoint_every": 250, "val_tasks": 50,
                    "test_tasks": 300},
    # aravindr93/imaml_dev at 6a2a669, examples/README.md: the Omniglot 5-way 1-shot command
    # (line 12: 16 steps at 0.1, lam 2, 5 CG steps, meta-batch 32, 500 meta-steps of Adam
    # 1e-3), its test (line 17: measure_accuracy.py --n_steps 16 --lam 0.0 --inner_lr 1e-1 on
    # 600 tasks; measure_accuracy.py line 75: learn_task without the proximal term, so
    # eval_lam 0), K queries a class in training and test (implicit_maml/dataset.py lines
    # 147-148: num_inst support and num_inst query instances). The learner's defaults are
    # its values. 500 meta-steps are the README's smoke test (line 14: "To replicate the paper
    # results you need to use meta_steps (at least) 20000"): imaml-5w1s-gpu.
    "imaml-5w1s": {**IMAML, "iterations": 500, "val_every": 100},
    "imaml-5w1s-gpu": {**IMAML, "iterations": 20_000, "val_every": 1000,
                       "checkpoint_every": 1000, "val_tasks": 600},
    "protomaml-5w1s": {**PROTOMAML, "ways": 5, "shots": 1},
    "protomaml-5w5s": {**PROTOMAML, "ways": 5, "shots": 5},
    # iMAML on the default CPU run: 5 inner steps, about a third of the inner loop's cost
    "imaml-cpu": {"algorithm": "imaml", "inner_steps": 5},
    "protonet-5w-paper": {**PROTONET, "ways": 5},
    "protonet-20w-paper": {**PROTONET, "ways": 20},
    "r2d2-5w-paper": {**R2D2, "ways": 5},
    "r2d2-20w-paper": {**R2D2, "ways": 20},
}  # fmt: skip


def check_args(args: Args) -> None:
    """Refuse a --data-root that does not exist, Lake's protocol on MAML's split, or an
    ensemble of validations with --trainval (the shared checks run first)."""
    data = args.data
    k = args.training.ensemble_top_k
    require(not (data.trainval and k > 1),
            f"--trainval trains on the validation classes too, so there are no validations "
            f"for --ensemble-top-k {k} to rank; drop --ensemble-top-k")  # fmt: skip
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
    best, `metalearn.runs.evaluation`) on the test tasks, with its 95% interval; on the
    within-alphabet test, also the same tasks' queries assigned one-to-one (transductive)."""
    run.load_best(learner)
    run.phase("test")
    t = recipe.training
    gen = torch.Generator().manual_seed(TEST_SEED)
    acc, half = evaluate_tasks(learner, sampler, t.test_tasks, t.eval_inner_steps, gen,
                               progress=run.bar.update, ensemble=run.ensemble())  # fmt: skip
    results = {TEST_ACC: acc, TEST_ACC_CI95: half, TEST_BEST_ITERATION: run.state.best_iteration}
    if recipe.data.eval_protocol == "within-alphabet":  # Lake et al.'s runs, read jointly
        gen = torch.Generator().manual_seed(TEST_SEED)  # the same tasks
        one, one_half = evaluate_tasks(learner, sampler, t.test_tasks, t.eval_inner_steps, gen,
                                       progress=False, ensemble=run.ensemble(),
                                       one_to_one=sampler.queries)  # fmt: skip
        results.update({TEST_ACC_ONE_TO_ONE: one, TEST_ACC_ONE_TO_ONE_CI95: one_half})
    return results


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
