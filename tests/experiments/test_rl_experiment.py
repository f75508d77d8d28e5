"""experiments/rl_maml.py end to end: it trains, adaptation helps, a resume is the
uninterrupted run bit for bit, and bad input is one line with exit code 2."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from metalearn.checkpoint import load_checkpoint
from metalearn.runs.cli import unflatten
from tests.conftest import ROOT, experiment

rl_maml = experiment("rl_maml")

TINY = dict(  # 2D navigation, small enough for a test, large enough that adaptation helps
    iterations=2,
    meta_batch=4,
    fast_batch=5,
    horizon=20,
    hidden=(32, 32),
    eval_tasks=8,
    eval_inner_steps=1,
    track=False,
    device="cpu",
)


def tiny(tmp_path: Path, **overrides) -> rl_maml.Args:
    return unflatten(rl_maml.Args, {**TINY, "out_dir": str(tmp_path), **overrides})


def cli(argv: list[str], capsys) -> tuple[int, str]:
    """The program run in this process: its exit code and its stderr."""
    with pytest.raises(SystemExit) as stop:
        rl_maml.run_cli(rl_maml.main, lambda: rl_maml.parse_args(argv))
    return stop.value.code, capsys.readouterr().err


def test_args_default_is_the_cpu_preset():
    assert rl_maml.Args() == rl_maml.parse_args([])
    paper = rl_maml.parse_args(["--preset", "paper-2dnav"]).training
    assert (paper.meta_batch, paper.fast_batch, paper.fast_batch_steps) == (20, None, 2000)
    cheetah = rl_maml.parse_args(["--preset", "paper-halfcheetah-vel"]).training
    assert (cheetah.meta_batch, cheetah.fast_batch_steps) == (40, 4000)


def test_a_tiny_run_trains_and_adaptation_raises_the_return(tmp_path, capsys):
    results = rl_maml.main(tiny(tmp_path, run_name="a"))
    # seed 0 fixes every goal and episode: these are exact, repeatable numbers
    assert results["test/return_post"] > results["test/return_pre"] + 1.0
    saved = load_checkpoint(tmp_path / "a" / "checkpoint.pt")
    assert saved["iteration"] == 2 and saved["results"] == results
    assert [row["step"] for row in saved["history"]] == [1, 2]
    row = saved["history"][-1]
    assert 0 < row["train/kl"] <= 0.01 and row["train/step_size"] > 0
    assert row["perf/env_steps_per_s"] > 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("test/return_post: ")


def test_a_step_budget_run_samples_maml_rls_steps(tmp_path):
    """--fast-batch-steps: every phase's kept episodes hold the meta-batch's budget, and a
    task's kept steps are within a horizon of its share (one stream a task, in lockstep)."""
    args = tiny(tmp_path, run_name="s", iterations=1, fast_batch=None, fast_batch_steps=50)
    results = rl_maml.main(args)
    assert results["test/return_post"] > results["test/return_pre"]
    t = rl_maml.resolve(args).training
    policy, objective, sample = rl_maml.build(rl_maml.resolve(args))
    theta = {k: v.detach() for k, v in policy.named_parameters()}
    goals = sample.goals(rl_maml.TRAIN_STREAM, 0, t.meta_batch)
    _, _, last = rl_maml.adapted_episodes(t, sample, objective, theta, goals, 0, 0, 1)
    steps = last.mask.sum((1, 2))
    assert float(steps.sum()) >= t.meta_batch * 50 and (steps > 50 - 20).all()


def test_ppo_outer_step_runs(tmp_path):
    results = rl_maml.main(tiny(tmp_path, run_name="p", outer="ppo", iterations=1))
    assert torch.isfinite(torch.tensor(results["test/return_post"]))


