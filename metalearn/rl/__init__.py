"""Meta-reinforcement learning: MAML on policies (Finn et al., 2017, Sec. 5.3).

One concept per module, bottom-up:

* `seeds`: every task's and episode's seed, derived from the run's seed and a path;
* `episodes`: `Episodes` (what a rollout returns, `mean_returns` its tasks' returns),
  `PolicyBatch` (with advantages), the `VectorEnv` protocol;
* `navigation`: 2D navigation, batched in torch; `mujoco`: HalfCheetah and Ant direction
  and velocity tasks on gymnasium (the optional ``rl`` extra; imported from there);
  `tasks`: the task distributions by name;
* `policy`: the Gaussian MLP policy; `budget`: which episodes a step budget keeps (maml_rl's
  lockstep sampler); `sampler`: seeded, batched rollouts, and `TaskSampler`, a meta-batch's
  goals and episodes from their seed paths (a number of episodes or of steps a task);
* `advantage`: returns and GAE; `baseline`: the linear feature baseline;
  `processing`: episodes to a `PolicyBatch` (`checked_policy_batch`: refused if not finite);
* `adaptation`: the inner policy-gradient step through `metalearn.engine`;
* `meta_objective`: the meta-surrogate and its KL, over a task batch (vmap or loop);
* `trpo`: the outer TRPO step; `ppo`: a clipped outer step.
"""

from metalearn.rl.adaptation import adapt_policy, policy_gradient_loss
from metalearn.rl.advantage import discounted_returns, gae, normalize_advantages
from metalearn.rl.baseline import fit_linear_baseline, linear_baseline_values
from metalearn.rl.episodes import Episodes, PolicyBatch, VectorEnv, mean_returns
from metalearn.rl.meta_objective import MetaObjective, MetaTask, leave_one_out
from metalearn.rl.navigation import Navigation2D, NavigationEnv
from metalearn.rl.policy import GaussianMLPPolicy, Stats
from metalearn.rl.ppo import clipped_outer_step
from metalearn.rl.processing import (
    NonFiniteEpisodesError,
    check_finite,
    checked_policy_batch,
    policy_batch,
)
from metalearn.rl.sampler import TaskSampler, episode_noise, rollout
from metalearn.rl.seeds import derive_seed, derive_seeds
from metalearn.rl.tasks import TASKS, task_distribution
from metalearn.rl.trpo import TRPO, TRPOResult

__all__ = [
    "TASKS",
    "TRPO",
    "Episodes",
    "GaussianMLPPolicy",
    "MetaObjective",
    "MetaTask",
    "NonFiniteEpisodesError",
    "Navigation2D",
    "NavigationEnv",
    "PolicyBatch",
    "Stats",
    "TRPOResult",
    "TaskSampler",
    "VectorEnv",
    "adapt_policy",
    "check_finite",
    "checked_policy_batch",
    "clipped_outer_step",
    "derive_seed",
    "derive_seeds",
    "discounted_returns",
    "episode_noise",
    "fit_linear_baseline",
    "gae",
    "leave_one_out",
    "linear_baseline_values",
    "mean_returns",
    "normalize_advantages",
    "policy_batch",
    "policy_gradient_loss",
    "rollout",
    "task_distribution",
]
