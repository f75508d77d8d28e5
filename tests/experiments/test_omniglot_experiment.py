"""experiments/omniglot_maml.py on the real Omniglot data: runs, logs, checkpoints, resumes.

Every test runs the real experiment (tiny conv4, a few meta-steps), offline W&B read back
with wandb's own reader; the kill tests run it as a separate process and kill it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import wandb

from metalearn.algorithms import IMAML, Reptile
from metalearn.checkpoint import load_checkpoint
from metalearn.runs.cli import flatten, replace_flat
from metalearn.runs.lifecycle import UserError, latest_segment
from metalearn.runs.recipe import (
    build_learner,
    read_recipe,
    recipe_from_args,
    resolve_learner_args,
)
from metalearn.runs.records import read_offline_run
from tests.conftest import OMNIGLOT, ROOT, needs_omniglot
from tests.helpers.run_helpers import main_interrupted, make, om, recipe_of

DATA = OMNIGLOT
pytestmark = needs_omniglot
TINY = dict(  # MAML given explicitly: the command line's default preset trains Proto-MAML
    algorithm="maml", iterations=2, meta_batch=2, query=1, eval_query=2, hidden=8, val_every=1,
    val_tasks=3, test_tasks=4, eval_inner_steps=2, checkpoint_every=1, data_root=str(DATA),
    track=False, device="cpu",
)  # fmt: skip


def tiny_args(tmp_path: Path, **overrides) -> om.Args:
    """Two meta-steps of a small conv4: the real code path, sized for a test."""
    return make(om, **{**TINY, "out_dir": str(tmp_path), **overrides})


def _flags(tmp_path: Path, **overrides) -> list[str]:
    """TINY as command-line flags (the form a user types)."""
    values = {**TINY, "out_dir": str(tmp_path), **overrides}
    out = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        out += (
            [flag if value else "--no-" + flag[2:]]
            if isinstance(value, bool)
            else [flag, str(value)]
        )
    return out


def _checkpoint(tmp_path: Path, name: str) -> dict:
    return load_checkpoint(tmp_path / name / "checkpoint.pt")


def _steps(record) -> list[int]:
    return [row["_step"] for row in record.history if "train/loss" in row]


# --------------------------------------------------------------------------- what is recorded


def test_two_meta_steps_log_to_wandb_and_report_test_accuracy(tmp_path, capsys):
    results = om.main(tiny_args(tmp_path, track=True, wandb_mode="offline"))
    out = capsys.readouterr()
    (folder,) = [p.parent for p in tmp_path.glob("*/checkpoint.pt")]  # named by the run
    name = folder.name
    assert name.startswith("maml-5w1s-lr2-steps1-seed0-")  # MAML's default rate, 2.0
    assert f"checkpoint: {folder / 'checkpoint.pt'}" in out.out
    assert "W&B run: " + str(tmp_path / "wandb" / "offline-run-") in out.out
    assert "-1" not in out.err  # no placeholder before the first validation
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    wandb.teardown()  # finish() may return before the .wandb file is complete
    record = read_offline_run(run_dir)
    assert record.name == name and name.endswith("-" + record.run_id)  # the id names the run
    assert record.config["algorithm"] == "maml" and record.config["split"] == "maml"
    assert record.config["dataset"] == "omniglot" and "git_commit" in record.config
    assert _steps(record) == [1, 2] and len(record.series("val/acc")[1]) == 2
    assert record.summary["test/acc"] == pytest.approx(results["test/acc"])
    assert record.state == "finished" and "maml" in record.tags and "5w1s" in record.tags
    assert record.job_type == "train"
    # The summary holds the best validation, not the last (what the sweeps optimise).
    best = max(record.series("val/acc")[1])
    assert record.summary["val/acc"] == {"max": best} and record.summary["val/best_acc"] == best
    assert _checkpoint(tmp_path, name)["results"]["test/acc"] == results["test/acc"]
    # A run named for the user resumes by that name, in the same W&B run.
    om.main(tiny_args(tmp_path, iterations=3, run_name=name, resume=True, track=True,
                      wandb_mode="offline"))  # fmt: skip
    wandb.teardown()
    assert latest_segment(tmp_path / "wandb", record.run_id) != run_dir
    assert _checkpoint(tmp_path, name)["iteration"] == 3


@pytest.mark.parametrize(
    ("algorithm", "cls", "expected"),
    [("imaml", IMAML, {"inner_steps": 16, "inner_lr": 0.1, "cg_damping": 11.0}),
     ("reptile", Reptile, {"inner_steps": 5, "inner_lr": 1e-3, "cg_damping": None})],
)  # fmt: skip
def test_what_runs_is_what_is_recorded(tmp_path, monkeypatch, algorithm, cls, expected):
    built, build = [], om.make_learner  # keep what the experiment builds
    monkeypatch.setattr(om, "make_learner",
                        lambda *a: built.append(build(*a)) or built[-1])  # fmt: skip
    args = tiny_args(tmp_path, algorithm=algorithm, iterations=1, track=True, run_name="r",
                     wandb_mode="offline", eval_inner_steps=1)  # fmt: skip
    om.main(args)
    (learner,) = built
    assert type(learner) is cls
    assert (learner.inner_steps, learner.inner_lr) == (
        expected["inner_steps"],
        expected["inner_lr"],
    )
    if cls is IMAML:
        assert learner.cg_damping == expected["cg_damping"]
    checkpoint = _checkpoint(tmp_path, "r")
    saved = checkpoint["args"]
    wandb.teardown()  # finish() may return before the .wandb file is complete
    config = read_offline_run(next((tmp_path / "wandb").glob("offline-run-*"))).config
    for key, value in expected.items():
        assert saved[key] == value and config[key] == value, key
    # The recipe in the checkpoint and in W&B is the learner that ran, every argument of it;
    # W&B holds it once: the resolved flags, and the learner's arguments no flag sets.
    recipe = read_recipe(checkpoint)
    assert "recipe" not in config and config["wandb_group"] == f"{algorithm}-5w1s"
    from_config = recipe_from_args("omniglot_maml", config)
    assert replace(from_config, data=replace(from_config.data, root=recipe.data.root)) == recipe
    assert config["data_root"] == str(Path(recipe.data.root).resolve())
    assert config["learner"] and all(
        recipe.learner.arguments[k] == v for k, v in config["learner"].items()
    )
    assert recipe.learner.algorithm == algorithm
    rebuilt = build_learner(recipe)
    assert type(rebuilt) is cls and rebuilt.inner_steps == learner.inner_steps
    assert rebuilt.inner_lr == learner.inner_lr


def test_cg_negative_curvature_flag_round_trips_and_its_fraction_is_logged(tmp_path):
    """``--cg-negative-curvature stop`` is the learner argument that runs, in the recipe and
    rebuilt from it; each meta-step logs the fraction of tasks whose CG met non-positive
    curvature beside the fraction that converged. Left open it is the reference's
    "continue"."""
    built, build = [], om.make_learner
    flags = _flags(tmp_path, algorithm="imaml", iterations=1, inner_steps=1, run_name="r",
                   cg_negative_curvature="stop")  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(om, "make_learner", lambda *a: built.append(build(*a)) or built[-1])
        om.main(om.parse_args(flags))
    assert built[0].cg_negative_curvature == "stop"
    saved = _checkpoint(tmp_path, "r")
    recipe = read_recipe(saved)
    assert recipe.learner.arguments["cg_negative_curvature"] == "stop"
    assert build_learner(recipe).cg_negative_curvature == "stop"
    (row,) = [r for r in saved["history"] if "train/loss" in r]
    assert 0 <= row["train/cg_negative_curvature"] <= 1 and 0 <= row["train/cg_converged"] <= 1
    default = om.parse_args(_flags(tmp_path, algorithm="imaml", run_name="d"))
    assert default.learner.cg_negative_curvature is None  # open: the learner's own
    assert resolve_learner_args(flatten(default))["cg_negative_curvature"] == "continue"
    with pytest.raises(ValueError, match="--cg-negative-curvature is a setting of imaml; drop "
                                         "it for maml"):  # fmt: skip
        resolve_learner_args(
            {**flatten(default), "algorithm": "maml", "cg_negative_curvature": "stop"}
        )


def test_default_run_names_say_lr_and_steps_and_never_repeat(tmp_path):
    a = om.resolve_args(tiny_args(tmp_path, inner_lr=0.1, inner_steps=1))
    b = om.resolve_args(tiny_args(tmp_path, inner_lr=0.4, inner_steps=5))
    again = om.resolve_args(tiny_args(tmp_path, inner_lr=0.4, inner_steps=5))
    assert a.tracking.run_name == f"maml-5w1s-lr0.1-steps1-seed0-{a.tracking.wandb_id}"
    assert b.tracking.run_name == f"maml-5w1s-lr0.4-steps5-seed0-{b.tracking.wandb_id}"
    assert again.tracking.run_name != b.tracking.run_name  # the same settings, a new run
    with pytest.raises(UserError, match="--resume continues the run named by --run-name"):
        om.resolve_args(tiny_args(tmp_path, resume=True))


# --------------------------------------------------------------------------- resume


def test_resume_reaches_the_uninterrupted_result(tmp_path):
    om.main(tiny_args(tmp_path, iterations=4, run_name="straight"))
    om.main(tiny_args(tmp_path, iterations=2, run_name="split"))
    om.main(tiny_args(tmp_path, iterations=4, run_name="split", resume=True))
    straight, split = _checkpoint(tmp_path, "straight"), _checkpoint(tmp_path, "split")
    for key in straight["learner"]:
        assert torch.equal(straight["learner"][key], split["learner"][key]), key
    assert [r["train/loss"] for r in split["history"]] == [
        r["train/loss"] for r in straight["history"]
    ]


def test_an_interrupted_run_keeps_its_last_step_and_resumes(tmp_path, monkeypatch):
    om.main(tiny_args(tmp_path, iterations=4, run_name="straight"))
    main_interrupted(monkeypatch, tiny_args(tmp_path, iterations=4, run_name="killed"), at_step=3)
    assert _checkpoint(tmp_path, "killed")["iteration"] == 2
    om.main(tiny_args(tmp_path, iterations=4, run_name="killed", resume=True))
    straight, resumed = _checkpoint(tmp_path, "straight"), _checkpoint(tmp_path, "killed")
    assert all(
        torch.equal(straight["learner"][k], resumed["learner"][k]) for k in straight["learner"]
    )


def test_resume_continues_the_saved_run_and_refuses_changes(tmp_path):
    om.main(tiny_args(tmp_path, algorithm="fomaml", inner_lr=0.3, run_name="f"))
    path = tmp_path / "f" / "checkpoint.pt"
    # The saved algorithm and lr hold without repeating them; --iterations may grow.
    args = om.parse_args(["--resume", "--run-name", "f", "--out-dir", str(tmp_path),
                          "--iterations", "3"])  # fmt: skip
    flat = flatten(args)
    assert (flat["algorithm"], flat["inner_lr"], flat["hidden"], flat["iterations"]) == (
        "fomaml", 0.3, 8, 3,
    )  # fmt: skip
    before = path.read_bytes()
    for flags, message in [
        (["--algorithm", "maml"], "--algorithm maml differs from the resumed run's fomaml"),
        (["--inner_lr=0.05"], "--inner-lr 0.05 differs from the resumed run's 0.3"),
        (["--seed", "7"], "--seed 7 differs from the resumed run's 0"),
    ]:
        changed = om.parse_args(["--resume", "--run-name", "f", "--out-dir", str(tmp_path), *flags])
        with pytest.raises(UserError, match=message):
            om.main(changed)
    with pytest.raises(UserError, match="--iterations 1 is below the 2 steps"):
        om.main(replace_flat(args, iterations=1))
    assert path.read_bytes() == before and sorted(p.name for p in path.parent.iterdir()) == [
        "checkpoint.pt"
    ]
    om.main(args)
    assert _checkpoint(tmp_path, "f")["iteration"] == 3
    assert _checkpoint(tmp_path, "f")["args"]["algorithm"] == "fomaml"


def test_clear_errors_for_resume_mistakes(tmp_path):
    with pytest.raises(UserError, match="drop --resume"):
        om.main(tiny_args(tmp_path, run_name="nothing-here", resume=True))
    om.main(tiny_args(tmp_path, iterations=1, run_name="done"))
    with pytest.raises(UserError, match="pass --resume"):
        om.main(tiny_args(tmp_path, iterations=1, run_name="done"))
    # Runs have no --overwrite: the message names a free folder and how to start over.
    (tmp_path / "done-2").mkdir()
    before = (tmp_path / "done" / "checkpoint.pt").read_bytes()
    with pytest.raises(UserError) as refused:
        om.main(tiny_args(tmp_path, iterations=1, run_name="done"))
    message = str(refused.value)
    assert "never overwritten" in message and "--run-name done-3" in message
    assert str(tmp_path / "done-3") in message and f"delete {tmp_path / 'done'}" in message
    assert (tmp_path / "done" / "checkpoint.pt").read_bytes() == before


def test_a_resumed_run_says_where_it_resumes(tmp_path, capsys):
    om.main(tiny_args(tmp_path, iterations=1, run_name="r"))
    capsys.readouterr()
    om.main(tiny_args(tmp_path, iterations=2, run_name="r", resume=True))
    lines = capsys.readouterr().out.splitlines()
    assert lines.count("resuming r at meta-step 1 of 2") == 1


def test_a_nan_validation_is_never_the_best_and_a_diverged_run_exits_non_zero(
    tmp_path, monkeypatch
):
    """The diverging command of the report (inner lr 200, NaN tasks skipped), sized down.
    A run whose validations are all NaN ends in one line saying so, exit 2; one whose first
    validation is NaN keeps the later finite one as its best, and its NaN test accuracy
    ends the run the same way, unfinished (no NaN result is recorded as the run's)."""
    # The report's run adapted the norm layers (MAML's behaviour then): held fixed, as now by
    # default, inner lr 200 does not turn every validation NaN.
    diverging = dict(inner_lr=200.0, on_nonfinite="skip", iterations=10, val_every=5,
                     val_tasks=10, test_tasks=10, eval_inner_steps=10, adapt_norm=True)  # fmt: skip
    flags = {**diverging, "adapt_norm": "True"}  # --adapt-norm takes a value
    cmd = [sys.executable, str(ROOT / "experiments" / "omniglot_maml.py"),
           *_flags(tmp_path, **flags, run_name="all")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and "test/acc" not in done.stdout
    assert done.stderr.strip().splitlines()[-1] == (
        "error: all 2 validations of all were NaN, so no weights are the best and none were "
        "tested; the run diverged: lower --inner-lr or --outer-lr"
    )
    saved = _checkpoint(tmp_path, "all")
    assert saved["best_val"] is None and saved["results"] is None and saved["iteration"] == 10
    # Which validations of a diverging run come out NaN depends on the machine's arithmetic:
    # the evaluations are scripted here (NaN, then finite, then a NaN test) so the lifecycle's
    # handling of each is what is tested.
    scripted = iter([(float("nan"), float("nan")), (0.5, 0.1), (float("nan"), float("nan"))])
    monkeypatch.setattr(om, "evaluate_tasks", lambda *args, **kwargs: next(scripted))
    with pytest.raises(UserError, match="test/acc of some is NaN.*lower --inner-lr"):
        om.main(tiny_args(tmp_path, iterations=10, val_every=5, val_tasks=10, test_tasks=10,
                          run_name="some"))  # fmt: skip
    saved = _checkpoint(tmp_path, "some")
    validations = [row["val/acc"] for row in saved["history"] if "val/acc" in row]
    assert validations[0] != validations[0] and validations[1] == 0.5  # NaN, finite
    assert saved["best_val"] == 0.5 and saved["best_iteration"] == 10
    assert saved["results"] is None


def test_trainval_trains_on_train_and_validation_classes_and_tests_the_last_weights(
    tmp_path, monkeypatch
):
    """``--trainval`` (Prototypical Networks' final model, run_trainval.py): ProtoNet trains
    on the 4,800 classes of MAML's training and validation characters (the reference's
    vinyals/trainval.txt: 4,800) for --iterations, validates never, and tests the weights of
    its last step; the recipe records it."""
    seen, load = [], om.load_samplers
    monkeypatch.setattr(om, "load_samplers", lambda *a: seen.append(load(*a)) or seen[-1])
    flags = _flags(tmp_path, algorithm="protonet", trainval=True, iterations=3, val_every=2,
                   run_name="tv")  # fmt: skip
    results = om.main(om.parse_args(flags))
    (samplers,) = seen
    assert set(samplers) == {"train", "test"}
    assert (samplers["train"].num_classes, samplers["test"].num_classes) == (4800, 1692)
    saved = _checkpoint(tmp_path, "tv")
    assert read_recipe(saved).data.trainval is True
    assert not any(k.startswith("val/") for row in saved["history"] for k in row)
    assert results["test/best_iteration"] == saved["best_iteration"] == 3  # the last step
    for key, value in saved["learner"].items():  # tested: the weights training ended with
        assert torch.equal(saved["best_learner"][key], value), key
    assert 0.0 <= results["test/acc"] <= 1.0


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"val_every": 0}, "--val-every 0: must be at least 1"),
     ({"checkpoint_every": 0}, "--checkpoint-every 0"),
     ({"test_tasks": 0}, "--test-tasks 0"),
     ({"iterations": -1}, "--iterations -1"),
     ({"inner_lr": -5.0}, "--inner-lr -5.0: must be a positive finite number"),
     ({"outer_lr": float("inf")}, "--outer-lr inf: must be a positive finite number"),
     ({"threads": -2}, "--threads -2"),
     ({"shots": 0}, "--shots 0"),
     ({"ways": 1}, "--ways 1"),
     ({"cg_damping": 1.0}, "--cg-damping is a setting of imaml"),
     ({"trainval": True, "ensemble_top_k": 2}, "--trainval trains on the validation classes "
                                               "too, so there are no validations")],
)  # fmt: skip
def test_bad_values_are_refused_before_anything_runs(tmp_path, overrides, message):
    with pytest.raises(UserError, match=message):
        om.main(tiny_args(tmp_path, **overrides))
    assert list(tmp_path.iterdir()) == []


