"""A meta-batch's goals and episodes (`TaskSampler`) from their seed paths, whatever the
batch; each task's mean return against a loop; `checked_policy_batch` refusing non-finite
episodes; the task distributions by name."""

from __future__ import annotations

import sys

import pytest
import torch

from metalearn.rl import (
    TASKS,
    GaussianMLPPolicy,
    Navigation2D,
    NonFiniteEpisodesError,
    TaskSampler,
    checked_policy_batch,
    derive_seed,
    episode_noise,
    mean_returns,
    policy_batch,
    rollout,
    task_distribution,
)
from metalearn.rl.seeds import derive_seeds


def nav_sampler(seed: int = 5, horizon: int = 12) -> tuple[TaskSampler, dict]:
    torch.manual_seed(0)
    policy = GaussianMLPPolicy(2, 2, hidden=(8,))
    sampler = TaskSampler(Navigation2D(horizon=horizon), policy, seed, "cpu")
    return sampler, {k: v.detach() for k, v in policy.named_parameters()}


def test_goals_come_from_their_tasks_seed_paths_whatever_the_count():
    sampler, _ = nav_sampler()
    goals = sampler.goals(1, 4, 3)
    for k in range(3):
        alone = Navigation2D().sample_goals([derive_seed(5, 1, 4, k)])
        assert torch.equal(goals[k], alone[0])
    assert torch.equal(sampler.goals(1, 4, 2), goals[:2])
    assert not torch.equal(sampler.goals(0, 4, 3), goals)  # another stream, other tasks


def test_an_episode_is_its_seed_paths_whatever_else_is_in_the_batch():
    sampler, theta = nav_sampler()
    goals = sampler.goals(0, 2, 3)
    big = sampler(theta, goals, (0, 2, 1), 5, per_task=False)
    small = sampler(theta, goals[:2], (0, 2, 1), 3, per_task=False)
    for field in ("obs", "actions", "rewards", "mask"):
        assert torch.equal(getattr(small, field), getattr(big, field)[:2, :3])
    assert big.rewards.shape == (3, 5, 12)
    # task 1's episode 2 by hand: its noise from (stream, iteration, task, phase, episode)
    noise = episode_noise(sampler.policy, [[derive_seed(5, 0, 2, 1, 1, 2)]], 12, torch.float32)
    env = Navigation2D(horizon=12).make_env(goals[1:2], 1)
    alone = rollout(env, sampler.policy, theta, noise)  # a [1, 1] batch: other matmul kernels
    torch.testing.assert_close(alone.actions[0, 0], big.actions[1, 2])
    other_phase = sampler(theta, goals, (0, 2, 0), 5, per_task=False)
    assert not torch.equal(other_phase.actions, big.actions)
    assert sampler.steps == int(big.mask.sum() + small.mask.sum() + other_phase.mask.sum())


def test_mean_returns_is_each_tasks_mean_undiscounted_return():
    sampler, theta = nav_sampler()
    episodes = sampler(theta, sampler.goals(0, 0, 3), (0, 0, 0), 4, per_task=False)
    rewards = episodes.rewards.double()
    expect = [  # float64 sums over each task's episodes and steps
        sum(sum(rewards[k, b, t].item() for t in range(12)) for b in range(4)) / 4 for k in range(3)
    ]
    torch.testing.assert_close(mean_returns(episodes), torch.tensor(expect).float())


def test_checked_policy_batch_is_policy_batch_or_names_the_bad_task():
    sampler, theta = nav_sampler()
    episodes = sampler(theta, sampler.goals(0, 0, 3), (0, 0, 0), 4, per_task=False)
    checked = checked_policy_batch(episodes, 3, "outer", discount=0.9, normalize=True)
    expect = policy_batch(episodes, discount=0.9, normalize=True)
    for got, want in zip(checked, expect):
        assert torch.equal(got, want)
    rewards = episodes.rewards.clone()
    rewards[2, 1, 5] = float("inf")
    with pytest.raises(NonFiniteEpisodesError) as error:
        checked_policy_batch(episodes._replace(rewards=rewards), 3, "inner step 0")
    assert str(error.value).startswith(
        "non-finite rewards in task 2 of iteration 3 (inner step 0 episodes);"
    )


def test_task_distributions_by_name():
    nav = task_distribution("2dnav", 7)
    assert nav == Navigation2D(horizon=7) and nav.dims() == (2, 2)
    with pytest.raises(ValueError, match="unknown task distribution 'pong'"):
        task_distribution("pong", 7)
    mujoco = pytest.importorskip("metalearn.rl.mujoco")
    assert TASKS == ("2dnav", *mujoco.MUJOCO_TASKS)
    tasks = task_distribution("ant-vel", 9)
    assert tasks == mujoco.MujocoTasks("ant-vel", horizon=9)


def test_a_mujoco_task_without_gymnasium_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "gymnasium", None)  # import gymnasium now fails
    monkeypatch.delitem(sys.modules, "metalearn.rl.mujoco", raising=False)
    with pytest.raises(ImportError, match=r'pip install "metalearn\[rl\]"'):
        task_distribution("halfcheetah-vel", 10)


def test_mujoco_episodes_reuse_the_envs_and_equal_fresh_ones(tmp_path, monkeypatch):
    pytest.importorskip("gymnasium")
    monkeypatch.chdir(tmp_path)  # MuJoCo writes its warnings to MUJOCO_LOG.TXT in the cwd
    tasks = task_distribution("halfcheetah-vel", 5)
    torch.manual_seed(0)
    policy = GaussianMLPPolicy(*tasks.dims(), hidden=(8,))
    theta = {k: v.detach() for k, v in policy.named_parameters()}
    sampler = TaskSampler(tasks, policy, 3, "cpu")
    goals = sampler.goals(0, 0, 2)
    sampler(theta, goals, (0, 0, 0), 2, per_task=False)
    envs = sampler.env
    second = sampler(theta, goals, (0, 0, 1), 2, per_task=False)
    assert sampler.env is envs  # the [2, 2] environments built once
    seeds = [derive_seeds(3, 0, 0, k, 1, count=2) for k in range(2)]
    noise = episode_noise(policy, seeds, 5, torch.float32)
    fresh = rollout(tasks.make_env(goals, seeds), policy, theta, noise)
    for field in ("obs", "actions", "rewards", "mask"):
        assert torch.equal(getattr(second, field), getattr(fresh, field))
