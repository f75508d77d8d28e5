"""A step budget keeps the episodes maml_rl's vectorized sampler runs: its loop
(``vectorized_sampler.py``, ``while n_samples < batch_size`` over environments stepped in
lockstep, ``vec_env_executor.py`` restarting each at its episode's end) written out here as
the reference, and `TaskSampler.budget`'s episodes are the ones their seeds give alone."""

from __future__ import annotations

import pytest
import torch

from metalearn.rl import Episodes, GaussianMLPPolicy, Navigation2D, TaskSampler, mean_returns
from metalearn.rl.budget import budget_cut, keep_episodes


def lockstep(lengths: list[list[list[int]]], steps: int) -> set[tuple[int, int, int]]:
    """maml_rl's loop: ``lengths[k][s]`` the episode lengths of task k's stream s in order;
    returns the completed (task, stream, index) when ``n_samples`` reaches K x steps."""
    envs = [(k, s) for k in range(len(lengths)) for s in range(len(lengths[k]))]
    t, index = dict.fromkeys(envs, 0), dict.fromkeys(envs, 0)
    n_samples, kept = 0, set()
    while n_samples < len(lengths) * steps:
        for env in envs:  # one lockstep step of every environment
            t[env] += 1
            k, s = env
            if t[env] == lengths[k][s][index[env]]:  # done: the path is completed, reset
                kept.add((k, s, index[env]))
                n_samples += t[env]
                t[env], index[env] = 0, index[env] + 1
    return kept


@pytest.mark.parametrize("streams, steps", [(1, 30), (1, 47), (3, 40), (4, 9)])
def test_budget_cut_keeps_what_the_lockstep_loop_completes(streams, steps):
    g = torch.Generator().manual_seed(streams * 100 + steps)
    k, rounds, horizon = 5, 40, 10
    lengths = torch.randint(1, horizon + 1, (k, rounds * streams), generator=g)
    lengths[:, ::3] = horizon  # full-length episodes among the short ones
    seqs = [[lengths[i, s::streams].tolist() for s in range(streams)] for i in range(k)]
    expect = lockstep(seqs, steps)
    kept = budget_cut(lengths, streams, steps)
    got = {(i, b % streams, b // streams) for i, b in kept.nonzero().tolist()}
    assert got == expect
    assert int((lengths * kept).sum()) >= k * steps
    # too few episodes sampled to reach the stop: more are asked for, none guessed
    assert budget_cut(lengths[:, : streams * 2], streams, steps * 4) is None


def test_full_length_episodes_fill_the_budget_exactly():
    lengths = torch.full((3, 4), 10)
    kept = budget_cut(lengths, 1, 20)
    assert kept[:, :2].all() and not kept[:, 2:].any()


def test_keep_episodes_pads_the_tasks_that_kept_fewer():
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(2, 3, 4)
    episodes = (torch.randn(2, 3, 4, 2, generator=g), torch.randn(2, 3, 4, 2, generator=g),
                torch.randn(2, 3, 4, generator=g), mask)  # fmt: skip
    kept = torch.tensor([[True, False, True], [False, True, False]])
    out = keep_episodes(Episodes(*episodes), kept)
    assert out.mask.shape == (2, 2, 4)
    torch.testing.assert_close(out.obs[0], episodes[0][0, [0, 2]])
    torch.testing.assert_close(out.rewards[1, 0], episodes[2][1, 1])
    assert out.mask[1, 1].sum() == 0 and out.rewards[1, 1].abs().sum() == 0
    expect = torch.stack([episodes[2][0, [0, 2]].sum(-1).mean(), episodes[2][1, 1].sum()])
    torch.testing.assert_close(mean_returns(out), expect)


@pytest.mark.parametrize("streams", [1, 2])
def test_task_sampler_budget_runs_the_seeds_episodes(streams):
    """Episodes ending early (a wide goal radius): the budget samples more rounds, and each
    kept episode is the one its seed path gives when sampled alone."""
    task = Navigation2D(horizon=12, goal_radius=0.3)
    torch.manual_seed(0)
    policy = GaussianMLPPolicy(2, 2, hidden=(8,))
    params = {k: v.detach() for k, v in policy.named_parameters()}
    sample = TaskSampler(task, policy, seed=5, device="cpu")
    goals = sample.goals(0, 0, 4) * 0.4  # near the start: many episodes end early
    steps = 48
    got = sample.budget(params, goals, (0, 0, 0), steps, per_task=False, streams=streams)
    alone = sample(params, goals, (0, 0, 0), 200, per_task=False)  # every seed, unbudgeted
    kept = budget_cut(alone.mask.sum(-1), streams, steps)
    assert kept is not None and (alone.mask.sum(-1)[kept] < 12).any()  # some ended early
    expect = keep_episodes(alone, kept)
    for a, b in zip(got, expect):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert float(got.mask.sum()) >= 4 * steps
