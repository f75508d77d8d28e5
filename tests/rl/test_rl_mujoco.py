"""metalearn.rl.mujoco: the tasks' rewards against gymnasium's environments stepped by hand,
the velocity taken from the simulator's positions (not from ``info``), and the one-line
error without the optional extra."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from metalearn.rl import GaussianMLPPolicy, derive_seeds, episode_noise, rollout

HORIZON = 6


def rollout_task(name: str):
    from metalearn.rl.mujoco import MujocoTasks

    tasks = MujocoTasks(name, horizon=HORIZON)
    obs_dim, action_dim = tasks.dims()
    torch.manual_seed(0)
    policy = GaussianMLPPolicy(obs_dim, action_dim, hidden=(8,))
    params = {k: v.detach() for k, v in policy.named_parameters()}
    goals = tasks.sample_goals(derive_seeds(3, 0, count=2))
    seeds = [derive_seeds(3, k, 0, count=2) for k in range(2)]
    noise = episode_noise(policy, seeds, HORIZON, torch.float32)
    return tasks, goals, seeds, rollout(tasks.make_env(goals, seeds), policy, params, noise)


@pytest.mark.parametrize("name", ["halfcheetah-vel", "halfcheetah-dir", "ant-vel", "ant-dir"])
def test_rewards_match_the_papers_tasks(name, tmp_path, monkeypatch):
    gymnasium = pytest.importorskip("gymnasium")
    monkeypatch.chdir(tmp_path)  # MuJoCo writes its warnings to MUJOCO_LOG.TXT in the cwd
    tasks, goals, seeds, ep = rollout_task(name)
    for k in range(2):
        for b in range(2):
            env = gymnasium.make(tasks.env_id)
            obs, _ = env.reset(seed=seeds[k][b] % 2**32)
            data = env.unwrapped.data
            for t in range(HORIZON):
                np.testing.assert_allclose(ep.obs[k, b, t].numpy(), obs, rtol=1e-5, atol=1e-5)
                a = ep.actions[k, b, t].double().clamp(-1, 1).numpy()
                x0 = data.qpos[0] if name.startswith("halfcheetah") else data.body("torso").xpos[0]
                obs, _, terminated, _, _ = env.step(a)
                x1 = data.qpos[0] if name.startswith("halfcheetah") else data.body("torso").xpos[0]
                v, g = (x1 - x0) / env.unwrapped.dt, goals[k].item()
                forward = -abs(v - g) if name.endswith("vel") else g * v
                if name.startswith("halfcheetah"):
                    expect = forward - 0.05 * (a**2).sum()
                else:
                    contact = (np.clip(data.cfrc_ext, -1, 1) ** 2).sum()
                    bonus = 1.0 if name.endswith("vel") else 0.0
                    expect = forward + bonus - 0.005 * (a**2).sum() - 0.0005 * contact + 0.05
                assert ep.rewards[k, b, t].item() == pytest.approx(expect, rel=1e-4, abs=1e-4)
                if terminated:
                    assert (ep.mask[k, b, t + 1 :] == 0).all()
                    break
            env.close()


def test_without_gymnasium_one_line_names_the_extra():
    code = (
        "import sys; sys.modules['gymnasium'] = None\n"
        "try:\n    import metalearn.rl.mujoco\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == (
        'metalearn.rl.mujoco needs gymnasium with MuJoCo: pip install "metalearn[rl]"'
    )
