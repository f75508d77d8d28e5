"""MAML-TRPO on policies (Finn et al., 2017, Sec. 5.3), tracked in Weights & Biases.

What: meta-trains the paper's Gaussian MLP policy (100-100 ReLU) so that one policy-gradient
step on a new task's episodes raises its return: 2D navigation to a goal, or HalfCheetah /
Ant running in a direction or at a velocity. Each iteration samples a meta-batch of tasks,
``--fast-batch`` episodes per task with theta (or ``--fast-batch-steps`` steps a task, as
maml_rl's sampler: the paper presets' budget), adapts each task's policy by
``--inner-steps`` policy-gradient steps, samples again with the adapted policies, and takes
one TRPO step on the meta-surrogate (`metalearn.rl.meta_objective`; ``--outer ppo``: a few
clipped first-order epochs instead). At the end the policy is evaluated on held-out tasks
(goals from their own seed stream): the return before adaptation and after each of
``--eval-inner-steps`` steps, with 95% intervals over the tasks.

Command:
    python experiments/rl_maml.py                          # 2D navigation, a few minutes on CPU
    python experiments/rl_maml.py --preset paper-2dnav      # maml_rl's point-robot settings
    python experiments/rl_maml.py --preset paper-halfcheetah-vel   # needs metalearn[rl]
    python experiments/rl_maml.py --env ant-dir --outer ppo --iterations 50
    python experiments/rl_maml.py --pretrain    # the paper's pretrained baseline (Figure 4)
    python experiments/rl_maml.py --resume --run-name NAME   # continue a stopped run

MuJoCo tasks need the optional extra: ``pip install "metalearn[rl]"``. The last line printed
is the post-adaptation return on the held-out tasks, e.g. ``test/return_post: -12.3 ± 1.2``;
``scripts/rl_adaptation.py`` compares saved runs and a random start after 0-3 steps.
Defaults and where each comes from: docs/algorithms.md ("Meta-RL").

The file reads top to bottom: the arguments and presets; the loop's steps
(`adapted_episodes`, `meta_iteration`, `evaluate`); `main`. What no experiment rewrites
(argument checks, the run folder's lock, resuming, signals, W&B, checkpoints) is
`metalearn.runs.policy_run.PolicyRun`.
Every task's goal and every episode's noise and reset come from seeds derived from ``--seed``
and where they are used (`metalearn.rl.sampler.TaskSampler`), so a resumed run repeats an
uninterrupted one.
"""

from __future__ import annotations

import os

# MKL picks its kernels by the buffers' memory alignment unless told not to, so the same
# float32 sums round differently from run to run and a resumed run drifts from an
# uninterrupted one (measured here: rollouts of the same seeds differed in about one call in
# three). STRICT keeps MKL's fast kernels, alignment-independent; it must be set before MKL's
# first call, so before torch is imported.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import math  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import dataclass, field, replace  # noqa: E402
from typing import Any, Literal  # noqa: E402

import torch  # noqa: E402

from metalearn.rl import (  # noqa: E402
    TASKS,
    TRPO,
    GaussianMLPPolicy,
    MetaObjective,
    NonFiniteEpisodesError,
    TaskSampler,
    checked_policy_batch,
    clipped_outer_step,
    mean_returns,
    task_distribution,
)
from metalearn.runs import arguments, experiment  # noqa: E402
from metalearn.runs.cli import flag  # noqa: E402
from metalearn.runs.experiment import Experiment  # noqa: E402
from metalearn.runs.lifecycle import UserError, require, run_cli  # noqa: E402
from metalearn.runs.policy_run import PolicyRun, saved_args  # noqa: E402

TRAIN_STREAM, TEST_STREAM = 0, 1  # seed paths: training tasks and the held-out tasks


@dataclass
class EnvArgs:
    """The task distribution."""

    env: Literal["2dnav", "halfcheetah-dir", "halfcheetah-vel", "ant-dir", "ant-vel"] = "2dnav"
    """2dnav (a point to a goal), or HalfCheetah / Ant by direction or velocity (MuJoCo)."""
    horizon: int | None = None
    """Steps per episode (default: maml_rl's max_path_length, 100 for 2dnav, 200 MuJoCo)."""


