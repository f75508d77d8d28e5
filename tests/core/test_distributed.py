"""metalearn.distributed on 2 real gloo processes (torchrun), against one process.

Two launches: ``tests/core/dist_worker.py`` (the library on float64 problems, checked here against
a single-process reference over the union of the same tasks) and the Omniglot experiment
(a rank killed mid-run ends the job with an error rather than a hang, and the job resumes
from rank 0's last checkpoint).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from metalearn import distributed as dist
from metalearn.checkpoint import load_checkpoint
from metalearn.data import load_omniglot, omniglot_samplers
from metalearn.runs.evaluation import TEST_SEED, evaluate_tasks
from tests.conftest import OMNIGLOT, ROOT, needs_omniglot
from tests.core import dist_worker as worker

DATA = OMNIGLOT
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
LAUNCH_TIMEOUT_S = 240  # far above a normal launch (~20 s): reaching it means a hang


def torchrun(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run([*TORCHRUN, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=LAUNCH_TIMEOUT_S, **kwargs)  # fmt: skip


# --------------------------------------------------------------------------- pure helpers


def test_shard_slices_partition_in_order():
    for n in range(0, 12):
        for world in range(1, 5):
            parts = [list(range(n))[dist.shard_slice(n, r, world)] for r in range(world)]
            assert sum(parts, []) == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert dist.shard(list("abcde"), 0, 2) == list("abc")
    assert dist.shard(torch.arange(5), 1, 2).tolist() == [3, 4]
    with pytest.raises(ValueError, match="rank 2 of 2"):
        dist.shard_slice(4, 2, 2)


def test_without_a_process_group_everything_is_the_identity(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    info = dist.init_from_env(device="cpu")
    assert (info.rank, info.world_size, info.distributed, info.is_main) == (0, 1, False, True)
    learner = worker.make_learners(seed=1)["maml-loop"]
    metrics = learner.backward(worker.make_tasks(torch.Generator().manual_seed(0), 2))
    before = [p.grad.clone() for p in learner.parameters()]
    assert dist.average_meta_step(learner, metrics, 2) is metrics
    assert all(torch.equal(a, p.grad) for a, p in zip(before, learner.parameters()))
    assert dist.gather_tensor(before[0]) is before[0] and dist.from_main(lambda: 7) == 7
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        dist.init_from_env(timeout_s=0)


# --------------------------------------------------------------------------- 2 processes


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("dist-worker")
    done = torchrun(["tests/core/dist_worker.py", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)] + [
        torch.load(out / "stall.pt", weights_only=False)
    ]


def reference(name: str) -> dict:
    """One process, the whole meta-batch: the step-0 meta-gradient and the final weights."""
    learner = worker.make_learners(seed=1)[name]
    opt = torch.optim.Adam(learner.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(0)
    ref = {"init": {k: v.detach().clone() for k, v in learner.state_dict().items()}}
    for step in range(worker.STEPS):
        opt.zero_grad()
        metrics = learner.backward(worker.make_tasks(gen, worker.META_BATCH))
        if step == 0:
            ref["grad"], ref["loss"] = worker.grads(learner), metrics.loss
        opt.step()
    ref["final"] = dict(learner.state_dict())
    return ref


@pytest.mark.parametrize("name", ["maml-vmap", "maml-loop", "reptile"])
def test_averaged_meta_gradient_equals_the_single_process_one(ranks, name):
    ref = reference(name)
    assert [r[f"{name}/local_tasks"] for r in ranks[:2]] == [3, 2]  # unequal shares
    for r in ranks[:2]:
        for k, v in ref["init"].items():  # rank 1 started from other weights: broadcast
            assert torch.equal(r[f"{name}/init"][k], v), k
        for k, g in ref["grad"].items():
            assert r[f"{name}/grad"][k].dtype == torch.float64
            torch.testing.assert_close(r[f"{name}/grad"][k], g, atol=1e-12, rtol=0)
        assert r[f"{name}/loss"] == pytest.approx(ref["loss"], abs=1e-12)


@pytest.mark.parametrize("name", ["maml-vmap", "maml-loop", "reptile"])
def test_parameters_stay_identical_across_ranks(ranks, name):
    ref = reference(name)
    for k, v in ref["final"].items():
        assert torch.equal(ranks[0][f"{name}/final"][k], ranks[1][f"{name}/final"][k]), k
        torch.testing.assert_close(ranks[0][f"{name}/final"][k], v, atol=1e-10, rtol=0)


def test_gather_broadcast_and_divergence_check(ranks):
    for r in ranks[:2]:
        assert r["gathered"].flatten().tolist() == [100.0, 101.0, 102.0]  # rank 0 held none
        assert r["from_main"] == "made on rank 0"
        assert "raised on rank 0 only" in r["from_main_error"]  # re-raised on every rank
        assert "differ between rank 0 and ranks [1]" in r["check_same_error"]


def test_a_stalled_rank_times_out_with_a_clear_error(ranks):
    stall = ranks[2]
    assert "Timed out" in stall["error"], stall["error"]  # gloo's own words, wrapped
    assert "stalled for over the 6 s timeout" in stall["error"], stall["error"]
    assert worker.TIMEOUT_S <= stall["seconds"] < worker.TIMEOUT_S + 30


# --------------------------------------------------------------------------- the experiment


def experiment_args(out: Path, iterations: int) -> list[str]:
    """A tiny 2-rank Omniglot run: conv4 with 8 filters, 2 tasks per step (one per rank)."""
    return [
        "experiments/omniglot_maml.py", "--algorithm", "maml", "--data-root", str(DATA),
        "--out-dir", str(out), "--run-name", "crash", "--iterations", str(iterations),
        "--meta-batch", "2",
        "--query", "1", "--eval-query", "2", "--hidden", "8", "--val-every", "100000",
        "--val-tasks", "2", "--test-tasks", "5", "--eval-inner-steps", "1",
        "--checkpoint-every", "2", "--no-track", "--device", "cpu", "--dist-timeout", "60",
    ]  # fmt: skip


def workers_of(launcher: int) -> dict[int, int]:
    """{RANK: pid} of the processes torchrun started, read from /proc (Linux)."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            if entry.name.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == launcher:
                env = dict(
                    v.split("=", 1) for v in (entry / "environ").read_text().split("\0") if "=" in v
                )
                if "RANK" in env:
                    found[int(env["RANK"])] = int(entry.name)
        except (OSError, ValueError, IndexError):
            continue  # the process ended meanwhile, or is not ours
    return found


