"""metalearn-evaluate and metalearn.runs.evaluation on real tiny runs' checkpoints, an Omniglot
run and a few-shot run on an image folder: the printed accuracy is the evaluation done by
hand (load_learner, the test split's sampler, learner.evaluate, the same seed), at two step
counts; the eval run lands in W&B in the run's group; every user error is one line and exit
status 2."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import wandb

from metalearn.checkpoint import save_checkpoint
from metalearn.data import load_image_set, load_omniglot, omniglot_samplers
from metalearn.deploy import load_learner
from metalearn.runs.evaluation import accuracy_interval, evaluate_tasks
from metalearn.runs.records import read_offline_run
from metalearn.tools import evaluate as script
from tests.conftest import HAS_OMNIGLOT, NO_OMNIGLOT, OMNIGLOT, ROOT
from tests.helpers.image_set_fixtures import write_folder
from tests.helpers.run_helpers import fs, make, om

DATA = OMNIGLOT
RESULT = re.compile(r"test/acc: (\d\.\d{4}) ± (\d\.\d{4}|nan)")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """Two meta-steps of the experiment itself (validated, so best weights exist), offline W&B."""
    if not HAS_OMNIGLOT:
        pytest.skip(NO_OMNIGLOT)
    tmp = tmp_path_factory.mktemp("runs")
    args = make(
        om, algorithm="maml", iterations=2, meta_batch=2, query=1, eval_query=2, hidden=8,
        val_every=1, val_tasks=3,
        test_tasks=4, eval_inner_steps=2, checkpoint_every=1, data_root=str(DATA),
        out_dir=str(tmp), track=True, wandb_mode="offline", device="cpu",
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as env:  # wandb's folders inside tmp, as conftest does
        for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_DIR"):
            env.setenv(var, str(tmp / "wandb-env" / var.lower()))
        om.main(args)
        sys.modules["wandb"].teardown()
    (path,) = tmp.glob("*/checkpoint.pt")  # runs/<run_name>/checkpoint.pt
    return path


def _by_hand(path: Path, *, steps: int, tasks: int, seed: int, shots: int, query: int):
    """The reference: the pieces called directly, every task drawn in one batch."""
    learner, recipe = load_learner(path, which="best")
    data = recipe.data
    sampler = omniglot_samplers(load_omniglot(data.root), data.split, ways=data.ways, shots=shots,
                                queries=query)["test"]  # fmt: skip
    drawn = sampler.batch(tasks, torch.Generator().manual_seed(seed))
    acc = learner.evaluate(drawn, steps=steps)[1].double().numpy()
    return acc.mean(), 1.96 * acc.std(ddof=1) / math.sqrt(tasks)


def _last_line(capsys) -> re.Match:
    lines = capsys.readouterr().out.strip().splitlines()
    match = RESULT.fullmatch(lines[-1])
    assert match, lines[-1]
    return match


@pytest.mark.parametrize(("steps", "shots", "query"), [(0, 1, 2), (3, 2, 5)])
def test_the_printed_accuracy_is_the_evaluation_by_hand(checkpoint, capsys, steps, shots, query):
    argv = ["--checkpoint", str(checkpoint), "--tasks", "7", "--steps", str(steps), "--seed",
            "5", "--shots", str(shots), "--query", str(query), "--no-track"]  # fmt: skip
    assert script.main(argv) == 0
    printed = _last_line(capsys)
    mean, half = _by_hand(checkpoint, steps=steps, tasks=7, seed=5, shots=shots, query=query)
    assert printed[1] == f"{mean:.4f}" and printed[2] == f"{half:.4f}"


def test_the_result_does_not_depend_on_the_chunk_size(checkpoint) -> None:
    learner, recipe = load_learner(checkpoint)
    sampler = omniglot_samplers(load_omniglot(recipe.data.root), "maml", ways=5, shots=1,
                                queries=2)["test"]  # fmt: skip
    results = {
        chunk: evaluate_tasks(
            learner, sampler, 7, 1, torch.Generator().manual_seed(3), chunk=chunk, progress=False
        )  # fmt: skip
        for chunk in (1, 3, 50)
    }
    assert results[1] == results[3] == results[50]
    seen: list[int] = []  # a caller's own progress: told of each chunk's tasks
    again = evaluate_tasks(learner, sampler, 7, 1, torch.Generator().manual_seed(3), chunk=3,
                           progress=seen.append)  # fmt: skip
    assert seen == [3, 3, 1] and again == results[3]
    counted: list[int] = []  # an ensemble of 2 adapts each task twice: each task counted twice
    state = learner.state_dict()
    both = evaluate_tasks(learner, sampler, 7, 1, torch.Generator().manual_seed(3), chunk=3,
                          progress=counted.append, ensemble=[state, state])  # fmt: skip
    assert counted == [6, 6, 2] and both[0] == pytest.approx(results[3][0], abs=1e-12)
    accuracies = learner.evaluate(sampler.batch(7, torch.Generator().manual_seed(3)), steps=1)[1]
    assert results[1][0] == pytest.approx(accuracies.double().mean().item(), abs=1e-12)
    with pytest.raises(ValueError, match="need tasks >= 1"):
        evaluate_tasks(learner, sampler, 0, 1, torch.Generator())


def test_accuracy_interval_is_the_normal_95_percent_half_width() -> None:
    values = torch.tensor([0.2, 0.4, 0.4, 1.0, 0.6])
    want = 1.96 * np.std(values.double().numpy(), ddof=1) / math.sqrt(5)
    assert accuracy_interval(values) == pytest.approx(want, rel=1e-12)
    assert math.isnan(accuracy_interval(values[:1]))


def test_the_eval_run_is_logged_in_the_runs_group(checkpoint, capsys) -> None:
    wandb_dir = checkpoint.parent.parent / "wandb"
    before = set(wandb_dir.glob("offline-run-*"))
    argv = ["--checkpoint", str(checkpoint), "--tasks", "3", "--wandb-mode", "offline"]
    assert script.main(argv) == 0
    out = capsys.readouterr().out
    assert "2 inner steps" in out  # the run's eval_inner_steps by default
    printed = RESULT.fullmatch(out.strip().splitlines()[-1])
    (run_dir,) = set(wandb_dir.glob("offline-run-*")) - before
    (train_dir,) = before
    wandb.teardown()  # finish() may return before the .wandb file is complete
    record, trained = read_offline_run(run_dir), read_offline_run(train_dir)
    assert record.group == trained.group and record.group  # the training run's group
    assert record.config["checkpoint"] == str(checkpoint.resolve())
    assert (record.config["steps"], record.config["tasks"], record.config["which"]) == (
        2,
        3,
        "best",
    )
    assert (record.config["ways"], record.config["shots"], record.config["query"]) == (5, 1, 2)
    assert f"{record.summary['test/acc']:.4f}" == printed[1]
    assert _job_type(run_dir) == "eval" and record.job_type == "eval"
    # Its own name and W&B id, beside the run it evaluated, which it names.
    assert record.name == f"{trained.name}-eval-{record.run_id}"
    assert record.config["training_run_id"] == trained.run_id
    assert record.config["run"] == trained.name


@pytest.fixture(scope="module")
def logged_model(tmp_path_factory) -> Path:
    """A tiny run with --log-model, its out_dir then moved away (another machine)."""
    if not HAS_OMNIGLOT:
        pytest.skip(NO_OMNIGLOT)
    tmp = tmp_path_factory.mktemp("logged")
    args = make(
        om, algorithm="maml", iterations=1, meta_batch=2, query=1, eval_query=2, hidden=8,
        val_every=1, val_tasks=2, test_tasks=2, eval_inner_steps=1, data_root=str(DATA),
        out_dir=str(tmp / "runs"), track=True, wandb_mode="offline", device="cpu",
        log_model=True,
    )  # fmt: skip
    with pytest.MonkeyPatch.context() as env:
        for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_DIR"):
            env.setenv(var, str(tmp / "wandb-env" / var.lower()))
        om.main(args)
        sys.modules["wandb"].teardown()
    shutil.move(tmp / "runs", tmp / "moved")
    return tmp / "moved"


def test_a_logged_model_moved_elsewhere_is_evaluated_from_its_artifact(logged_model, capsys):
    (checkpoint,) = logged_model.glob("*/checkpoint.pt")
    name = checkpoint.parent.name
    (train_dir,) = (logged_model / "wandb").glob("offline-run-*")
    (artifact,) = [json.loads(line)["artifact"] for line in _leet(train_dir)
                   if '"type":"artifact"' in line]  # fmt: skip
    (entry,) = artifact["manifest"]["contents"]
    kept = train_dir / entry["local_path"]  # inside the moved folder
    assert kept.read_bytes() == checkpoint.read_bytes()
    common = ["--tasks", "3", "--steps", "1", "--wandb-mode", "offline"]
    assert script.main(["--checkpoint", str(checkpoint), "--no-track", *common]) == 0
    by_file = _last_line(capsys)
    argv = ["--artifact", f"{name}-model:best", "--out-dir", str(logged_model), *common]
    assert script.main(argv) == 0
    assert _last_line(capsys).groups() == by_file.groups()
    wandb.teardown()
    (eval_dir,) = set((logged_model / "wandb").glob("offline-run-*")) - {train_dir}
    record = read_offline_run(eval_dir)
    assert record.config["artifact"] == f"{name}-model:best"
    assert record.config["artifact_digest"] == artifact["digest"]
    assert record.config["training_run_id"] == read_offline_run(train_dir).run_id
    assert script.main(["--artifact", f"{name}-model:v7", "--out-dir", str(logged_model)]) == 2
    assert "no offline run in" in capsys.readouterr().err


def test_an_online_artifact_without_a_login_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    _refused(
        capsys,
        ["--artifact", "r-model", "--wandb-mode", "online"],
        "--wandb-mode online needs a W&B API key and none is set: run `wandb login`",
    )
    # Not tracked, the artifact is still fetched online: wandb's own refusal, in one line.
    _refused(capsys, ["--artifact", "r-model", "--wandb-mode", "online", "--no-track"],
             "artifact metalearn-omniglot/r-model:best: No API key configured")  # fmt: skip


def _leet(run_dir: Path) -> list[str]:
    wandb = Path(sys.executable).with_name("wandb")
    return subprocess.run([str(wandb), "leet", "inspect", "--json", str(run_dir)],
                          capture_output=True, text=True, check=True, timeout=120,
                          ).stdout.splitlines()  # fmt: skip


def _job_type(run_dir: Path) -> str:
    """The job type recorded in an offline run, read by wandb's own reader."""
    wandb = Path(sys.executable).with_name("wandb")
    lines = subprocess.run(
        [str(wandb), "leet", "inspect", "--json", str(run_dir)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    runs = [json.loads(line)["run"] for line in lines.splitlines() if '"type":"run"' in line]
    return runs[-1]["job_type"]


def _refused(capsys, argv: list[str], message: str) -> None:
    assert script.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("metalearn-evaluate: error: "), captured.err
    assert message in lines[0], lines[0]
    assert "test/acc" not in captured.out


def test_user_errors_are_one_line(checkpoint, tmp_path, capsys) -> None:
    run = ["--checkpoint", str(checkpoint), "--no-track", "--tasks", "2"]
    _refused(capsys, ["--no-track"], "pass --checkpoint runs/<run_name>/checkpoint.pt or")
    _refused(capsys, ["--checkpoint", str(tmp_path / "gone.pt")], "no checkpoint at")
    (tmp_path / "notes.pt").write_text("hello")
    _refused(capsys, ["--checkpoint", str(tmp_path / "notes.pt")], "is not a metalearn checkpoint")
    saved = torch.load(checkpoint, weights_only=True)
    early = save_checkpoint(tmp_path / "early" / "checkpoint.pt", {**saved, "best_learner": None})
    _refused(capsys, ["--checkpoint", str(early), "--no-track"], "(--which last)")
    _refused(capsys, [*run, "--ways", "3"], "head has 5 outputs (trained 5-way)")
    _refused(
        capsys,
        [*run, "--shots", "10", "--query", "15"],
        "--shots 10 with --query 15 needs 25 examples per class; Omniglot has 20",
    )
    # From the published sizes, before the data loads: the folder given is empty.
    (tmp_path / "empty").mkdir()
    _refused(
        capsys,
        [*run, "--shots", "19", "--query", "2", "--data-root", str(tmp_path / "empty")],
        "--shots 19 with --query 2 needs 21 examples per class; Omniglot has 20",
    )
    _refused(capsys, [*run, "--steps", "-1"], "--steps >= 0")


def test_weights_that_are_not_finite_are_refused_before_the_data_loads(checkpoint, tmp_path,
                                                                       capsys) -> None:  # fmt: skip
    """A run that diverged after its best validation can keep NaN weights: every test task
    would stop on a non-finite loss. The data root given is empty: nothing was loaded."""
    saved = torch.load(checkpoint, weights_only=True)
    best = {k: v.clone() for k, v in saved["best_learner"].items()}
    floats = [k for k, v in best.items() if v.is_floating_point()]
    best[floats[1]].view(-1)[0] = float("nan")
    best[floats[2]].view(-1)[0] = float("inf")
    path = save_checkpoint(tmp_path / "nan" / "checkpoint.pt", {**saved, "best_learner": best})
    before = path.read_bytes()
    (tmp_path / "empty").mkdir()
    _refused(capsys, ["--checkpoint", str(path), "--no-track", "--data-root",
                      str(tmp_path / "empty")],
             f"{path}: the best weights hold NaN or infinite values ({floats[1]} and 1 more): "
             "the run diverged; evaluate --which last, or train again with a lower --inner-lr "
             "or --outer-lr")  # fmt: skip
    assert path.read_bytes() == before and sorted(os.listdir(path.parent)) == ["checkpoint.pt"]
    # its latest weights are finite: --which last tests them
    assert script.main(["--checkpoint", str(path), "--no-track", "--tasks", "2",
                        "--which", "last"]) == 0  # fmt: skip
    assert RESULT.fullmatch(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("part", "field", "value", "message"),
    [(("data", "image"), "size", "abc",
      "the recipe's data.image.size: 'abc' is not a whole number of pixels from 1 to 1024"),
     (("data", "image"), "size", 100_000,
      "the recipe's data.image.size: 100000 is not a whole number of pixels from 1 to 1024"),
     (("model",), "image_size", "abc",
      "the recipe's model.image_size: 'abc' is not a whole number"),
     (("model",), "ways", 1, "the recipe's model.ways: 1 is not at least 2"),
     (("data",), "shots", "5", "the recipe's data.shots: '5' is not a whole number"),
     (("training",), "eval_inner_steps", -1, "the recipe's training.eval_inner_steps: -1 is not "
                                             "at least 0")],
)  # fmt: skip
def test_a_recipe_field_of_the_wrong_type_or_out_of_bounds_is_named(
    checkpoint, tmp_path, capsys, part, field, value, message
):
    """Each refusal names the recipe's field, not the data set or the model it would reach
    (an image side of 100000 crashed the decoding pool; a string reached int())."""
    saved = torch.load(checkpoint, weights_only=True)
    record = saved["recipe"]
    for key in part:
        record = record[key]
    record[field] = value
    path = save_checkpoint(tmp_path / "edited" / "checkpoint.pt", saved)
    _refused(capsys, ["--checkpoint", str(path), "--no-track"],
             f"{path}: {message}; the checkpoint was edited or damaged: use the one its run "
             "wrote")  # fmt: skip


def test_the_command_exits_2(tmp_path) -> None:
    missing = tmp_path / "runs" / "x" / "checkpoint.pt"
    command = [sys.executable, "-m", "metalearn.tools.evaluate", "--checkpoint", str(missing)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"metalearn-evaluate: error: no checkpoint at {missing}; pass a run's checkpoint, "
        "runs/<run_name>/checkpoint.pt"
    ]


def test_which_last_evaluates_the_latest_weights(checkpoint, tmp_path, capsys) -> None:
    saved = torch.load(checkpoint, weights_only=True)
    # Latest weights that differ from the best: 'last' must test them, 'best' must not.
    saved["learner"] = {
        k: v * 0 if v.is_floating_point() else v for k, v in saved["learner"].items()
    }
    path = save_checkpoint(tmp_path / "r" / "checkpoint.pt", saved)
    common = ["--checkpoint", str(path), "--tasks", "4", "--no-track", "--steps", "0"]
    script.main([*common, "--which", "last"])
    last = _last_line(capsys)
    learner, _ = load_learner(path, which="last")
    assert all(float(p.detach().abs().sum()) == 0 for p in learner.parameters())
    mean, _ = _by_hand(path, steps=0, tasks=4, seed=2, shots=1, query=2)  # 'best', by hand
    script.main(common)
    assert _last_line(capsys)[1] == f"{mean:.4f}"
    assert last[1] == "0.2000"  # all-zero weights: equal logits, argmax class 0, 1 in 5 right


# ---------------------------------------------------------------- a few-shot run's checkpoint


@pytest.fixture(scope="module")
def fewshot_checkpoint(tmp_path_factory) -> Path:
    """Two meta-steps of the few-shot experiment on a folder of 3 classes of grayscale images,
    read at 16x16 on one channel: a data set, root and image shape other than Omniglot's."""
    tmp = tmp_path_factory.mktemp("fewshot")
    args = make(
        fs, dataset="folder", data_root=str(write_folder(tmp / "folder")), image_size=16,
        channels=1, ways=3, iterations=2, meta_batch=2, query=1, eval_query=1, hidden=4,
        inner_steps=1, val_every=1, val_tasks=2, test_tasks=3, eval_inner_steps=1,
        checkpoint_every=1, out_dir=str(tmp / "runs"), run_name="r", track=False, device="cpu",
    )  # fmt: skip
    fs.main(args)
    return tmp / "runs" / "r" / "checkpoint.pt"


def _folder_by_hand(path: Path, root: Path, *, steps: int, tasks: int, seed: int, query: int):
    """The reference: the folder's test split loaded alone at 16x16 gray, sampled directly."""
    learner, recipe = load_learner(path, which="best")
    image = recipe.data.image
    assert (recipe.data.dataset, image.size, image.channels) == ("folder", 16, 1)
    test = load_image_set("folder", root, "test", image_size=16, channels=1)
    drawn = test.sampler(ways=3, shots=1, queries=query).batch(
        tasks, torch.Generator().manual_seed(seed)
    )
    assert drawn[0].query[0].shape == (3 * query, 1, 16, 16)
    acc = learner.evaluate(drawn, steps=steps)[1].double().numpy()
    return acc.mean(), 1.96 * acc.std(ddof=1) / math.sqrt(tasks)


@pytest.mark.parametrize(("steps", "query"), [(0, 1), (2, 2)])
def test_a_fewshot_checkpoint_is_evaluated_on_its_own_data(fewshot_checkpoint, capsys, steps,
                                                           query):  # fmt: skip
    root = Path(load_learner(fewshot_checkpoint)[1].data.root)
    argv = ["--checkpoint", str(fewshot_checkpoint), "--tasks", "7", "--steps", str(steps),
            "--seed", "5", "--query", str(query), "--no-track"]  # fmt: skip
    assert script.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert f"3-way 1-shot, {query} queries" in out[-2]
    assert f"7 tasks of the test classes of folder at {root}, seed 5" in out[-2]
    printed = RESULT.fullmatch(out[-1])
    mean, half = _folder_by_hand(fewshot_checkpoint, root, steps=steps, tasks=7, seed=5,
                                 query=query)  # fmt: skip
    assert printed[1] == f"{mean:.4f}" and printed[2] == f"{half:.4f}"


def test_data_root_overrides_the_recorded_folder(fewshot_checkpoint, tmp_path, capsys) -> None:
    recorded = Path(load_learner(fewshot_checkpoint)[1].data.root)
    moved = Path(shutil.copytree(recorded, tmp_path / "moved"))
    shutil.rmtree(moved / "test" / "emu")  # 2 test classes left: a 3-way task cannot be drawn
    argv = ["--checkpoint", str(fewshot_checkpoint), "--tasks", "3", "--no-track"]
    _refused(capsys, [*argv, "--data-root", str(moved)], "only 2 classes are available")
    _refused(capsys, [*argv, "--data-root", str(tmp_path / "gone")], str(tmp_path / "gone"))
    shutil.copytree(recorded / "test" / "emu", moved / "test" / "emu")
    assert script.main([*argv, "--data-root", str(moved), "--seed", "4"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert f"test classes of folder at {moved}, seed 4" in out[-2]
    mean, _ = _folder_by_hand(fewshot_checkpoint, moved, steps=1, tasks=3, seed=4, query=1)
    assert RESULT.fullmatch(out[-1])[1] == f"{mean:.4f}"


def test_split_is_refused_for_a_data_set_other_than_omniglot(fewshot_checkpoint, capsys):
    argv = ["--checkpoint", str(fewshot_checkpoint), "--no-track", "--split", "alphabet"]
    _refused(capsys, argv, "--split alphabet: folder has one published split")


@pytest.fixture(scope="module")
def lake_checkpoint(tmp_path_factory) -> Path:
    """Two meta-steps of a Proto-MAML run on the alphabet split, tested within alphabets."""
    if not HAS_OMNIGLOT:
        pytest.skip(NO_OMNIGLOT)
    tmp = tmp_path_factory.mktemp("lake")
    args = make(
        om, algorithm="protomaml", ways=4, split="alphabet", eval_protocol="within-alphabet",
        train_tasks="within-alphabet", augment=True, iterations=2, meta_batch=2, query=1,
        eval_query=2, hidden=8, val_every=1, val_tasks=3, test_tasks=4, eval_inner_steps=1,
        data_root=str(DATA), out_dir=str(tmp), track=False, device="cpu",
    )  # fmt: skip
    om.main(args)
    (path,) = tmp.glob("*/checkpoint.pt")
    return path


def test_within_alphabet_is_the_runs_protocol_and_matches_by_hand(lake_checkpoint, capsys):
    from metalearn.data.within_alphabet import within_alphabet_samplers

    argv = ["--checkpoint", str(lake_checkpoint), "--tasks", "9", "--seed", "4", "--no-track"]
    assert script.main(argv) == 0
    printed = _last_line(capsys)
    learner, recipe = load_learner(lake_checkpoint, which="best")
    sampler = within_alphabet_samplers(load_omniglot(recipe.data.root), ways=4, shots=1,
                                       queries=2)["test"]  # fmt: skip
    drawn = sampler.batch(9, torch.Generator().manual_seed(4))
    acc = learner.evaluate(drawn, steps=1)[1].double()
    assert float(printed.group(1)) == pytest.approx(acc.mean().item(), abs=5e-5)
    # --protocol episodic scores MAML's episodic tasks of the same split: other tasks (their
    # means can coincide at 9 tasks of 8 queries), each protocol equal to its own by hand.
    assert script.main([*argv, "--protocol", "episodic"]) == 0
    episodic = _last_line(capsys)
    other = omniglot_samplers(load_omniglot(recipe.data.root), "alphabet", ways=4, shots=1,
                              queries=2)["test"]  # fmt: skip
    tasks = other.batch(9, torch.Generator().manual_seed(4))
    assert not torch.equal(tasks[0].support[0], drawn[0].support[0])
    acc = learner.evaluate(tasks, steps=1)[1].double()
    assert float(episodic.group(1)) == pytest.approx(acc.mean().item(), abs=5e-5)


def test_within_alphabet_needs_the_alphabet_split(checkpoint, capsys) -> None:
    argv = ["--checkpoint", str(checkpoint), "--protocol", "within-alphabet", "--no-track"]
    assert script.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "--protocol within-alphabet draws tasks from one alphabet" in err
    assert len(err.splitlines()) == 1