@dataclass
class TrainingArgs:
    """MAML-TRPO's settings (defaults: maml_rl's, see docs/algorithms.md), sized by preset."""

    iterations: int = 20
    """Meta-iterations (one outer step each)."""
    meta_batch: int = 10
    """Tasks per iteration (maml_rl: 40)."""
    fast_batch: int | None = None
    """Episodes per task and adaptation step (default 20, maml_rl's fast_batch_size, unless
    --fast-batch-steps is given)."""
    fast_batch_steps: int | None = None
    """Environment steps per task and adaptation step instead of episodes, at least
    --horizon: maml_rl's budget, fast_batch_size x max_path_length (the paper presets':
    2,000 for 2dnav, 4,000 MuJoCo), each task's episodes run one after another until the
    meta-batch's completed episodes hold it (metalearn.rl.budget); evaluation's tasks run
    budget / horizon episodes side by side, as maml_rl's test scripts."""
    inner_lr: float | None = None
    """Inner policy-gradient step size on the mean-over-steps surrogate (default: maml_rl's
    fast_lr, 0.5 for 2dnav, 0.1 MuJoCo)."""
    inner_steps: int = 1
    """Inner steps while training (maml_rl's num_grad_updates: 1)."""
    first_order: bool = False
    """FOMAML: no gradient through the inner step's gradient."""
    pretrain: bool = False
    """Train the MAML paper's "pretrained" baseline instead (Finn et al., 2017, Sec. 5.3),
    as maml_rl's MAMLTRPO with use_maml=False: one Adam step an iteration (--pretrain-lr) on
    the pre-update surrogate of the meta-batch's episodes with theta, no inner step and no
    trust region; evaluation adapts it as MAML's policy."""
    pretrain_lr: float | None = None
    """--pretrain: Adam's step size (default: maml_rl's FirstOrderOptimizer, 1e-3)."""
    outer: Literal["trpo", "ppo"] = "trpo"
    """Outer step: trpo (the paper's) or ppo (clipped first-order epochs, Adam); each reads
    its own settings below and refuses the other's."""
    max_kl: float | None = None
    """--outer trpo: the trust region (default: maml_rl's meta_step_size, 0.01)."""
    cg_iters: int | None = None
    """--outer trpo: conjugate-gradient iterations of the direction (default: rllab's 10)."""
    cg_damping: float | None = None
    """--outer trpo: damping added to the KL Hessian, >= 0 (default: rllab's 1e-5)."""
    ppo_clip: float | None = None
    """--outer ppo: the ratio's clip epsilon (default 0.2)."""
    ppo_epochs: int | None = None
    """--outer ppo: Adam steps per iteration on the same episodes (default 5)."""
    ppo_lr: float | None = None
    """--outer ppo: Adam's step size (default 1e-3)."""
    discount: float = 0.99
    """Gamma (maml_rl's 0.99)."""
    gae_lambda: float = 1.0
    """GAE's lambda (maml_rl's 1: reward-to-go minus the linear baseline)."""
    hidden: tuple[int, ...] = (100, 100)
    """Policy hidden layers (the paper's 100-100 ReLU)."""
    eval_tasks: int = 40
    """Held-out tasks at the end."""
    eval_inner_steps: int = 3
    """Adaptation steps evaluated (the paper's Figure 4 shows 1 to 3)."""
    eval_later_lr_factor: float = 0.5
    """Evaluation's steps after the first take this times --inner-lr (maml_rl's test
    scripts: the first step at the fast rate, the later ones at half of it)."""
    checkpoint_every: int = 1
    """Iterations between checkpoints."""
    seed: int = 0
    """Seeds the initial policy, every task and every episode."""


@dataclass
class TrackingArgs(arguments.TrackingArgs):
    """Where the run is kept and how it is logged."""

    wandb_project: str = "metalearn-rl"
    """W&B project."""


