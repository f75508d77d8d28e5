"""The MAML paper's Figure 4 pieces: the pretrained baseline's outer step is TRPO's plain
surrogate (against the formula written out), evaluation's later steps take the reduced
rate, and scripts/rl_adaptation.py reports a checkpoint's curve as its run evaluated it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from metalearn.checkpoint import load_checkpoint
from metalearn.rl import GaussianMLPPolicy, MetaObjective, Navigation2D, mean_returns, policy_batch
from metalearn.rl.sampler import episode_noise, rollout
from metalearn.rl.seeds import derive_seeds
from metalearn.runs.cli import unflatten
from tests.conftest import experiment, script

rl_maml = experiment("rl_maml")
TINY = dict(iterations=2, meta_batch=4, fast_batch=5, horizon=20, hidden=(32, 32),
            eval_tasks=8, eval_inner_steps=2, track=False, device="cpu")  # fmt: skip


def tiny(tmp_path: Path, **overrides) -> rl_maml.Args:
    return unflatten(rl_maml.Args, {**TINY, "out_dir": str(tmp_path), **overrides})


def test_without_inner_steps_the_surrogate_is_trpos_own():
    """MetaObjective with no inner batch: the importance-weighted advantage averaged over
    valid steps, and its KL over all the tasks' steps, as written out here in float64."""
    torch.manual_seed(0)
    policy = GaussianMLPPolicy(2, 2, hidden=(6,)).double()
    theta = {k: v.detach() for k, v in policy.named_parameters()}
    task = Navigation2D(horizon=8)
    goals = task.sample_goals(derive_seeds(3, count=2), torch.float64)
    seeds = [derive_seeds(3, k, count=4) for k in range(2)]
    noise = episode_noise(policy, seeds, 8, torch.float64)
    episodes = rollout(task.make_env(goals, 4), policy, theta, noise)
    batch = policy_batch(episodes, discount=0.99, gae_lambda=1.0, normalize=True)
    objective = MetaObjective(lr=0.5, average="steps")
    tasks = objective.prepare(policy, theta, (), batch)
    moved = {k: v + 0.05 * torch.randn_like(v) for k, v in theta.items()}
    surrogate, kl = objective(policy, moved, tasks)
    old, new = policy(batch.obs), torch.func.functional_call(policy, moved, (batch.obs,))
    ratio = torch.exp(policy.log_prob(new, batch.actions) - policy.log_prob(old, batch.actions))
    m = batch.mask
    per_task = (ratio * batch.advantages * m).sum((1, 2)) / m.sum((1, 2))
    all_steps_kl = (policy.kl(old, new) * m).sum() / m.sum()  # maml_rl's: over all steps
    torch.testing.assert_close(surrogate, per_task.mean().detach())
    torch.testing.assert_close(kl, all_steps_kl.detach())


def test_pretrain_iterations_are_adam_steps_on_the_pre_update_surrogate(tmp_path):
    """maml_rl's use_maml=False: Adam at 1e-3, one full-batch epoch an iteration, on the mean
    over tasks of ``- reduce_mean(logli * adv)`` over each task's steps with theta
    (``maml_npo.py``), Adam's rule written out here on the run's own episodes, 2 iterations
    (the second step reads the first's moments)."""
    args = tiny(tmp_path, run_name="p", pretrain=True)
    results = rl_maml.main(args)
    saved = load_checkpoint(tmp_path / "p" / "checkpoint.pt")
    for row in saved["history"]:  # one sampling phase: the return before is the return after
        assert row["train/return_pre"] == row["train/return_post"]
        assert row["train/step_size"] > 0 and row["train/kl"] > 0
    assert torch.isfinite(torch.tensor(results["test/return_step2"]))

    t = rl_maml.resolve(args).training
    assert t.pretrain_lr == 1e-3 and t.max_kl is None  # no trust region is read
    policy, _, sample = rl_maml.build(rl_maml.resolve(args))
    theta = {k: v.detach().double() for k, v in policy.named_parameters()}
    m = {k: torch.zeros_like(v) for k, v in theta.items()}
    v2 = {k: torch.zeros_like(v) for k, v in theta.items()}
    b1, b2 = 0.9, 0.999
    for step in (1, 2):
        live = {k: v.float().requires_grad_(True) for k, v in theta.items()}
        goals = sample.goals(rl_maml.TRAIN_STREAM, step - 1, t.meta_batch)
        path = (rl_maml.TRAIN_STREAM, step - 1, 0)
        batch = policy_batch(sample(live, goals, path, t.fast_batch, False))
        stats = torch.func.functional_call(policy, live, (batch.obs,))
        logli = policy.log_prob(stats, batch.actions)
        per_task = (logli * batch.advantages * batch.mask).sum((1, 2)) / batch.mask.sum((1, 2))
        grads = torch.autograd.grad(-per_task.mean(), list(live.values()))
        for (name, p), g in zip(theta.items(), grads):
            g = g.double()
            m[name] = b1 * m[name] + (1 - b1) * g
            v2[name] = b2 * v2[name] + (1 - b2) * g**2
            m_hat, v_hat = m[name] / (1 - b1**step), v2[name] / (1 - b2**step)
            theta[name] = p - 1e-3 * m_hat / (v_hat.sqrt() + 1e-8)
    for name, expect in theta.items():
        torch.testing.assert_close(saved["policy"][name].double(), expect, rtol=1e-4, atol=1e-6)


