"""The arguments every experiment shares, in the groups ``--help`` shows.

An experiment's arguments are one dataclass of groups (`ExperimentArgs`): data, model,
learner, training, tracking and system. Each experiment subclasses the groups it extends
(Omniglot's data adds its split and protocols; the few-shot experiment's adds the data set
and image shape, its model the backbone) and gives each group its defaults, which its
default preset extends: ``Args()`` under that preset is what the command line gives with no
flags (the Omniglot ``cpu`` preset adds the Proto-MAML its documented result was measured
with; a learner value left open is the learner's own default). Every leaf name is
unique, so each is a flat flag (``--inner-lr``), a flat key in checkpoints and the W&B
config (`metalearn.runs.cli.flatten`), and a name ``scripts/grid.py --set`` takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from metalearn.algorithms.registry import Algorithm

__all__ = [
    "DataArgs",
    "ExperimentArgs",
    "LearnerArgs",
    "ModelArgs",
    "SystemArgs",
    "TrackingArgs",
    "TrainingArgs",
]


@dataclass
class DataArgs:
    """The tasks: which data, how many classes, shots and queries."""

    data_root: str | None = None
    """The data set's folder (must exist); Omniglot: default $METALEARN_DATA, else the cache
    dir (downloaded)."""
    ways: int = 5
    """N: classes per task."""
    train_ways: int | None = None
    """Classes per training task; none: --ways. More than --ways trains on harder tasks, as
    Prototypical Networks trained Omniglot (60-way for 5- and 20-way tests); only for the
    algorithms that size their head per task (protonet, r2d2, metaoptnet)."""
    shots: int = 1
    """K: support examples per class."""
    train_shots: int | None = None
    """Support examples per class of training tasks; none: --shots. MetaOptNet trains
    15-shot for its 1- and 5-shot tests; validation and test tasks keep --shots."""
    train_min_shots: int | None = None
    """Random shots: each training task draws its support examples a class uniformly from
    [this, --train-shots] and has the rest of its --train-shots + --query examples a class
    as queries, as R2-D2's training episodes; none: every training task --train-shots."""
    query: int = 5
    """Query examples per class during meta-training."""
    eval_query: int = 15
    """Query examples per class for validation and test tasks."""
    augment: bool = False
    """Augment training images with the data set's standard augmentation (Omniglot: small
    random affine maps, as Koch et al.'s Siamese net); never validation or test."""


@dataclass
class ModelArgs:
    """The network."""

    hidden: int = 64
    """Conv4: filters per block; ResNet-12: first stage width (stages h, 2.5h, 5h, 10h);
    R2-D2's encoder: blocks 1.5h, 3h, 6h, 8h (64: its 96-192-384-512)."""
    activation: Literal["relu", "leaky_relu"] = "relu"
    """Conv4's nonlinearity: ReLU (MAML's) or leaky ReLU, slope 0.01 (MAML++'s network)."""
    dropout: float = 0.0
    """R2-D2's encoder (--backbone rrnet) only: dropout after blocks 3 and 4 in meta-training,
    off at validation, test and deploy (its reference: 0 Omniglot, 0.1 mini-ImageNet, 0.4
    CIFAR-FS)."""