def wait_for_checkpoint(path: Path, iteration: int, job: subprocess.Popen) -> None:
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while time.monotonic() < deadline and job.poll() is None:
        try:
            if load_checkpoint(path)["iteration"] >= iteration:
                return
        except (FileNotFoundError, EOFError, RuntimeError):
            pass  # not written yet (writes are atomic, so never half a file)
        time.sleep(0.1)
    job.kill()
    raise AssertionError(f"no checkpoint at step {iteration}: {job.communicate()[1][-3000:]}")


@needs_omniglot
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc (Linux)")
def test_a_killed_rank_ends_the_job_and_it_resumes_from_the_checkpoint(tmp_path):
    ckpt = tmp_path / "crash" / "checkpoint.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    job = subprocess.Popen([*TORCHRUN, *experiment_args(tmp_path, 100_000)], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    wait_for_checkpoint(ckpt, 4, job)
    os.kill(workers_of(job.pid)[1], signal.SIGKILL)  # rank 1 dies mid-run, no goodbye
    try:
        out, err = job.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        job.kill()
        raise AssertionError("the job hung after a rank was killed") from None
    assert job.returncode != 0
    assert "ChildFailedError" in err and "rank      : 1" in err, err[-3000:]
    assert "Signal 9 (SIGKILL)" in err, err[-3000:]
    saved = load_checkpoint(ckpt)  # rank 0 kept the last completed step
    start = saved["iteration"]
    assert start >= 4
    if "stopped at step" in out:  # rank 0 may be stopped by torchrun before it can say so
        assert f"rank 0: stopped at step {start}; continue with --resume" in out, out

    done = torchrun([*experiment_args(tmp_path, start + 2), "--resume"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "test/acc:" in done.stdout
    resumed = load_checkpoint(ckpt)
    assert resumed["iteration"] == start + 2
    adam_steps = {int(s["step"]) for s in resumed["optimizer"]["state"].values()}
    assert adam_steps == {start + 2}  # the optimizer state was resumed, not restarted
    weights = resumed["learner"]["model.head.weight"]
    assert not torch.equal(weights, saved["learner"]["model.head.weight"])
    # The 5 test tasks were split 3 + 2 and gathered: one process must get the same accuracy.
    printed = float(re.search(r"^test/acc: ([0-9.]+) ±", done.stdout, re.M).group(1))
    assert printed == pytest.approx(single_process_test_accuracy(resumed), abs=1e-4)


def single_process_test_accuracy(checkpoint: dict) -> float:
    """The experiment's test accuracy of the checkpoint's best weights, in this process."""
    from metalearn.runs.recipe import build_learner, read_recipe

    recipe = read_recipe(checkpoint)
    data = recipe.data
    samplers = omniglot_samplers(load_omniglot(DATA), data.split, ways=data.ways,
                                 shots=data.shots, queries=data.eval_query)  # fmt: skip
    learner = build_learner(recipe)
    learner.load_state_dict(checkpoint["best_learner"])
    gen = torch.Generator().manual_seed(TEST_SEED)
    t = recipe.training
    acc, _ = evaluate_tasks(learner, samplers["test"], t.test_tasks, t.eval_inner_steps, gen)
    return acc