def test_evaluations_later_steps_take_the_reduced_rate():
    """Step 2 with factor f lands where an inner step at f x the rate does."""
    args = rl_maml.resolve(unflatten(rl_maml.Args, {**TINY, "eval_later_lr_factor": 0.25}))
    t = args.training
    policy, objective, sample = rl_maml.build(args)
    theta = {k: v.detach() for k, v in policy.named_parameters()}
    goals = sample.goals(rl_maml.TEST_STREAM, 0, 3)
    _, returns, _ = rl_maml.adapted_episodes(
        t, sample, objective, theta, goals, 1, 0, 2, later_lr_factor=0.25
    )
    phis, per_task = theta, False
    for phase, lr in enumerate((t.inner_lr, 0.25 * t.inner_lr)):
        episodes = sample(phis, goals, (1, 0, phase), t.fast_batch, per_task)
        batch = rl_maml.processed(t, episodes, 0, "test")
        step = MetaObjective(lr=lr, average="steps")
        phis, per_task = step.adapt_tasks(policy, phis, batch, per_task=per_task), True
    last = sample(phis, goals, (1, 0, 2), t.fast_batch, True)
    assert torch.equal(returns[2], mean_returns(last))
    _, constant, _ = rl_maml.adapted_episodes(t, sample, objective, theta, goals, 1, 0, 2)
    assert torch.equal(constant[1], returns[1]) and not torch.equal(constant[2], returns[2])


def test_the_script_reports_the_runs_own_evaluation(tmp_path, capsys):
    results = rl_maml.main(tiny(tmp_path, run_name="m"))
    tool = script("rl_adaptation")
    path = tmp_path / "m" / "checkpoint.pt"
    curves = tool.main(["--checkpoints", f"maml={path}", "--random", "--eval-inner-steps", "2",
                        "--plot", str(tmp_path / "f.png")])  # fmt: skip
    assert [m for m, _ in curves["maml"]] == [results[f"test/return_step{k}"] for k in range(3)]
    assert curves["random"][0][0] != curves["maml"][0][0]
    assert (tmp_path / "f.png").stat().st_size > 1000
    with pytest.raises(SystemExit) as stop:
        tool.main(["--checkpoints", f"maml={tmp_path / 'none.pt'}"])
    assert stop.value.code == 2 and "no checkpoint at" in capsys.readouterr().err


def test_the_script_evaluates_a_step_budget_and_refuses_two_counts(tmp_path, capsys):
    run = tiny(tmp_path, run_name="s", iterations=1, fast_batch=None, fast_batch_steps=40)
    results = rl_maml.main(run)
    tool = script("rl_adaptation")
    path = tmp_path / "s" / "checkpoint.pt"
    curves = tool.main(["--checkpoints", f"maml={path}", "--eval-inner-steps", "2"])
    assert [m for m, _ in curves["maml"]] == [results[f"test/return_step{k}"] for k in range(3)]
    other = tool.main(["--checkpoints", f"maml={path}", "--eval-inner-steps", "2",
                       "--fast-batch", "2"])  # fmt: skip
    assert other["maml"] != curves["maml"]
    with pytest.raises(SystemExit) as stop:
        tool.main(["--checkpoints", f"maml={path}", "--paper", "--fast-batch", "2"])
    assert stop.value.code == 2 and "--paper sets maml_rl's 4,000 steps" in capsys.readouterr().err


def test_the_script_reads_a_pretrained_run_recorded_with_trpos_settings(tmp_path):
    """Runs pretrained by TRPO, before --pretrain took maml_rl's Adam step, recorded the
    outer step's settings, which --pretrain now refuses; evaluation reads none of them."""
    from metalearn.checkpoint import save_checkpoint

    rl_maml.main(tiny(tmp_path, run_name="p", pretrain=True, iterations=1))
    saved = load_checkpoint(tmp_path / "p" / "checkpoint.pt")
    saved["args"].update(max_kl=0.01, cg_iters=10, cg_damping=1e-5, pretrain_lr=None)
    save_checkpoint(tmp_path / "old.pt", saved)
    tool = script("rl_adaptation")
    new = tool.main(["--checkpoints", f"p={tmp_path / 'p' / 'checkpoint.pt'}"])
    old = tool.main(["--checkpoints", f"p={tmp_path / 'old.pt'}"])
    assert old == new
