"""HalfCheetah and Ant direction and velocity tasks (Finn et al., 2017, Sec. 5.3) on
gymnasium's MuJoCo environments: the optional extra ``pip install "metalearn[rl]"``.

Rewards as the paper's reference code (maml_rl's ``half_cheetah_env_rand*.py`` and
``ant_env_rand*.py``), with gymnasium's forward velocity ``v`` (``info["x_velocity"]``)
and the action clipped to the action box [-1, 1] (rllab's ``normalize``):

* ``halfcheetah-vel``: ``-|v - g| - 0.05 |a|^2``, goal velocity g uniform in [0, 2];
* ``halfcheetah-dir``: ``d v - 0.05 |a|^2``, direction d = +1 or -1 with equal chance;
* ``ant-vel``: ``-|v - g| + 1 - 0.005 |a|^2 - 0.0005 |clip(f, -1, 1)|^2 + 0.05``, g uniform
  in [0, 3], f the external contact forces (``data.cfrc_ext``);
* ``ant-dir``: ``d v - 0.005 |a|^2 - 0.0005 |clip(f, -1, 1)|^2 + 0.05``.

Horizon 200 (maml_rl's ``max_path_length`` for both). An Ant episode ends when the torso
leaves gymnasium's healthy height range [0.2, 1.0] (rllab's ant's condition). Each episode
resets from its own seed; the ``[K, B]`` environments step in a Python loop (MuJoCo steps
in C, one core). MuJoCo 4 warns that gymnasium's Ant model uses a deprecated attribute
(``settotalmass``), on stderr and in ``MUJOCO_LOG.TXT`` in the working directory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

try:
    import gymnasium
except ImportError as error:  # the optional extra
    raise ImportError(
        'metalearn.rl.mujoco needs gymnasium with MuJoCo: pip install "metalearn[rl]"'
    ) from error

from metalearn.rl.seeds import generator
from metalearn.rl.tasks import TASKS

__all__ = ["MUJOCO_TASKS", "MujocoEnv", "MujocoTasks"]

MUJOCO_TASKS = TASKS[1:]  # halfcheetah-dir, halfcheetah-vel, ant-dir, ant-vel


@dataclass(frozen=True)
class MujocoTasks:
    """A task distribution by name (one of `MUJOCO_TASKS`)."""

    name: str
    horizon: int = 200

    def __post_init__(self) -> None:
        if self.name not in MUJOCO_TASKS:
            raise ValueError(f"unknown MuJoCo task {self.name!r}; choose one of {MUJOCO_TASKS}")

    @property
    def env_id(self) -> str:
        return "HalfCheetah-v5" if self.name.startswith("halfcheetah") else "Ant-v5"

    @property
    def velocity(self) -> bool:
        return self.name.endswith("-vel")

    def dims(self) -> tuple[int, int]:
        """``(obs_dim, action_dim)`` of the environment."""
        env = gymnasium.make(self.env_id)
        dims = env.observation_space.shape[0], env.action_space.shape[0]
        env.close()
        return dims

    def sample_goals(self, seeds: Sequence[int]) -> Tensor:
        """One goal per task seed, ``[K]`` float64: a velocity, or a direction +-1."""
        u = torch.stack(
            [torch.rand((), generator=generator(s), dtype=torch.float64) for s in seeds]
        )
        if self.velocity:
            return u * (2.0 if self.name.startswith("halfcheetah") else 3.0)
        return torch.where(u < 0.5, -1.0, 1.0).double()

    def make_env(
        self, goals: Tensor, seeds: Sequence[Sequence[int]], reuse: MujocoEnv | None = None
    ) -> MujocoEnv:
        """``[K, B]`` environments, task k's heading for ``goals[k]``, episode (k, b) reset
        from ``seeds[k][b]``; ``reuse``: an env of this distribution and shape to reassign
        instead of building new ones (building costs about 0.1 s per environment)."""
        shape = (len(seeds), len(seeds[0]))
        env = reuse if reuse is not None and reuse.tasks == self and reuse.shape == shape else None
        env = env or MujocoEnv(self, shape)
        env.assign(goals, seeds)
        return env


class MujocoEnv:
    """``[K, B]`` gymnasium MuJoCo environments (a `metalearn.rl.episodes.VectorEnv`)."""

    def __init__(self, tasks: MujocoTasks, shape: tuple[int, int]):
        self.tasks = tasks
        self.horizon = tasks.horizon
        self.shape = shape
        self.envs = [
            [gymnasium.make(tasks.env_id) for _ in range(shape[1])] for _ in range(shape[0])
        ]
        self.alive = np.ones(self.shape, dtype=bool)

    def assign(self, goals: Tensor, seeds: Sequence[Sequence[int]]) -> None:
        """Give task k the goal ``goals[k]`` and episode (k, b) the reset seed ``seeds[k][b]``."""
        if goals.shape != self.shape[:1] or any(len(row) != self.shape[1] for row in seeds):
            raise ValueError(
                f"goals [K] and seeds [K][B] must match the env's [K, B] = {self.shape}, got "
                f"{tuple(goals.shape)} and {len(seeds)} rows"
            )
        self.goals = goals.tolist()
        self.seeds = [list(row) for row in seeds]

    def reset(self) -> Tensor:
        self.alive[:] = True
        obs = [
            [env.reset(seed=seed % 2**32)[0] for env, seed in zip(envs, row)]
            for envs, row in zip(self.envs, self.seeds)
        ]
        self.last = np.asarray(obs)
        return torch.as_tensor(self.last, dtype=torch.float32)

    def step(self, actions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        actions = actions.detach().cpu().double().clamp(-1, 1).numpy()
        reward = np.zeros(self.shape)
        done = ~self.alive.copy()
        for k, envs in enumerate(self.envs):
            for b, env in enumerate(envs):
                if not self.alive[k, b]:
                    continue
                obs, _, terminated, _, info = env.step(actions[k, b])
                reward[k, b] = self._reward(env, info, actions[k, b], self.goals[k])
                self.last[k, b] = obs
                if terminated:
                    self.alive[k, b] = False
                    done[k, b] = True
        return (
            torch.as_tensor(self.last, dtype=torch.float32),
            torch.as_tensor(reward, dtype=torch.float32),
            torch.as_tensor(done),
        )

    def _reward(self, env, info: dict, action: np.ndarray, goal: float) -> float:
        v = float(info["x_velocity"])
        forward = -abs(v - goal) if self.tasks.velocity else goal * v
        if self.tasks.env_id == "HalfCheetah-v5":
            return forward - 0.05 * float(np.sum(action**2))
        contact = np.clip(env.unwrapped.data.cfrc_ext, -1, 1)
        costs = 0.005 * float(np.sum(action**2)) + 0.0005 * float(np.sum(contact**2))
        return forward + (1.0 if self.tasks.velocity else 0.0) - costs + 0.05

    def close(self) -> None:
        for envs in self.envs:
            for env in envs:
                env.close()
