"""``--ensemble-top-k`` through experiments/omniglot_maml.py on the real Omniglot data: the
run keeps its K best validations, tests their ensemble as MAML++'s reference does, survives a
stop and resume with the same K, and refuses what cannot work in one line."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from metalearn.checkpoint import load_checkpoint
from metalearn.runs.evaluation import TEST_SEED, evaluate_tasks
from metalearn.runs.lifecycle import UserError
from metalearn.runs.recipe import build_learner, read_recipe
from metalearn.runs.run import Run, load_samplers
from metalearn.tools import evaluate as evaluate_tool
from tests.conftest import OMNIGLOT, ROOT, needs_omniglot
from tests.helpers.ensemble_reference import ensemble_task_accuracies, run_test_tasks
from tests.helpers.run_helpers import make, om

pytestmark = needs_omniglot
TINY = dict(
    algorithm="mamlpp", inner_steps=2, iterations=5, meta_batch=2, query=1, eval_query=2,
    hidden=8, val_every=1, val_tasks=4, test_tasks=5, eval_inner_steps=2, checkpoint_every=1,
    data_root=str(OMNIGLOT), track=False, device="cpu", run_name="r",
)  # fmt: skip


def tiny_args(out: Path, **overrides) -> om.Args:
    return make(om, **{**TINY, "out_dir": str(out), **overrides})


def ranked(saved: dict, k: int) -> list[tuple[int, float]]:
    """The k best validations of the history, the earlier first among equal ones."""
    vals = [(row["step"], row["val/acc"]) for row in saved["history"] if "val/acc" in row]
    return sorted(vals, key=lambda v: (-v[1], v[0]))[:k]


def reference_test(saved: dict) -> tuple[float, float]:
    """The run's test written out: its test tasks (the test seed), each kept model's query
    logits, combined as experiment_builder.py's evaluated_test_set_using_the_best_models
    (np.mean over models, np.argmax over classes); the interval 1.96 std / sqrt(T)."""
    recipe = read_recipe(saved)
    t = recipe.training
    tasks = run_test_tasks(recipe)
    learner = build_learner(recipe)
    per_model = []
    for entry in saved["top"]:
        learner.load_state_dict(entry["learner"])
        per_model.append([learner.query_logits(task, t.eval_inner_steps).numpy()
                          for task in tasks])  # fmt: skip
    per_task = ensemble_task_accuracies(per_model, tasks)
    return per_task.mean(), 1.96 * per_task.std(ddof=1) / math.sqrt(len(per_task))


@pytest.mark.slow
def test_a_run_keeps_its_k_best_validations_and_tests_their_ensemble(tmp_path, capsys):
    results = om.main(tiny_args(tmp_path, ensemble_top_k=3))
    saved = load_checkpoint(tmp_path / "r" / "checkpoint.pt")
    assert saved["recipe"]["training"]["ensemble_top_k"] == 3
    top = saved["top"]
    assert [(e["iteration"], e["val"]) for e in top] == ranked(saved, 3)
    assert top[0]["iteration"] == saved["best_iteration"]
    for name, value in saved["best_learner"].items():
        assert torch.equal(top[0]["learner"][name], value)
    assert len({e["iteration"] for e in top}) == 3
    first, second = top[0]["learner"], top[1]["learner"]
    assert not all(torch.equal(first[k], second[k]) for k in saved["learner"])

    acc, half = reference_test(saved)
    # the run's per-task accuracies pass through float32 (gathered across ranks)
    assert results["test/acc"] == pytest.approx(acc, abs=1e-7)
    assert results["test/acc_ci95"] == pytest.approx(half, rel=1e-6)

    # metalearn-evaluate on the finished run tests the same ensemble on the same tasks
    capsys.readouterr()
    code = evaluate_tool.main(["--checkpoint", str(tmp_path / "r" / "checkpoint.pt"),
                               "--which", "ensemble", "--tasks", "5", "--no-track"])  # fmt: skip
    assert code == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last == f"test/acc: {results['test/acc']:.4f} ± {results['test/acc_ci95']:.4f}"


@pytest.mark.slow
def test_k_1_is_the_best_weights_test_and_k_does_not_change_training(tmp_path):
    one = om.main(tiny_args(tmp_path / "a"))
    three = om.main(tiny_args(tmp_path / "b", ensemble_top_k=3))
    a = load_checkpoint(tmp_path / "a" / "r" / "checkpoint.pt")
    b = load_checkpoint(tmp_path / "b" / "r" / "checkpoint.pt")
    assert a["top"] == [] and a["recipe"]["training"]["ensemble_top_k"] == 1
    strip = [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in a["history"]]
    assert strip == [{k: v for k, v in r.items() if not k.startswith("perf/")}
                     for r in b["history"]]  # fmt: skip
    assert a["best_iteration"] == b["best_iteration"]
    # K=1's test is the best weights through `evaluate`, as before the ensemble existed
    recipe = read_recipe(a)
    learner = build_learner(recipe)
    learner.load_state_dict(a["best_learner"])
    sampler = load_samplers(recipe, "cpu")["test"]
    t = recipe.training
    gen = torch.Generator().manual_seed(TEST_SEED)
    acc, half = evaluate_tasks(learner, sampler, t.test_tasks, t.eval_inner_steps, gen,
                               progress=False)  # fmt: skip
    assert (one["test/acc"], one["test/acc_ci95"]) == (acc, half)
    assert three["test/best_iteration"] == one["test/best_iteration"]


@pytest.mark.slow
@pytest.mark.parametrize("at", [2, 4])
def test_a_run_stopped_after_a_validation_resumes_to_the_same_top_k(tmp_path, monkeypatch, at):
    """Stopped inside meta-step ``at`` after its validation ranked its weights (before the
    step was logged), the resumed run re-runs that step and keeps the top K an
    uninterrupted run keeps: no validation counted twice, none lost."""
    whole = om.main(tiny_args(tmp_path / "whole", ensemble_top_k=3))
    original, calls = om.validate, {"n": 0}

    def stopped_after(*args):
        out = original(*args)
        calls["n"] += 1
        if calls["n"] == at:
            raise KeyboardInterrupt("simulated Ctrl-C")
        return out

    monkeypatch.setattr(om, "validate", stopped_after)
    with pytest.raises(KeyboardInterrupt):
        om.main(tiny_args(tmp_path / "cut", ensemble_top_k=3))
    monkeypatch.setattr(om, "validate", original)
    stopped = load_checkpoint(tmp_path / "cut" / "r" / "checkpoint.pt")
    assert stopped["iteration"] == at - 1 and len(stopped["top"]) == min(at - 1, 3)
    resumed = om.main(tiny_args(tmp_path / "cut", ensemble_top_k=3, resume=True))

    a = load_checkpoint(tmp_path / "whole" / "r" / "checkpoint.pt")
    b = load_checkpoint(tmp_path / "cut" / "r" / "checkpoint.pt")
    assert [(e["iteration"], e["val"]) for e in b["top"]] == [
        (e["iteration"], e["val"]) for e in a["top"]
    ]
    for x, y in zip(a["top"], b["top"], strict=True):
        for name, value in x["learner"].items():
            assert torch.equal(y["learner"][name], value), name
    assert resumed["test/acc"] == whole["test/acc"]


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--ensemble-top-k", "0"], "--ensemble-top-k 0: must be at least 1"),
        (["--ensemble-top-k", "6", "--iterations", "10", "--val-every", "2"],
         "--ensemble-top-k 6 is more than the 5 validations"),
        (["--ensemble-top-k", "5", "--iterations", "7", "--val-every", "2"],
         "--ensemble-top-k 5 is more than the 4 validations"),  # 2, 4, 6 and the last, 7
        (["--ensemble-top-k", "2", "--algorithm", "protonet"], "protonet scores queries"),
        (["--ensemble-top-k", "2", "--algorithm", "reptile"], "reptile scores queries"),
    ],
)  # fmt: skip
def test_an_ensemble_that_cannot_work_is_refused(flags, says):
    with pytest.raises(UserError, match=says) as err:
        om.resolve_args(om.parse_args([*flags, "--no-track"]))
    assert "\n" not in str(err.value)


def test_k_equal_to_the_validations_is_accepted():
    args = om.resolve_args(om.parse_args(["--ensemble-top-k", "4", "--iterations", "7",
                                          "--val-every", "2", "--no-track"]))  # fmt: skip
    assert args.training.ensemble_top_k == 4


def test_the_command_line_refuses_a_bad_k_in_one_line_with_exit_2(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "experiments" / "omniglot_maml.py"), "--ensemble-top-k",
         "0", "--no-track", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["error: --ensemble-top-k 0: must be at least 1"]
    assert not any(tmp_path.iterdir())


def test_a_run_without_validation_tasks_is_refused(tmp_path):
    """`Run.start` of a loop with no validation split: nothing to rank the weights by."""
    args = tiny_args(tmp_path, ensemble_top_k=2)
    with Run(om.EXPERIMENT, args) as run:
        learner = build_learner(run.recipe)
        opt = torch.optim.SGD(learner.parameters(), lr=0.0)
        with pytest.raises(UserError, match="no validation classes; drop --ensemble-top-k"):
            run.start(learner, opt, torch.Generator(), validates=False)
    assert not (tmp_path / "r" / "checkpoint.pt").exists()


@pytest.mark.slow
def test_evaluating_the_ensemble_of_a_run_that_kept_none_is_one_line(tmp_path, capsys):
    om.main(tiny_args(tmp_path, iterations=1))
    capsys.readouterr()
    code = evaluate_tool.main(["--checkpoint", str(tmp_path / "r" / "checkpoint.pt"),
                               "--which", "ensemble", "--no-track"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "kept no ensemble" in err[0]