@dataclass
class SystemArgs:
    """Where and how fast it runs; neither changes the numbers a run computes on CPU."""

    device: str = "cpu"
    """Torch device of the policy (MuJoCo itself steps on the CPU)."""
    threads: int = 1
    """Torch CPU threads."""


@dataclass
class Args:
    """Arguments of the meta-RL experiment (each is a --flag)."""

    preset: Literal[
        "cpu",
        "paper-2dnav",
        "paper-halfcheetah-dir",
        "paper-halfcheetah-vel",
        "paper-ant-dir",
        "paper-ant-vel",
        "gpu-2dnav",
        "gpu-halfcheetah-vel",
    ] = "cpu"
    """Named configuration: cpu (the defaults: 2D navigation, a few minutes on 2 cores),
    the paper's settings (maml_rl's scripts), or gpu-* (longer runs for a GPU)."""
    env: EnvArgs = field(default_factory=EnvArgs)
    """Environment options."""
    training: TrainingArgs = field(default_factory=TrainingArgs)
    """Training options."""
    tracking: TrackingArgs = field(default_factory=TrackingArgs)
    """Tracking options."""
    system: SystemArgs = field(default_factory=SystemArgs)
    """System options."""


# maml_rl at commit 9c8e2eb: maml_examples/cluster_maml_trpo_{cheetah,ant}.py (MuJoCo): 40
# tasks, fast_batch_size 20 x max_path_length 200 steps, 800 iterations, max KL 0.01; 2D
# navigation: maml_trpo_point.py's 100 iterations of 20 x 100 steps, at the 20 tasks of the
# policy its test evaluates (test_maml_point.py: "trpomaml1_fbs20_mbs20_flr_0.5").
PAPER = dict(meta_batch=40, eval_tasks=40)
MUJOCO_PAPER = dict(PAPER, iterations=800, fast_batch_steps=20 * 200)
NAV_PAPER = dict(PAPER, env="2dnav", meta_batch=20, fast_batch_steps=20 * 100)
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {},  # the defaults of Args
    "paper-2dnav": {**NAV_PAPER, "iterations": 100},
    **{f"paper-{env}": {**MUJOCO_PAPER, "env": env} for env in TASKS[1:]},
    "gpu-2dnav": {**NAV_PAPER, "iterations": 500, "device": "cuda"},
    "gpu-halfcheetah-vel": {**MUJOCO_PAPER, "env": "halfcheetah-vel", "device": "cuda"},
}


# Each outer step's settings and their defaults: TRPO's are its own (`metalearn.rl.TRPO`, at
# maml_rl's and rllab's values); the clipped step's are this experiment's.
OUTER_DEFAULTS = {
    "trpo": {"max_kl": TRPO.max_kl, "cg_iters": TRPO.cg_iters, "cg_damping": TRPO.damping},
    "ppo": {"ppo_clip": 0.2, "ppo_epochs": 5, "ppo_lr": 1e-3},
}


PRETRAIN_LR = 1e-3
"""maml_rl's ``FirstOrderOptimizer`` default (Adam at 1e-3), which ``MAMLNPO`` builds for
``use_maml=False`` (``sandbox/rocky/tf/algos/maml_npo.py``)."""


def resolve(args: Args) -> Args:
    """The environment's reference values for the open ``--horizon`` and ``--inner-lr``,
    20 episodes unless a step budget is given, and the outer step's defaults for its open
    settings (the other's, and with ``--pretrain`` both, stay unset)."""
    nav, t = args.env.env == "2dnav", args.training
    env = replace(args.env, horizon=args.env.horizon or (100 if nav else 200))
    lr = t.inner_lr if t.inner_lr is not None else (0.5 if nav else 0.1)
    fast_batch = t.fast_batch if t.fast_batch is not None or t.fast_batch_steps else 20
    if t.pretrain:
        own = {"pretrain_lr": PRETRAIN_LR if t.pretrain_lr is None else t.pretrain_lr}
    else:
        own = {k: default if getattr(t, k) is None else getattr(t, k)
               for k, default in OUTER_DEFAULTS[t.outer].items()}  # fmt: skip
    return replace(args, env=env, training=replace(t, inner_lr=lr, fast_batch=fast_batch, **own))