@dataclass
class LearnerArgs:
    """The algorithm and its settings, each flag named after the learner argument it sets;
    none: the learner constructor's default, the one place it is written (docs/algorithms.md
    lists them), recorded resolved."""

    algorithm: Algorithm = "protomaml"
    """Meta-learning algorithm."""
    inner_lr: float | None = None
    """Inner-loop learning rate (MAML's alpha); none: the learner's (protonet, r2d2 and
    metaoptnet have no inner loop)."""
    inner_steps: int | None = None
    """Inner steps during meta-training; none: the learner's."""
    first_order: bool | None = None
    """First-order meta-gradient (True: no second derivatives, less memory and time) or exact
    second order (False); none: the learner's (protomaml True, the reference's fo-Proto-MAML;
    the others False). Not for fomaml (first order by definition), reptile, or mamlpp (see
    --first-order-steps)."""
    eval_inner_steps: int = 10
    """Inner steps at validation and test time."""
    on_nonfinite: Literal["raise", "skip"] = "raise"
    """A task whose loss turns NaN or infinite: raise (the run stops, naming the meta-step,
    task and inner step) or skip it (left out of the meta-gradient; recorded)."""
    outer_lr: float | None = None
    """Outer step size; none: the learner's (Adam 1e-3; Reptile: SGD with epsilon 1.0,
    annealed linearly to 0 as in Nichol et al.)."""
    cg_damping: float | None = None
    """iMAML only: damping added to the conjugate-gradient system; none: the learner's
    (conv4's adapted support Hessian has eigenvalues below -lambda)."""
    cg_negative_curvature: Literal["raise", "continue", "stop"] | None = None
    """iMAML only: what conjugate gradient does at non-positive curvature p'Ap <= 0:
    continue (the plain recurrence, the reference's CG), stop (truncated CG: the iterate
    before it) or raise (the run stops); none: the learner's (continue)."""
    lora_rank: int | None = None
    """LoRA only: rank of the low-rank adapters the inner loop adapts; none: the learner's."""
    msl_steps: int | None = None
    """MAML++ only: meta-steps over which the multi-step loss anneals to the last step;
    none: the learner's (the reference's 10 epochs of 500 steps)."""
    msl_epoch_length: int | None = None
    """MAML++ only: meta-steps per epoch of the multi-step loss, whose weights move once an
    epoch; none: the learner's (the reference's 500; 1: every meta-step)."""
    first_order_steps: int | None = None
    """MAML++ only: meta-steps of first-order meta-gradients before exact second order;
    none: the learner's (0: the reference's final configs are second order throughout)."""
    adapt_norm: bool | None = None
    """maml, fomaml, metasgd, mamlpp, protomaml, boil: adapt the normalisation layers' weights
    in the inner loop too (True); none: the learner's (as its reference: False, meta-learned
    only; boil True)."""
    inner_optimizer: Literal["sgd", "momentum", "nesterov", "adam", "rmsprop"] | None = None
    """maml, fomaml, anil: the inner loop's differentiable optimizer (metalearn.optim), its
    step size --inner-lr (Adam and RMSprop move each entry by about that much: try 0.01);
    none: the learner's (sgd: MAML's update). reptile: adam (its default, beta1 0) or sgd."""
    inner_momentum: float | None = None
    """--inner-optimizer momentum or nesterov: the momentum; none: the learner's."""
    inner_beta1: float | None = None
    """--inner-optimizer adam: beta1; none: the learner's."""
    inner_beta2: float | None = None
    """--inner-optimizer adam: beta2; none: the learner's."""
    inner_eps: float | None = None
    """--inner-optimizer adam or rmsprop: eps; none: the learner's."""
    inner_alpha: float | None = None
    """--inner-optimizer rmsprop: the mean square's decay; none: the learner's."""
    label_smoothing: float | None = None
    """metaoptnet only: label smoothing of its training query loss, in [0, 1) (never at
    evaluation); none: the learner's (0.1, the paper's SVM command)."""
    inner_state: Literal["carried", "task"] | None = None
    """reptile only: its inner Adam's state carried on across tasks (the reference's
    TensorFlow slots) or reset per task; none: the learner's (carried)."""
    transductive: bool | None = None
    """reptile, protomaml and the solved heads (protonet, r2d2, metaoptnet, metaoptnet-lr):
    score a task's query set as one batch (shared batch-norm statistics); False: each query
    on its own, beside the support set or at its batch-norm moments; none: the learner's
    (reptile and protomaml False, as their references; the heads True)."""
    train_on_query: bool | None = None
    """reptile only: the inner loop trains on support + query (the reference's --train-shots
    examples per class: --query = train-shots - shots); none: the learner's (support only)."""
    inner_loss: Literal["sum", "mean"] | None = None
    """reptile only: its inner loss, the sum of the mini-batch's per-example losses (the
    reference's: TensorFlow minimising the loss vector) or their mean; none: the learner's
    (sum)."""
    inner_batch: int | None = None
    """reptile only: examples per inner mini-batch in training; none: the learner's (10, the
    reference's --inner-batch)."""
    eval_inner_batch: int | None = None
    """reptile only: examples per inner mini-batch at validation and test; none: the
    learner's (5, the reference's --eval-batch)."""
    ridge_form: Literal["rrnet", "plain"] | None = None
    """r2d2 only: rrnet (Bertinetto et al.'s head: a ones column, X and Y divided by
    sqrt(N K)) or plain (MetaOptNet's R2D2Head formula, lambda and scale log-parameterised);
    none: the learner's (rrnet)."""
    lam: float | None = None
    """r2d2: the ridge penalty (fixed unless learned); imaml: the proximal strength; none:
    the learner's (r2d2 50, imaml 2)."""
    eval_lam: float | None = None
    """imaml only: the proximal strength of adaptation at validation, test and deployment
    (0: gradient descent on the support loss alone); none: the learner's (0, the reference's
    test, measure_accuracy.py --lam 0.0)."""
    scale: float | None = None
    """r2d2, metaoptnet, metaoptnet-lr: the logits' learned scale at the start; none: the
    learner's (r2d2: 10, the reference's Omniglot value; its mini-ImageNet value is 1e-4)."""
    learn_inner_hyperparameters: Literal["none", "tensor", "step"] | None = None
    """maml, fomaml, anil: meta-learn the inner step size and the optimizer's decay rates,
    one per parameter tensor (tensor) or per tensor and inner step (step); none: fixed."""


