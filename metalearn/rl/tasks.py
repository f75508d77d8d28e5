"""The meta-RL task distributions by name (Finn et al., 2017, Sec. 5.3).

``2dnav`` is `metalearn.rl.navigation.Navigation2D`, stepped in torch; the HalfCheetah and
Ant direction and velocity tasks are `metalearn.rl.mujoco.MujocoTasks`, on gymnasium's
MuJoCo (the optional extra ``pip install "metalearn[rl]"``), imported only when one of them
is asked for, so 2D navigation needs no gymnasium.
"""

from __future__ import annotations

from typing import Any

from metalearn.rl.navigation import Navigation2D

__all__ = ["TASKS", "task_distribution"]

TASKS = ("2dnav", "halfcheetah-dir", "halfcheetah-vel", "ant-dir", "ant-vel")
"""Every task distribution's name; after ``2dnav``, `metalearn.rl.mujoco.MUJOCO_TASKS`."""


def task_distribution(name: str, horizon: int) -> Any:
    """The task distribution ``name`` (one of `TASKS`), its episodes at most ``horizon`` steps.

    Returns:
        `Navigation2D` or `metalearn.rl.mujoco.MujocoTasks`: each has ``horizon``,
        ``dims()`` (the observation's and action's sizes), ``sample_goals`` and ``make_env``.

    Raises:
        ValueError: ``name`` is not one of `TASKS`.
        ImportError: a MuJoCo task without gymnasium (the message names the extra).
    """
    if name not in TASKS:
        raise ValueError(f"unknown task distribution {name!r}; choose one of {TASKS}")
    if name == "2dnav":
        return Navigation2D(horizon=horizon)
    from metalearn.rl.mujoco import MujocoTasks

    return MujocoTasks(name, horizon=horizon)