def check_args(args: Args) -> None:
    """Refuse what cannot run, before anything is written (`UserError`, one line)."""
    t, horizon = args.training, args.env.horizon
    counts = ("iterations", "meta_batch", "fast_batch", "fast_batch_steps", "inner_steps",
              "cg_iters", "ppo_epochs", "checkpoint_every")  # fmt: skip
    experiment.require_at_least_one(vars(t), counts)
    require(t.fast_batch is None or t.fast_batch_steps is None,
            f"--fast-batch {t.fast_batch} (episodes) and --fast-batch-steps "
            f"{t.fast_batch_steps} (steps) both set (the paper presets set the steps); "
            "pass one")  # fmt: skip
    require(t.fast_batch_steps is None or t.fast_batch_steps >= (horizon or 100),
            f"--fast-batch-steps {t.fast_batch_steps}: below one episode of --horizon "
            f"{horizon or 100} steps; pass at least the horizon")  # fmt: skip
    check_pretrain(t)
    require(t.eval_tasks >= 2, f"--eval-tasks {t.eval_tasks}: an interval needs 2 tasks")
    hidden = " ".join(map(str, t.hidden))
    require(all(units >= 1 for units in t.hidden),
            f"--hidden {hidden}: every hidden layer needs at least 1 unit")  # fmt: skip
    require(t.cg_damping is None or (math.isfinite(t.cg_damping) and t.cg_damping >= 0),
            f"--cg-damping {t.cg_damping}: must be >= 0 and finite")  # fmt: skip
    for outer, settings in OUTER_DEFAULTS.items():
        for name in settings if outer != t.outer else ():
            require(getattr(t, name) is None,
                    f"{flag(name)} {getattr(t, name)} is a setting of --outer {outer}; drop it "
                    f"for --outer {t.outer}")  # fmt: skip
    require(0 <= t.eval_inner_steps <= 10, f"--eval-inner-steps {t.eval_inner_steps}: 0 to 10")
    require(horizon is None or horizon >= 1, f"--horizon {horizon}: must be at least 1")
    require(
        args.env.env == "2dnav" or horizon is None or horizon <= 1000,
        f"--horizon {horizon}: gymnasium's MuJoCo episodes end at 1000 steps; pass at most 1000",
    )
    rates = ("inner_lr", "max_kl", "ppo_lr", "discount", "ppo_clip", "eval_later_lr_factor",
             "pretrain_lr")  # fmt: skip
    experiment.require_positive_finite(vars(t), rates)
    require(
        t.discount <= 1 and 0 <= t.gae_lambda <= 1,
        "--discount and --gae-lambda must be in (0, 1] and [0, 1]",
    )
    require(0 <= t.seed < 2**32, f"--seed {t.seed}: must be in [0, 2**32)")
    # One iteration's episodes and the meta-objective's graph over all of them at once (a
    # step budget's batch: the budget and an episode's padding).
    per_task = ((t.fast_batch or 20) * (horizon or 200) if t.fast_batch_steps is None
                else t.fast_batch_steps + (horizon or 200))  # fmt: skip
    steps = max(t.meta_batch, t.eval_tasks) * per_task
    need = steps * (t.inner_steps + 1) * (4 * sum(t.hidden) + 64) * 4
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    batch = (f"--fast-batch {t.fast_batch} x --horizon {horizon}" if t.fast_batch_steps is None
             else f"--fast-batch-steps {t.fast_batch_steps}")  # fmt: skip
    require(
        need < have / 2,
        f"--meta-batch {t.meta_batch} x {batch} "
        f"needs about {need / 2**30:.0f} GiB, more than half of this machine's "
        f"{have / 2**30:.0f} GiB; lower one of them",
    )