@dataclass
class TrainingArgs:
    """How long to train, and how often to validate, test, checkpoint and measure."""

    meta_batch: int = 16
    """Tasks per meta-step."""
    iterations: int = 2500
    """Meta-steps (may be raised on --resume to extend a run)."""
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
    outer_optimizer: Literal["adam", "sgd"] | None = None
    """The outer loop's torch optimizer (step --outer-lr); none: the learner's (Adam; Reptile:
    plain SGD, Alg. 2's update). MetaOptNet's reference: sgd, --outer-momentum 0.9 --nesterov."""
    outer_momentum: float = 0.0
    """--outer-optimizer sgd: SGD's momentum, in [0, 1)."""
    nesterov: bool = False
    """--outer-optimizer sgd: Nesterov momentum (needs --outer-momentum)."""
    weight_decay: float = 0.0
    """The outer optimizer's weight decay (torch's: d theta added to the gradient, the L2
    penalty d/2 ||theta||^2; MetaOptNet's 5e-4)."""
    weight_decay_on: Literal["all", "weights"] = "all"
    """What --weight-decay decays: all the meta-parameters, or the convolution and linear
    layers' weights alone (TensorFlow's L2 regularizers on weight variables; Proto-MAML's
    reference)."""
    lr_schedule: Literal["constant", "cosine", "step", "linear", "piecewise"] = "constant"
    """Outer step-size schedule, as torch's schedulers (metalearn.runs.outer_loop): cosine
    (CosineAnnealingLR to --eta-min over the run; MAML++), step (StepLR: x --gamma every
    --step-size; ProtoNet), linear (LinearLR to --eta-min over the run), piecewise (x
    --lr-factors between --lr-milestones; MetaOptNet's LambdaLR). Reptile's own annealing
    multiplies it."""
    lr_milestones: tuple[int, ...] = ()
    """--lr-schedule piecewise: the scheduler steps at which the next factor starts."""
    lr_factors: tuple[float, ...] = ()
    """--lr-schedule piecewise: the step size's factors, one more than --lr-milestones."""
    eta_min: float = 0.0
    """--lr-schedule cosine or linear: the step size it anneals to (MAML++'s 1e-5)."""
    step_size: int | None = None
    """--lr-schedule step: scheduler steps between decays."""
    gamma: float = 0.1
    """--lr-schedule step: the decay factor (ProtoNet's 0.5)."""
    schedule_every: int = 1
    """Meta-steps per scheduler step (1: every meta-step; MAML++'s epochs: 500)."""
    grad_clamp: float | None = None
    """Clamp each entry of the network's meta-gradient to [-grad_clamp, grad_clamp] before
    the optimizer step (MAML++'s reference on mini-ImageNet: 10); none: no clamp."""
    ensemble_top_k: int = 1
    """Test the K best-validation weights as one ensemble: each query's logits averaged
    over the K models, then argmax (MAML++'s reference tests its top 5); 1: the best
    weights alone. At most the run's number of validations."""