def test_a_missing_data_root_is_named_not_created(tmp_path):
    typo = tmp_path / "omniglto"
    with pytest.raises(UserError, match=f"--data-root {typo} does not exist"):
        om.main(tiny_args(tmp_path, data_root=str(typo)))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="Omniglot was not found"):
        om.main(tiny_args(tmp_path, data_root=str(empty)))
    assert not typo.exists() and list(empty.iterdir()) == []


def test_user_errors_exit_2_with_one_line(tmp_path):
    cmd = [sys.executable, str(ROOT / "experiments" / "omniglot_maml.py"),
           *_flags(tmp_path, val_every=0)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == "error: --val-every 0: must be at least 1"


def test_command_line_forms(tmp_path):
    args = flatten(om.parse_args(["--inner_lr=0.3", "--inner-steps", "2", "--no-track"]))
    assert (args["inner_lr"], args["inner_steps"], args["track"]) == (0.3, 2, False)
    preset = flatten(om.parse_args(["--preset", "paper-20w1s", "--iterations", "5"]))
    # cbfinn/maml's update_lr 0.1 on 20 times the mean loss: 2.0 on metalearn's mean
    assert (preset["ways"], preset["meta_batch"], preset["inner_lr"]) == (20, 16, 2.0)
    assert (preset["inner_steps"], preset["algorithm"]) == (5, "maml")
    assert preset["iterations"] == 5  # an explicit flag wins over the preset
    assert flatten(om.parse_args(["--augment=True"]))["augment"] is True


def test_defaults_are_the_default_preset():
    """Args() under the cpu preset and the command line with no flags agree on every field
    (one source); the preset adds only the learner values its result was measured with."""
    assert om.parse_args([]) == replace_flat(om.Args(), **om.PRESETS["cpu"])
    assert flatten(om.Args())["algorithm"] == "protomaml"
    assert set(om.PRESETS["cpu"]) == {"algorithm", "inner_lr", "inner_steps", "first_order",
                                      "adapt_norm", "transductive"}  # fmt: skip


def test_help_shows_the_chosen_preset(capsys):
    with pytest.raises(SystemExit):
        om.parse_args(["--preset", "paper-20w1s", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "95%" in out and "--no-track" in out and "--resume" in out
    assert "(default: 60000)" in out and "(default: 20)" in out


# --------------------------------------------------------------------------- kills, signals


def _spawn(tmp_path: Path, **overrides) -> subprocess.Popen:
    """The experiment in a child process; its output goes to ``tmp_path/child.log`` (a pipe
    nobody reads would fill with the progress bar and stall the child)."""
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    cmd = [sys.executable, str(ROOT / "experiments" / "omniglot_maml.py"),
           *_flags(tmp_path, **overrides)]  # fmt: skip
    with open(tmp_path / "child.log", "w") as log:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_for_step(proc: subprocess.Popen, path: Path, step: int) -> None:
    """Poll the checkpoint until it holds ``step`` meta-steps (the run is mid-training)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, (path.parent.parent / "child.log").read_text()
        try:
            if load_checkpoint(path)["iteration"] >= step:
                return
        except (FileNotFoundError, RuntimeError, EOFError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint at step {step} within 300 s")


def test_sigkill_then_resume_logs_every_step_once(tmp_path):
    n = 60
    run = dict(iterations=n, val_every=20, run_name="k", track=True, wandb_mode="offline")
    proc = _spawn(tmp_path, **run)
    _wait_for_step(proc, tmp_path / "k" / "checkpoint.pt", 5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = _checkpoint(tmp_path, "k")
    assert 5 <= saved["iteration"] < n
    with pytest.warns(UserWarning, match="taking over a stale lock of process"):  # SIGKILLed
        om.main(tiny_args(tmp_path, **run, resume=True))
    wandb.teardown()  # finish() may return before the .wandb file is complete
    record = read_offline_run(latest_segment(tmp_path / "wandb", saved["wandb_id"]))
    assert _steps(record) == list(range(1, n + 1))
    assert record.series("val/acc")[0] == [20, 40, 60]
    assert record.state == "finished" and record.name == "k"


def test_sigterm_marks_the_run_failed_and_leaves_a_checkpoint(tmp_path):
    proc = _spawn(tmp_path, iterations=400, run_name="t", track=True, wandb_mode="offline")
    _wait_for_step(proc, tmp_path / "t" / "checkpoint.pt", 3)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, (tmp_path / "child.log").read_text()
    saved = _checkpoint(tmp_path, "t")
    assert saved["iteration"] >= 3 and saved["results"] is None
    summary = subprocess.run(
        [str(Path(sys.executable).with_name("wandb")), "leet", "inspect", "--summary", "--json",
         str(latest_segment(tmp_path / "wandb", saved["wandb_id"]))],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert json.loads(summary)["state"] == "failed"
    assert json.loads(summary)["exit_code"] == 128 + signal.SIGTERM


def test_log_model_puts_the_checkpoint_in_the_offline_run(tmp_path):
    om.main(tiny_args(tmp_path, iterations=1, run_name="m", track=True, wandb_mode="offline",
                      log_model=True))  # fmt: skip
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    lines = subprocess.run(
        [str(Path(sys.executable).with_name("wandb")), "leet", "inspect", "--json", str(run_dir)],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    (artifact,) = [r["artifact"] for r in map(json.loads, lines) if r.get("type") == "artifact"]
    assert artifact["type"] == "model" and artifact["name"] == "m-model"
    assert sorted(artifact["aliases"]) == ["best", "latest"]


# --------------------------------------------------------------------------- learning


@pytest.mark.parametrize(
    "algorithm", ["maml", "fomaml", "anil", "metasgd", "mamlpp", "imaml", "reptile"]
)
def test_every_algorithm_learns_above_chance(tmp_path, algorithm):
    """30 meta-steps of a 16-filter conv4, then 10 adaptation steps on 50 test tasks of
    5-way 1-shot (500 query answers; chance is 0.2 with a standard error of 0.018): each
    algorithm answers at least 0.28 (measured: 0.31 for ANIL and iMAML, 0.4+ for the rest).
    Reptile runs its reference's task shape (10 examples a class trained on, 5 tasks a
    step, 50 evaluation steps of Adam at 1e-3; measured 0.32): with 2 one-shot tasks a step
    and 10 evaluation steps its small Adam steps reach 0.27."""
    own = {"query": 9, "train_on_query": True, "meta_batch": 5, "eval_inner_steps": 50}
    results = om.main(tiny_args(tmp_path, **{
        "algorithm": algorithm, "iterations": 30, "hidden": 16, "val_every": 30,
        "test_tasks": 50, "eval_inner_steps": 10, **(own if algorithm == "reptile" else {}),
    }))  # fmt: skip
    assert results["test/acc"] >= 0.28


# --------------------------------------------------------------------------- schedules


def test_mamlpp_switches_to_second_order_at_the_recorded_step(tmp_path, monkeypatch):
    """The loop hands MAML++ each meta-step: --first-order-steps 3 of 6 logs
    train/second_order 0, 0, 0, 1, 1, 1, and the meta-gradients of the first three steps
    are first order (inner gradients detached) while the last three are not; MSL's weights
    move once an epoch of --msl-epoch-length 2 meta-steps."""
    orders = []
    original = om.meta_step

    def recording_step(recipe, learner, *args, **kwargs):
        row = original(recipe, learner, *args, **kwargs)
        orders.append(learner.inner_loop().first_order)
        return row

    monkeypatch.setattr(om, "meta_step", recording_step)
    args = tiny_args(tmp_path, algorithm="mamlpp", first_order_steps=3, msl_steps=4,
                     msl_epoch_length=2, inner_steps=2, iterations=6, val_every=6,
                     run_name="pp")  # fmt: skip
    om.main(args)
    saved = _checkpoint(tmp_path, "pp")
    history = saved["history"]
    assert [row["train/second_order"] for row in history] == [0, 0, 0, 1, 1, 1]
    assert orders == [True, True, True, False, False, False]
    # MSL: the last inner step's weight grows from 1/2 over the 4 recorded steps, once an
    # epoch of 2 (the reference's weights at epoch int(step / 2)), then is 1.
    assert [row["train/msl_last_weight"] for row in history] == pytest.approx(
        [0.5, 0.5, 0.75, 0.75, 1.0, 1.0]
    )
    assert saved["args"]["first_order_steps"] == 3 and saved["args"]["msl_steps"] == 4
    arguments = saved["recipe"]["learner"]["arguments"]
    assert arguments["first_order_steps"] == 3 and arguments["msl_steps"] == 4


def test_reptile_anneals_its_outer_step_as_the_paper(tmp_path):
    om.main(tiny_args(tmp_path, algorithm="reptile", iterations=4, val_every=4, run_name="rp"))
    saved = _checkpoint(tmp_path, "rp")
    assert [row["train/outer_lr"] for row in saved["history"]] == [1.0, 0.75, 0.5, 0.25]
    assert saved["args"]["outer_lr"] == 1.0
    assert saved["recipe"]["learner"]["arguments"]["anneal"] is True


# --------------------------------------------------------------------------- presets


def test_the_maml_paper_presets_draw_k_queries_per_class_as_its_code():
    """cbfinn/maml's main.py draws ``DataGenerator(update_batch_size*2, ...)`` for Omniglot:
    K support and K query examples per class, in training and test alike."""
    for preset, shots in (("paper-5w1s", 1), ("paper-5w5s", 5), ("paper-20w1s", 1),
                          ("paper-20w5s", 5)):  # fmt: skip
        a = flatten(om.parse_args(["--preset", preset]))
        assert (a["shots"], a["query"], a["eval_query"]) == (shots, shots, shots), preset
        assert a["algorithm"] == "maml" and a["adapt_norm"] is None  # the learner's: False


def vgg_relu_norm_network(p: dict, x: torch.Tensor) -> torch.Tensor:
    """HowToTrainYourMAMLPytorch's VGGReLUNormNetwork with max_pooling and conv_padding
    written out: per stage a 3x3 conv with bias (stride 1, padding 1), batch norm with the
    batch's statistics (eps 1e-5), leaky ReLU (0.01), 2x2 max-pool; then the linear layer on
    the flattened features."""
    h = x
    for i in range(4):
        h = F.conv2d(h, p[f"features.{i}.conv.weight"], p[f"features.{i}.conv.bias"], padding=1)
        h = F.batch_norm(h, None, None, p[f"features.{i}.norm.weight"],
                         p[f"features.{i}.norm.bias"], training=True, eps=1e-5)  # fmt: skip
        h = F.max_pool2d(F.leaky_relu(h, 0.01), 2, stride=2, padding=0)
    return h.flatten(1) @ p["head.weight"].T + p["head.bias"]


@pytest.mark.parametrize("preset", ["mamlpp-5w1s", "mamlpp-5w5s", "mamlpp-20w1s", "mamlpp-20w5s"])
def test_mamlpp_presets_are_the_references_final_configs(preset):
    """experiment_config/omniglot_maml++-omniglot_*_8_0.1_64_*_0.json at 86964701, as its
    code reads them (the inner rate: the argparse default task_learning_rate, 0.1)."""
    ways, shots = int(preset.split("-")[1].split("w")[0]), int(preset[-2])
    recipe = recipe_of(om, om.parse_args(["--preset", preset]))
    learner = recipe.learner.arguments
    assert recipe.learner.algorithm == "mamlpp"
    assert (learner["inner_lr"], learner["inner_steps"], learner["first_order_steps"]) == (
        0.1, 5, 0,
    )  # fmt: skip
    assert (learner["msl_steps"], learner["msl_epoch_length"]) == (10 * 500, 500)
    assert learner["per_step_bn"] is True and learner["adapt_norm"] is False
    t = recipe.training
    assert (t.meta_batch, t.iterations, t.outer_lr, t.eval_inner_steps) == (8, 50_000, 1e-3, 5)
    assert (t.lr_schedule, t.eta_min, t.schedule_every) == ("cosine", 1e-5, 500)
    # experiment_builder.py: evaluated_test_set_using_the_best_models(top_n_models=5); the
    # clamp of meta_update is for ImageNet only ('imagenet' in dataset_name)
    assert (t.ensemble_top_k, t.grad_clamp) == (5, None)
    assert (recipe.data.ways, recipe.data.shots, recipe.data.query) == (ways, shots, 1)
    assert recipe.data.eval_query == 1
    m = recipe.model
    assert (m.hidden, m.pool, m.activation, m.ways) == (64, "max", "leaky_relu", ways)
    model = build_learner(recipe).model.double()
    x = torch.randn(7, 1, 28, 28, dtype=torch.float64)
    p = dict(model.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(x), vgg_relu_norm_network(p, x), rtol=1e-12,
                                   atol=1e-12)  # fmt: skip


def test_the_cpu_mamlpp_preset_shrinks_the_schedules_alike():
    recipe = recipe_of(om, om.parse_args(["--preset", "cpu-mamlpp"]))
    t, learner = recipe.training, recipe.learner.arguments
    assert t.iterations // t.schedule_every == 100  # the reference's 100 epochs
    assert learner["msl_steps"] // learner["msl_epoch_length"] == 10  # and 10 of MSL
    assert t.ensemble_top_k == 3 <= t.iterations // t.val_every  # of its 5 validations
    assert (recipe.model.pool, recipe.model.activation) == ("max", "leaky_relu")