def check_pretrain(t: TrainingArgs) -> None:
    """``--pretrain`` takes its own step (Adam at ``--pretrain-lr``), so it refuses the outer
    steps' settings, and ``--pretrain-lr`` is refused without it."""
    if not t.pretrain:
        require(t.pretrain_lr is None,
                f"--pretrain-lr {t.pretrain_lr} is a setting of --pretrain; drop it or add "
                "--pretrain")  # fmt: skip
        return
    require(t.outer == "trpo",
            f"--outer {t.outer} with --pretrain: the pretrained baseline takes its own step "
            "(Adam at --pretrain-lr, maml_rl's use_maml=False); drop --outer")  # fmt: skip
    for name in (k for settings in OUTER_DEFAULTS.values() for k in settings):
        require(getattr(t, name) is None,
                f"{flag(name)} {getattr(t, name)} is a setting of the outer step, which "
                "--pretrain does not take (Adam at --pretrain-lr); drop it")  # fmt: skip


EXPERIMENT = Experiment("rl_maml", Args, __doc__, PRESETS, check=check_args, resolve=resolve)


def parse_args(argv: Sequence[str] | None = None) -> Args:
    """The command line as `Args`; ``--resume --run-name NAME`` alone continues that run."""
    return experiment.parse_args(EXPERIMENT, argv, saved_args=own_outer_settings)


def own_outer_settings(exp: Experiment, path: Any) -> dict[str, Any]:
    """A saved run's arguments (`saved_args`) less the settings of the outer step it did not
    take, which runs recorded at their defaults before each step refused the other's."""
    flat = saved_args(exp, path)
    unread = [k for outer, names in OUTER_DEFAULTS.items() if outer != flat.get("outer")
              for k in names]  # fmt: skip
    return {**flat, **dict.fromkeys(unread)}


# --------------------------------------------------------------------------- the loop's steps


def processed(t: TrainingArgs, episodes: Any, iteration: int, phase: str) -> Any:
    """The `PolicyBatch` of ``episodes``, advantages centred and scaled per task (the
    library's default, maml_rl's center_adv); a non-finite reward, return or advantage raises
    `NonFiniteEpisodesError` naming the task, the iteration (1-based) and the phase."""
    return checked_policy_batch(episodes, iteration + 1, phase, discount=t.discount,
                                gae_lambda=t.gae_lambda)  # fmt: skip


def draw(t: TrainingArgs, sample: TaskSampler, params: dict, goals: torch.Tensor,
         path: tuple[int, int, int], per_task: bool, streams: int) -> Any:  # fmt: skip
    """One phase's episodes: ``--fast-batch`` a task, or ``--fast-batch-steps`` steps a task
    run by ``streams`` environments a task in lockstep (`TaskSampler.budget`)."""
    if t.fast_batch_steps is None:
        return sample(params, goals, path, t.fast_batch, per_task)
    return sample.budget(params, goals, path, t.fast_batch_steps, per_task, streams)


def adapted_episodes(t: TrainingArgs, sample: TaskSampler, objective: MetaObjective,
                     params: dict, goals: torch.Tensor, stream: int, iteration: int,
                     steps: int, where: str = "", later_lr_factor: float = 1.0,
                     streams: int = 1) -> tuple:  # fmt: skip
    """Episodes with theta and after each of ``steps`` inner steps (the 2nd and later at
    ``later_lr_factor`` times the rate): ``(batches, returns, last episodes)``, the
    `PolicyBatch` of each phase before the last and each phase's ``[K]`` returns."""
    batches, returns, phis, per_task = [], [], params, False
    later = replace(objective, lr=objective.lr * later_lr_factor)
    for phase in range(steps + 1):
        episodes = draw(t, sample, phis, goals, (stream, iteration, phase), per_task, streams)
        returns.append(mean_returns(episodes))  # undiscounted, as maml_rl reports
        if phase == steps:
            return batches, returns, episodes
        batch = processed(t, episodes, iteration, f"{where}inner step {phase}")
        batches.append(batch)
        step = objective if phase == 0 else later
        phis = step.adapt_tasks(sample.policy, phis, batch, per_task=per_task)
        per_task = True
    raise AssertionError("unreachable")  # the loop returns at phase == steps


