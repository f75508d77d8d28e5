"""The outer loop: its optimizer and step-size schedule, as a run's recipe records them, and
the parts of a meta-step around ``learner.backward``.

An experiment's ``meta_step`` draws this rank's share of the meta-batch (`my_tasks`), fills
``.grad`` (``learner.backward``, averaged over the ranks by `metalearn.distributed`), checks
it (`check_finite_gradient`), clamps it with ``--grad-clamp`` (`clamp_meta_gradient`) and
steps the optimizer. It sets the outer step size of
meta-step ``t`` (0-based) to

    lr_t = `scheduled_lr` (training, t) * learner.outer_lr_factor(t, iterations)

and ``main`` builds the optimizer with `build_outer_optimizer`. Both are functions of the
recipe's `metalearn.runs.recipe.TrainingRecipe` and the step alone, so a resumed run (the
optimizer's state restored from the checkpoint) continues the schedule exactly where it
stopped. The schedule is the experiment's (``--lr-schedule``); the learner's factor is what
an algorithm defines itself (Reptile's epsilon annealed linearly to 0, Nichol et al., 2018),
1.0 for the others. Changing how the schedule is applied means editing the experiment's
``meta_step``.

The schedules equal torch's, stepped once every ``schedule_every`` meta-steps (1: every
meta-step; MAML++'s reference steps per epoch of 500), with ``k = t // schedule_every``
scheduler steps taken and ``K = iterations // schedule_every``:

* ``constant``: ``lr``;
* ``cosine``: ``eta_min + (lr - eta_min) (1 + cos(pi k / K)) / 2``, CosineAnnealingLR(T_max=K,
  eta_min) (MAML++: eta_min 1e-5 over its epochs);
* ``step``: ``lr gamma^floor(k / step_size)``, StepLR(step_size, gamma) (ProtoNet: every 20
  epochs, gamma 0.5);
* ``linear``: ``lr + (eta_min - lr) k / K``, LinearLR(1, eta_min / lr, total_iters=K);
* ``piecewise``: ``lr * lr_factors[i]`` with ``i`` the number of ``lr_milestones`` at or
  below ``k``, LambdaLR of that function (MetaOptNet: its ``LambdaLR`` stepped at each
  epoch's start, factors 1, 0.06, 0.012, 0.0024 from 0-based epochs 0, 19, 39, 49).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from metalearn import distributed
from metalearn.algorithms import IMAMLMetrics, MetaLearner, StepMetrics
from metalearn.data import EpisodicSampler
from metalearn.runs.lifecycle import NonFiniteGradientError
from metalearn.runs.metrics import TRAIN_CG_CONVERGED, TRAIN_CG_NEGATIVE_CURVATURE

__all__ = ["OUTER_OPTIMIZERS", "SCHEDULES", "WEIGHT_DECAY_ON", "build_outer_optimizer",
           "check_finite_gradient", "check_outer_loop", "clamp_meta_gradient",
           "decayed_parameters", "my_tasks", "scheduled_lr", "solver_metrics"]  # fmt: skip

OUTER_OPTIMIZERS = ("adam", "sgd")
SCHEDULES = ("constant", "cosine", "step", "linear", "piecewise")
WEIGHT_DECAY_ON = ("all", "weights")
"""What ``--weight-decay`` decays: every meta-parameter (torch's optimizers) or the
convolution and linear layers' weights alone (`decayed_parameters`)."""
_WEIGHTED = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


def decayed_parameters(learner: MetaLearner) -> list[torch.Tensor]:
    """The weights of the learner's convolution and linear layers: what TensorFlow's L2
    regularizers on ``weight`` variables decay (google-research/meta-dataset,
    ``models/functional_backbones.py``, ``weight_variable``); biases, normalisation layers'
    scales and shifts, and learned inner rates are left out."""
    return [m.weight for m in learner.modules() if isinstance(m, _WEIGHTED)]


def scheduled_lr(training: Any, step: int) -> float:
    """The outer step size of the schedule at meta-step ``step`` (0-based), before the
    learner's own factor.

    Args:
        training: a `metalearn.runs.recipe.TrainingRecipe` (``outer_lr``, ``iterations``,
            ``lr_schedule``, ``eta_min``, ``step_size``, ``gamma``, ``schedule_every``).
        step: the meta-step.
    """
    lr, kind = training.outer_lr, training.lr_schedule
    k = step // training.schedule_every
    total = max(training.iterations // training.schedule_every, 1)
    if kind == "constant":
        return lr
    if kind == "cosine":
        return training.eta_min + (lr - training.eta_min) * (1 + math.cos(math.pi * k / total)) / 2
    if kind == "step":
        return lr * training.gamma ** (k // training.step_size)
    if kind == "linear":
        return lr + (training.eta_min - lr) * min(k, total) / total
    if kind == "piecewise":
        return lr * training.lr_factors[bisect.bisect_right(training.lr_milestones, k)]
    raise ValueError(f"unknown lr_schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")


def build_outer_optimizer(learner: MetaLearner, training: Any) -> torch.optim.Optimizer:
    """The optimizer of the learner's parameters the recipe names.

    ``outer_optimizer`` None is the learner's own
    (`MetaLearner.default_outer_optimizer`: Adam; Reptile: plain SGD). Adam and plain SGD at
    weight decay 0 are exactly `MetaLearner.outer_optimizer`'s. ``weight_decay`` ``d`` adds
    ``d theta`` to the gradient (torch's coupled L2, the gradient of ``d/2 ||theta||^2``) of
    every parameter (``weight_decay_on`` ``"all"``) or of `decayed_parameters` alone
    (``"weights"``: the other parameters in a group at weight decay 0).

    Args:
        learner: the learner whose parameters are trained.
        training: a `metalearn.runs.recipe.TrainingRecipe`.
    """
    name = training.outer_optimizer or type(learner).default_outer_optimizer
    params, lr, decay = list(learner.parameters()), training.outer_lr, training.weight_decay
    if training.weight_decay_on == "weights":
        weights = {id(p) for p in decayed_parameters(learner)}
        params = [
            {"params": [p for p in params if id(p) in weights]},
            {"params": [p for p in params if id(p) not in weights], "weight_decay": 0.0},
        ]
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=training.outer_momentum,
                               nesterov=training.nesterov, weight_decay=decay)  # fmt: skip
    raise ValueError(
        f"unknown outer_optimizer {name!r}; choose one of {', '.join(OUTER_OPTIMIZERS)}"
    )


def check_outer_loop(a: Mapping[str, Any]) -> None:
    """Refuse outer-loop settings that make no sense, naming the flag and the fix.

    Args:
        a: an experiment's flat arguments.

    Raises:
        ValueError: one line.
    """
    schedule, every, iterations = a["lr_schedule"], a["schedule_every"], a["iterations"]
    clamp = a.get("grad_clamp")
    if clamp is not None and not (math.isfinite(clamp) and clamp > 0):
        raise ValueError(f"--grad-clamp {clamp}: must be a positive finite number (the bound "
                         "of each meta-gradient entry; leave it out for no clamp)")  # fmt: skip
    smoothing = a.get("label_smoothing")
    if smoothing is not None and not 0 <= smoothing < 1:
        raise ValueError(f"--label-smoothing {smoothing}: must be in [0, 1) (0: none)")
    decay, momentum = a["weight_decay"], a["outer_momentum"]
    if not (math.isfinite(decay) and decay >= 0):
        raise ValueError(f"--weight-decay {decay}: must be >= 0 and finite (0: none)")
    if a.get("weight_decay_on", "all") != "all" and not decay:
        raise ValueError(f"--weight-decay-on {a['weight_decay_on']} says what --weight-decay "
                         "decays; add --weight-decay (e.g. 2e-4) or drop it")  # fmt: skip
    if not 0 <= momentum < 1:
        raise ValueError(f"--outer-momentum {momentum}: must be in [0, 1) (0: none)")
    if a["outer_optimizer"] != "sgd" and (momentum or a["nesterov"]):
        raise ValueError("--outer-momentum and --nesterov set SGD's momentum; add "
                         "--outer-optimizer sgd or drop them")  # fmt: skip
    if a["nesterov"] and not momentum:
        raise ValueError("--nesterov needs momentum: add --outer-momentum (e.g. 0.9)")
    if every < 1 or every > iterations:
        raise ValueError(f"--schedule-every {every}: must be in [1, --iterations {iterations}] "
                         "(meta-steps per scheduler step)")  # fmt: skip
    steps = iterations // every
    if schedule == "step":
        size = a["step_size"]
        if size is None or not 1 <= size <= steps:
            raise ValueError(f"--step-size {size}: --lr-schedule step needs a step size in "
                             f"[1, {steps}] (scheduler steps in the run: --iterations "
                             f"{iterations} / --schedule-every {every})")  # fmt: skip
        if not (math.isfinite(a["gamma"]) and a["gamma"] > 0):
            raise ValueError(f"--gamma {a['gamma']}: must be a positive finite number")
    elif a["step_size"] is not None:
        raise ValueError(f"--step-size is a setting of --lr-schedule step; drop it for "
                         f"--lr-schedule {schedule}")  # fmt: skip
    _check_piecewise(schedule, tuple(a.get("lr_milestones", ())),
                     tuple(a.get("lr_factors", ())), steps)  # fmt: skip
    eta_min, lr = a["eta_min"], a["outer_lr"]
    if schedule in ("cosine", "linear"):
        if not (math.isfinite(eta_min) and eta_min >= 0):
            raise ValueError(f"--eta-min {eta_min}: must be >= 0 and finite")
        if lr is not None and eta_min > lr:
            raise ValueError(f"--eta-min {eta_min} is above --outer-lr {lr}: the schedule "
                             "anneals down to it; give a smaller --eta-min")  # fmt: skip
    elif eta_min != 0:
        raise ValueError(f"--eta-min is the minimum of --lr-schedule cosine or linear; drop it "
                         f"for --lr-schedule {schedule}")  # fmt: skip


def _check_piecewise(schedule: str, milestones: tuple, factors: tuple, steps: int) -> None:
    """Refuse piecewise settings that make no sense, or given to another schedule."""
    if schedule != "piecewise":
        if milestones or factors:
            raise ValueError(f"--lr-milestones and --lr-factors are settings of --lr-schedule "
                             f"piecewise; drop them for --lr-schedule {schedule}")  # fmt: skip
        return
    if len(factors) != len(milestones) + 1:
        raise ValueError(f"--lr-factors has {len(factors)} values for {len(milestones)} "
                         "--lr-milestones; give one more factor than milestones (the first "
                         "holds from step 0)")  # fmt: skip
    if list(milestones) != sorted(set(milestones)) or not all(1 <= m <= steps for m in milestones):
        raise ValueError(f"--lr-milestones {' '.join(map(str, milestones))}: must increase "
                         f"within [1, {steps}] (scheduler steps in the run)")  # fmt: skip
    if not all(math.isfinite(f) and f > 0 for f in factors):
        raise ValueError(f"--lr-factors {' '.join(map(str, factors))}: must be positive and "
                         "finite")  # fmt: skip


# --------------------------------------------------------------------------- a meta-step's parts


def my_tasks(sampler: EpisodicSampler, meta_batch: int, gen: torch.Generator) -> list:
    """This rank's share of the global meta-batch (all of it in a single process).

    Every rank draws the whole meta-batch's indices from the same generator (microseconds
    per task) and builds only its own tasks, so N ranks train on exactly the tasks one
    process would, and the generator state is the same on every rank (resume, any N).
    With augmentation or random shots, each task's seed and support size are drawn with its
    indices, as `EpisodicSampler.batch` draws them, so a rank's tasks are those one process
    would build.
    """
    # seeds, shots: None unless augmenting, drawing random shots
    drawn = sampler.draw(gen, meta_batch)
    part = distributed.shard_slice(meta_batch)
    return sampler.tasks_from_indices(*(None if d is None else d[part] for d in drawn))


def check_finite_gradient(learner: MetaLearner) -> None:
    """Raise `NonFiniteGradientError` before the optimizer writes NaN into the weights:
    finite losses can still give an overflowing meta-gradient (one sync for all tensors)."""
    named = [(name, p.grad) for name, p in learner.named_parameters() if p.grad is not None]
    if not named or bool(torch.stack([g.isfinite().all() for _, g in named]).all()):
        return
    raise NonFiniteGradientError([name for name, g in named if not g.isfinite().all()])


def clamp_meta_gradient(learner: MetaLearner, bound: float | None) -> None:
    """Clamp every entry of the network's meta-gradient to ``[-bound, bound]`` in place
    (``--grad-clamp``; None: nothing), before the optimizer step.

    MAML++'s reference does this on ImageNet-like data (``'imagenet' in dataset_name``) to
    its classifier's parameters, not its learned inner rates (HowToTrainYourMAMLPytorch,
    few_shot_learning_system.py, ``meta_update``: ``param.grad.data.clamp_(-10, 10)``), so
    it bounds `MetaLearner.network_parameters` (torch's ``clip_grad_value_`` of those).
    """
    if bound is None:
        return
    for p in learner.network_parameters():
        if p.grad is not None:
            p.grad.clamp_(-bound, bound)


def solver_metrics(metrics: StepMetrics) -> dict[str, float]:
    """The ``train/cg_*`` metrics of a meta-step: iMAML's (`IMAMLMetrics`) when it ran CG,
    none for the other learners and first-order iMAML."""
    if not isinstance(metrics, IMAMLMetrics) or math.isnan(metrics.cg_converged):
        return {}
    return {TRAIN_CG_CONVERGED: metrics.cg_converged,
            TRAIN_CG_NEGATIVE_CURVATURE: metrics.cg_negative_curvature}  # fmt: skip