@dataclass
class TrackingArgs:
    """Where the run is kept and how it is logged."""

    out_dir: str = "runs"
    """Where checkpoints and the W&B folder go."""
    run_name: str | None = None
    """Run name, its folder under out_dir (default: algorithm, NwKs, lr, steps and seed,
    then a unique W&B id; under a W&B agent, the sweep and run ids); --resume needs it."""
    wandb_id: str | None = None
    """W&B run id (default: the one a new run name ends with, or W&B's own for a run you
    name); a resumed run keeps its own."""
    resume: bool = False
    """Continue the run named run_name from its last checkpoint, with its saved arguments;
    only how long, where and how fast it runs may change (see the error for the list)."""
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


@dataclass
class SystemArgs:
    """Where and how fast it runs; none of these changes the numbers a run computes."""

    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """Torch device."""
    threads: int = 1
    """Torch CPU threads (0: torch's default). 1 is robust on small shared machines: with
    other load, 2 threads made tiny per-task ops up to 7x slower here."""
    tune_malloc: bool = True
    """Keep freed memory for reuse (`metalearn.tune_malloc`, glibc only): a meta-step's
    large activations stop costing page faults; --no-tune-malloc keeps malloc's defaults."""
    dist_timeout: float = 600.0
    """Under torchrun: seconds a rank waits for the others in a collective before the job
    fails, so a stalled rank ends the job (then --resume) instead of hanging it."""
    vectorize: Literal["auto", "vmap", "loop"] = "auto"
    """How a meta-batch runs: vmap, a Python loop, or auto (by workload)."""
    chunk_size: int | None = None
    """Tasks vectorised at once; none: chosen by workload. Smaller: less memory, more time."""
    gradient_checkpointing: bool = False
    """Recompute each inner step in the backward pass: activation memory of one step
    instead of all, at about one more forward pass."""
    compile: bool = False
    """Compile the training meta-gradient with torch.compile (`metalearn.engine.compiled`):
    same meta-gradient (float32 rounds differently); the first steps spend minutes
    compiling on a CPU, where it then ran slower than eager (docs/benchmarks.md).
    Validation and test stay eager. Not for imaml, reptile, metaoptnet or
    --gradient-checkpointing."""


@dataclass
class ExperimentArgs:
    """What every experiment's arguments hold; an experiment subclasses it."""

    preset: str = "cpu"
    """Named configuration (see --help of the experiment)."""
    data: DataArgs = field(default_factory=DataArgs)
    """Data options."""
    model: ModelArgs = field(default_factory=ModelArgs)
    """Model options."""
    learner: LearnerArgs = field(default_factory=LearnerArgs)
    """Learner options."""
    training: TrainingArgs = field(default_factory=TrainingArgs)
    """Training options."""
    tracking: TrackingArgs = field(default_factory=TrackingArgs)
    """Tracking options."""
    system: SystemArgs = field(default_factory=SystemArgs)
    """System options."""