def meta_iteration(t: TrainingArgs, sample: TaskSampler, objective: MetaObjective,
                   policy: torch.nn.Module, opt: Any, iteration: int) -> dict:  # fmt: skip
    """One MAML-TRPO iteration (Finn et al., 2017, Algorithm 3) on a fresh meta-batch; its
    metrics. The policy's parameters are updated in place. ``--pretrain``: no inner step,
    and one step of ``opt`` (Adam) on the surrogate of the tasks' episodes with theta
    (maml_rl's ``use_maml=False``: ``FirstOrderOptimizer(max_epochs=1, batch_size=None)``
    on ``all_surr_objs[0]``, ``maml_npo.py``)."""
    start, steps_before, seconds_before = time.perf_counter(), sample.steps, sample.seconds
    goals = sample.goals(TRAIN_STREAM, iteration, t.meta_batch)
    # a copy: Adam (--pretrain, --outer ppo) updates the parameters in place
    theta = {k: v.detach().clone() for k, v in policy.named_parameters()}
    inner_steps = 0 if t.pretrain else t.inner_steps
    inner, returns, outer_episodes = adapted_episodes(
        t, sample, objective, theta, goals, TRAIN_STREAM, iteration, inner_steps
    )
    outer = processed(t, outer_episodes, iteration, "outer")
    tasks = objective.prepare(policy, theta, tuple(inner), outer)
    if t.pretrain:  # the ratio's gradient at theta is the pre-update surrogate's
        live = dict(policy.named_parameters())
        clipped_outer_step(lambda p: objective(policy, p, tasks), live, opt, epochs=1)
        new = {k: v.detach() for k, v in live.items()}
        with torch.no_grad():
            kl, accepted = float(objective(policy, new, tasks)[1]), 1.0
    elif t.outer == "trpo":
        trpo = TRPO(max_kl=t.max_kl, damping=t.cg_damping, cg_iters=t.cg_iters)
        result = trpo.step(lambda p: objective(policy, p, tasks), theta)
        kl, accepted, new = result.kl, float(result.accepted), result.params
    else:
        clipped = replace(objective, clip=t.ppo_clip)
        live = dict(policy.named_parameters())
        history = clipped_outer_step(lambda p: clipped(policy, p, tasks), live, opt, t.ppo_epochs)
        kl, accepted, new = history[-1][1], 1.0, {k: v.detach() for k, v in live.items()}
    step_size = math.sqrt(sum(float((new[k] - theta[k]).pow(2).sum()) for k in theta))
    with torch.no_grad():
        for name, p in policy.named_parameters():
            p.copy_(new[name])
    sampled, sampling_s = sample.steps - steps_before, sample.seconds - seconds_before
    return {
        "train/return_pre": float(returns[0].mean()),
        "train/return_post": float(returns[-1].mean()),
        "train/kl": kl, "train/step_size": step_size, "train/accepted": accepted,
        "perf/env_steps_per_s": sampled / sampling_s, "perf/step_s": time.perf_counter() - start,
    }  # fmt: skip