def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    rl_maml.main(tiny(tmp_path, run_name="whole", iterations=3))
    rl_maml.main(tiny(tmp_path, run_name="split", iterations=1))
    rl_maml.main(tiny(tmp_path, run_name="split", iterations=3, resume=True))
    whole = load_checkpoint(tmp_path / "whole" / "checkpoint.pt")
    split = load_checkpoint(tmp_path / "split" / "checkpoint.pt")
    for name, value in whole["policy"].items():
        assert torch.equal(value, split["policy"][name]), name
    assert whole["history"] == [
        {**row, "perf/env_steps_per_s": w["perf/env_steps_per_s"], "perf/step_s": w["perf/step_s"]}
        for row, w in zip(split["history"], whole["history"])
    ]
    assert whole["results"]["test/return_post"] == split["results"]["test/return_post"]


@pytest.mark.slow
def test_a_stopped_run_resumes_to_the_uninterrupted_parameters(tmp_path):
    """SIGTERM mid-run: the last completed iteration is kept, --resume finishes the run and
    its parameters equal an uninterrupted run's."""
    flags = [
        "--iterations",
        "6",
        "--meta-batch",
        "4",
        "--fast-batch",
        "5",
        "--horizon",
        "20",
        "--hidden",
        "32",
        "32",
        "--eval-tasks",
        "8",
        "--eval-inner-steps",
        "1",
        "--no-track",
        "--device",
        "cpu",
        "--out-dir",
        str(tmp_path),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = [sys.executable, str(ROOT / "experiments" / "rl_maml.py")]
    proc = subprocess.Popen(
        [*script, *flags, "--run-name", "stopped"], env=env, stdout=subprocess.PIPE, text=True
    )
    for line in proc.stdout:
        if line.startswith("iteration 2/"):
            proc.send_signal(signal.SIGTERM)
            break
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "continue with --resume --run-name stopped" in rest
    stopped = load_checkpoint(tmp_path / "stopped" / "checkpoint.pt")
    assert 2 <= stopped["iteration"] < 6 and stopped.get("results") is None
    resume = [*script, "--resume", "--run-name", "stopped", "--out-dir", str(tmp_path)]
    subprocess.run(resume, env=env, check=True, capture_output=True, timeout=300)
    subprocess.run(
        [*script, *flags, "--run-name", "whole"],
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    a = load_checkpoint(tmp_path / "stopped" / "checkpoint.pt")["policy"]
    b = load_checkpoint(tmp_path / "whole" / "checkpoint.pt")["policy"]
    assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--horizon", "0"], "--horizon 0"),
        (["--meta-batch", "0"], "--meta-batch 0"),
        (["--meta-batch", "100000", "--fast-batch", "100000"], "lower one of them"),
        (["--env", "ant-vel", "--horizon", "5000"], "at most 1000"),
        (["--max-kl", "nan"], "--max-kl nan"),
        (["--env", "pong"], "pong"),
        (["--resume"], "--run-name"),
        (["--cg-damping", "-1"], "error: --cg-damping -1.0: must be >= 0 and finite"),
        (["--cg-damping", "nan"], "error: --cg-damping nan: must be >= 0 and finite"),
        (["--hidden", "0"], "error: --hidden 0: every hidden layer needs at least 1 unit"),
        (["--hidden", "32", "0"], "error: --hidden 32 0: every hidden layer needs at least 1"),
        (
            ["--ppo-clip", "0.3"],
            "error: --ppo-clip 0.3 is a setting of --outer ppo; drop it for --outer trpo",
        ),
        (["--outer", "trpo", "--ppo-epochs", "5"], "--ppo-epochs 5 is a setting of --outer ppo"),
        (["--pretrain", "--outer", "ppo"], "error: --outer ppo with --pretrain: the pretrained"),
        (["--pretrain", "--max-kl", "0.02"], "error: --max-kl 0.02 is a setting of the outer"),
        (["--pretrain", "--ppo-lr", "0.1"], "error: --ppo-lr 0.1 is a setting of the outer"),
        (["--pretrain-lr", "0.01"], "error: --pretrain-lr 0.01 is a setting of --pretrain"),
        (["--pretrain", "--pretrain-lr", "0"], "error: --pretrain-lr 0.0: must be a positive"),
        (["--fast-batch", "5", "--fast-batch-steps", "500"], "both set"),
        (["--preset", "paper-2dnav", "--fast-batch", "5"], "(the paper presets set the steps)"),
        (["--fast-batch-steps", "99"], "error: --fast-batch-steps 99: below one episode"),
        (["--fast-batch-steps", "0"], "error: --fast-batch-steps 0: must be at least 1"),
        (
            ["--outer", "ppo", "--cg-iters", "5"],
            "error: --cg-iters 5 is a setting of --outer trpo; drop it for --outer ppo",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, argv, needle):
    code, err = cli([*argv, "--out-dir", str(tmp_path), "--no-track"], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and needle in err
    assert not any(tmp_path.iterdir())  # nothing written


def test_a_non_finite_return_names_task_and_iteration(tmp_path, capsys):
    argv = [
        "--out-dir",
        str(tmp_path),
        "--run-name",
        "nan",
        "--inner-lr",
        "1e30",
        "--iterations",
        "1",
        "--meta-batch",
        "3",
        "--fast-batch",
        "3",
        "--horizon",
        "10",
        "--no-track",
    ]
    code, err = cli(argv, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "non-finite" in err and "task 0 of iteration 1" in err


def test_an_existing_run_is_never_overwritten(tmp_path, capsys):
    rl_maml.main(tiny(tmp_path, run_name="done", iterations=1))
    before = (tmp_path / "done" / "checkpoint.pt").read_bytes()
    argv = ["--run-name", "done", "--out-dir", str(tmp_path), "--no-track", "--iterations", "1"]
    code, err = cli(argv, capsys)
    assert code == 2 and "--resume" in err and len(err.strip().splitlines()) == 1
    assert (tmp_path / "done" / "checkpoint.pt").read_bytes() == before


def test_mujoco_missing_names_the_extra(tmp_path):
    """gymnasium made unimportable: one line naming the extra, exit 2."""
    code = (
        "import sys; sys.modules['gymnasium'] = None; sys.argv = ['rl_maml', '--env', "
        f"'halfcheetah-vel', '--out-dir', {str(tmp_path)!r}, '--no-track']; "
        "import runpy; runpy.run_path('experiments/rl_maml.py', run_name='__main__')"
    )
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        'error: --env halfcheetah-vel needs gymnasium with MuJoCo: pip install "metalearn[rl]"'
    ]
    assert time.perf_counter() - start < 60
    assert not any(tmp_path.iterdir())


def test_resuming_a_supervised_run_names_the_experiment_that_owns_it(tmp_path, capsys):
    from tests.helpers.image_set_fixtures import write_folder
    from tests.helpers.run_helpers import checkpoint_of, fs, make

    folder = write_folder(tmp_path / "folder")
    args = make(fs, dataset="folder", data_root=str(folder), out_dir=str(tmp_path), track=False,
                device="cpu", hidden=4, image_size=16)  # fmt: skip
    path = checkpoint_of(tmp_path, fs, args)  # <tmp>/run/checkpoint.pt, the experiment's format
    before = path.read_bytes()
    code, err = cli(["--resume", "--run-name", "run", "--out-dir", str(tmp_path)], capsys)
    assert code == 2
    assert err.strip().splitlines() == [
        f"error: {path} is a run of experiments/fewshot_maml.py, not of experiments/rl_maml.py; "
        "resume it with that script"
    ]
    assert path.read_bytes() == before


def test_a_run_recorded_with_both_outer_steps_settings_resumes(tmp_path):
    """Runs recorded the clipped step's settings beside TRPO's (at their defaults) before each
    outer step refused the other's: such a run resumes as it ran."""
    rl_maml.main(tiny(tmp_path, run_name="old", iterations=1))
    path = tmp_path / "old" / "checkpoint.pt"
    saved = load_checkpoint(path)
    saved["args"].update(ppo_clip=0.2, ppo_epochs=5, ppo_lr=1e-3)  # what those runs recorded
    torch.save(saved, path)
    args = rl_maml.parse_args(["--resume", "--run-name", "old", "--out-dir", str(tmp_path),
                               "--iterations", "2"])  # fmt: skip
    rl_maml.main(args)
    resumed = load_checkpoint(path)
    assert resumed["iteration"] == 2 and resumed["args"]["outer"] == "trpo"
    assert resumed["args"]["max_kl"] == 0.01 and resumed["results"] is not None
