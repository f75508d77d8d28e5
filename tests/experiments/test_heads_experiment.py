"""--algorithm protonet | r2d2 | metaoptnet | metaoptnet-lr through experiments/omniglot_maml.py
on the real Omniglot: a tiny run trains, resumes to the uninterrupted run's weights, is evaluated by
metalearn-evaluate to the accuracy the run tested, and is exported by metalearn.deploy; and
--train-ways draws wider training tasks for these heads and is refused for MAML."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from metalearn.checkpoint import load_checkpoint
from metalearn.deploy import export_from_checkpoint, load_learner, load_package
from metalearn.runs.lifecycle import UserError
from metalearn.tools import evaluate as evaluate_script
from tests.conftest import OMNIGLOT, needs_omniglot
from tests.deploy.test_deploy import make_support_folder
from tests.helpers.image_set_fixtures import write_folder
from tests.helpers.run_helpers import fs, make, om, recipe_of, samplers_of

DATA = OMNIGLOT
pytestmark = needs_omniglot
TINY = dict(
    iterations=3, meta_batch=2, query=1, eval_query=2, hidden=8, val_every=1, val_tasks=3,
    test_tasks=4, checkpoint_every=1, data_root=str(DATA), track=False, device="cpu",
)  # fmt: skip
OWN = {
    "protonet": [], "r2d2": ["lam", "scale", "bias"],
    "metaoptnet": ["c_reg", "ridge", "ipm_steps", "scale", "label_smoothing"],
    "metaoptnet-lr": ["weight_decay", "scale"],
}  # fmt: skip


def tiny(tmp_path: Path, **overrides) -> om.Args:
    return make(om, **{**TINY, "out_dir": str(tmp_path), **overrides})


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", list(OWN))
def test_a_head_trains_resumes_evaluates_and_exports(tmp_path, capsys, algorithm):
    straight = om.main(tiny(tmp_path, algorithm=algorithm, run_name="straight"))
    om.main(tiny(tmp_path, algorithm=algorithm, iterations=2, run_name="split"))
    resumed = om.main(tiny(tmp_path, algorithm=algorithm, run_name="split", resume=True))
    a = load_checkpoint(tmp_path / "straight" / "checkpoint.pt")
    b = load_checkpoint(tmp_path / "split" / "checkpoint.pt")
    assert a["learner"].keys() == b["learner"].keys()
    for key in a["learner"]:  # the heads' own scalars (log_lam, log_scale, ...) included
        assert torch.equal(a["learner"][key], b["learner"][key]), key
    assert [r["train/loss"] for r in a["history"]] == [r["train/loss"] for r in b["history"]]
    assert resumed["test/acc"] == straight["test/acc"]
    recorded = a["recipe"]["learner"]
    assert recorded["algorithm"] == algorithm and set(OWN[algorithm]) <= set(recorded["arguments"])
    assert "inner_lr" not in recorded["arguments"] and a["args"]["inner_lr"] is None

    path = tmp_path / "straight" / "checkpoint.pt"
    capsys.readouterr()
    assert evaluate_script.main(["--checkpoint", str(path), "--tasks", "4", "--no-track"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith(f"test/acc: {straight['test/acc']:.4f} ± ")

    folder = make_support_folder(tmp_path, shots=2, ways=5)
    report = export_from_checkpoint(path, folder, tmp_path / "adapted")
    assert report.max_abs_diff < 1e-5 and report.class_names == tuple(f"class{c}" for c in range(5))
    assert load_package(report.path).document["source"]["algorithm"] == algorithm


def test_train_ways_draws_wider_training_tasks_for_the_heads(tmp_path):
    args = tiny(tmp_path, algorithm="protonet", train_ways=10, iterations=1, run_name="wide")
    recipe = recipe_of(om, args)
    assert (recipe.data.ways, recipe.data.train_ways, recipe.model.ways) == (5, 10, 5)
    samplers = samplers_of(om, args)
    assert samplers["train"].ways == 10 and samplers["val"].ways == samplers["test"].ways == 5
    name = om.resolve_args(tiny(tmp_path, algorithm="r2d2", train_ways=10)).tracking.run_name
    assert re.fullmatch(r"r2d2-5w1s-train10w-seed0-[a-z0-9]{8}", name), name
    results = om.main(args)
    saved = load_checkpoint(tmp_path / "wide" / "checkpoint.pt")
    assert saved["recipe"]["data"]["train_ways"] == 10 and 0 <= results["test/acc"] <= 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"algorithm": "maml", "train_ways": 10},
      "--train-ways 10 with --algorithm maml: it adapts the model's 5-way head, so it trains "
      "5-way; drop --train-ways or use an algorithm that sizes its head per task (protonet, "
      "r2d2, metaoptnet, metaoptnet-lr)"),
     ({"algorithm": "protomaml", "train_ways": 10}, "--train-ways 10 with --algorithm protomaml"),
     ({"algorithm": "protonet", "train_ways": 1}, "--train-ways 1: a task needs at least 2"),
     ({"algorithm": "r2d2", "inner_lr": 0.4},
      "r2d2 solves its head per task, with no inner loop; drop --inner-lr"),
     ({"algorithm": "metaoptnet", "inner_steps": 3, "first_order": True},
      "drop --inner-steps, --first-order")],
)  # fmt: skip
def test_refusals_before_anything_runs(tmp_path, overrides, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        om.main(tiny(tmp_path, **overrides))
    assert list(tmp_path.iterdir()) == []


def test_maml_with_train_ways_equal_to_ways_runs_as_before(tmp_path):
    recipe = recipe_of(om, tiny(tmp_path, algorithm="maml", train_ways=5))
    assert recipe.data.train_ways == 5


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", list(OWN))
def test_a_head_learns_above_chance(tmp_path, algorithm):
    """30 meta-steps of a 16-filter conv4, then 50 test tasks of 5-way 1-shot (500 query
    answers; chance is 0.2 with a standard error of 0.018): each head answers at least 0.28,
    the bar tests/experiments/test_omniglot_experiment.py sets the other algorithms
    (measured: ProtoNet 0.47, MetaOptNet 0.32). R2D2 runs 5-way 5-shot with 5 queries
    (R2-D2's reference trains with 1 to 9 shots, 10 examples a class; measured 0.35): its
    penalty acts as N K lam, 250 at 1-shot, on this net's small features, and 30 steps
    leave it at 0.25."""
    shape = {"shots": 5, "query": 5} if algorithm == "r2d2" else {}
    results = om.main(tiny(tmp_path, algorithm=algorithm, iterations=30, hidden=16,
                           val_every=30, test_tasks=50, **shape))  # fmt: skip
    assert results["test/acc"] >= 0.28


@pytest.mark.filterwarnings("ignore:.*published:UserWarning")
def test_fewshot_trains_wider_tasks_on_an_image_folder(tmp_path):
    """experiments/fewshot_maml.py: 3-way training tasks, 2-way validation and test."""
    root = write_folder(tmp_path / "folder")
    args = make(fs, dataset="folder", data_root=str(root), image_size=16, channels=1,
                algorithm="r2d2", ways=2, train_ways=3, query=1, eval_query=1, hidden=4,
                iterations=1, meta_batch=2, val_every=1, val_tasks=2, test_tasks=2,
                checkpoint_every=1, track=False, device="cpu", out_dir=str(tmp_path / "runs"),
                run_name="wide")  # fmt: skip
    samplers = samplers_of(fs, args)
    assert samplers["train"].ways == 3 and samplers["val"].ways == samplers["test"].ways == 2
    results = fs.main(args)
    saved = load_checkpoint(tmp_path / "runs" / "wide" / "checkpoint.pt")
    assert saved["recipe"]["data"]["train_ways"] == 3 and 0 <= results["test/acc"] <= 1


@pytest.mark.slow
def test_r2d2_with_dropout_resumes_and_tests_without_it(tmp_path, capsys):
    """--dropout through the run: recorded in the recipe, the masks drawn from torch's
    generator that the checkpoint keeps (a resumed run is the uninterrupted one, bit for
    bit), and the run's test, metalearn-evaluate and the export all without dropout."""
    common = dict(algorithm="r2d2", backbone="rrnet", hidden=4, dropout=0.3)
    straight = om.main(tiny(tmp_path, **common, run_name="straight"))
    om.main(tiny(tmp_path, **common, iterations=2, run_name="split"))
    om.main(tiny(tmp_path, **common, run_name="split", resume=True))
    a = load_checkpoint(tmp_path / "straight" / "checkpoint.pt")
    b = load_checkpoint(tmp_path / "split" / "checkpoint.pt")
    assert a["recipe"]["model"]["dropout"] == 0.3
    for key in a["learner"]:
        assert torch.equal(a["learner"][key], b["learner"][key]), key
    assert [r["train/loss"] for r in a["history"]] == [r["train/loss"] for r in b["history"]]
    # dropout acts in training: the same run without it trains other weights
    om.main(tiny(tmp_path, **{**common, "dropout": 0.0}, run_name="plain"))
    c = load_checkpoint(tmp_path / "plain" / "checkpoint.pt")
    assert a["history"][0]["train/loss"] != c["history"][0]["train/loss"]

    path = tmp_path / "straight" / "checkpoint.pt"
    capsys.readouterr()
    for _ in range(2):  # the same number each time: no masks at test
        assert evaluate_script.main(["--checkpoint", str(path), "--tasks", "4", "--no-track"]) == 0
        last = capsys.readouterr().out.strip().splitlines()[-1]
        assert last.startswith(f"test/acc: {straight['test/acc']:.4f} ± ")
    folder = make_support_folder(tmp_path, shots=2, ways=5)
    report = export_from_checkpoint(path, folder, tmp_path / "adapted")
    assert report.max_abs_diff < 1e-5
    # a loaded learner is in evaluation mode: its own evaluate draws no masks
    learner, _ = load_learner(path)
    assert not any(m.training for m in learner.modules())
    tasks = samplers_of(om, tiny(tmp_path, **common))["test"].batch(2, torch.Generator())
    first, second = learner.evaluate(tasks)[0], learner.evaluate(tasks)[0]
    assert torch.equal(first, second)