def evaluate(
    t: TrainingArgs, sample: TaskSampler, objective: MetaObjective, policy: torch.nn.Module
) -> dict[str, float]:
    """Return on ``--eval-tasks`` held-out tasks before and after each adaptation step (the
    2nd and later at ``--eval-later-lr-factor`` times the rate), with 95% intervals over the
    tasks; ``test/return_post`` after ``--inner-steps`` steps. The tasks and their episodes'
    seeds depend on ``--seed`` only, so policies evaluated with one seed meet the same ones."""
    goals = sample.goals(TEST_STREAM, 0, t.eval_tasks)
    theta = {k: v.detach() for k, v in policy.named_parameters()}
    steps = max(t.eval_inner_steps, t.inner_steps)
    _, returns, _ = adapted_episodes(
        t, sample, objective, theta, goals, TEST_STREAM, 0, steps, "held-out tasks, ",
        later_lr_factor=t.eval_later_lr_factor, streams=eval_streams(t, sample),
    )  # fmt: skip
    results = {}
    for k, r in enumerate(returns):
        results[f"test/return_step{k}"] = float(r.mean())
        results[f"test/return_step{k}_ci95"] = 1.96 * float(r.std()) / math.sqrt(len(r))
    for name, k in (("pre", 0), ("post", t.inner_steps)):  # the headline: k steps as trained
        results[f"test/return_{name}"] = results[f"test/return_step{k}"]
        results[f"test/return_{name}_ci95"] = results[f"test/return_step{k}_ci95"]
    results["perf/env_steps_per_s"] = sample.steps / sample.seconds
    return results


def eval_streams(t: TrainingArgs, sample: TaskSampler) -> int:
    """Environments a held-out task's step budget runs side by side: maml_rl's test
    scripts' VPG sampler, ``batch_size / max_path_length`` of them, 1 to 100
    (``vectorized_sampler.py``, ``start_worker``)."""
    if t.fast_batch_steps is None:
        return 1
    return max(1, min(t.fast_batch_steps // sample.dist.horizon, 100))


def show(row: dict[str, float]) -> str:
    return (
        f"return {row['train/return_pre']:.2f} -> {row['train/return_post']:.2f}  "
        f"kl {row['train/kl']:.4f}  steps/s {row['perf/env_steps_per_s']:.0f}"
    )


# --------------------------------------------------------------------------- main


def build(a: Args) -> tuple[GaussianMLPPolicy, MetaObjective, TaskSampler]:
    """The resolved arguments' policy (its initialisation from ``--seed``), inner step and
    sampler (its tasks and episodes from ``--seed``)."""
    t, device = a.training, a.system.device
    try:  # Navigation2D, or MujocoTasks (the optional extra)
        dist = task_distribution(a.env.env, a.env.horizon)
    except ImportError:
        raise UserError(
            f'--env {a.env.env} needs gymnasium with MuJoCo: pip install "metalearn[rl]"'
        ) from None
    torch.manual_seed(t.seed)
    policy = GaussianMLPPolicy(*dist.dims(), hidden=t.hidden).to(device)
    # The library's defaults are maml_rl's step (the mean over a task's steps, the KL over
    # all tasks' steps at once): only the rate and the order are the run's.
    objective = MetaObjective(lr=t.inner_lr, first_order=t.first_order)
    return policy, objective, TaskSampler(dist, policy, t.seed, device)


def main(args: Args) -> dict[str, float]:
    """Meta-train, evaluate on held-out tasks, log everything; returns the results.

    Raises:
        UserError: a bad argument, MuJoCo missing, a resume that changes the run, a
            non-finite return or advantage (the last completed iteration is kept).
        Stopped: SIGINT/SIGTERM; the run was checkpointed.
    """
    with PolicyRun(EXPERIMENT, args) as run:  # checked, resolved, locked; resumed if asked
        t = run.args.training
        policy, objective, sample = build(run.args)
        opt = None
        if t.pretrain or t.outer == "ppo":  # maml_rl's Adam for --pretrain
            lr = t.pretrain_lr if t.pretrain else t.ppo_lr
            opt = torch.optim.Adam(policy.parameters(), lr=lr)
        run.start({"policy": policy, **({"optimizer": opt} if opt is not None else {})})
        try:
            for iteration in run.steps():
                run.log(meta_iteration(t, sample, objective, policy, opt, iteration), show)
            results = evaluate(t, sample, objective, policy)
        except NonFiniteEpisodesError as err:
            raise UserError(str(err)) from None
        return run.finish(results, headline=("test/return_post", "test/return_post_ci95"))


if __name__ == "__main__":
    run_cli(main, parse_args)
