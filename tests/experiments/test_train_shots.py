"""--train-shots: training tasks with other shots than the validation and test tasks
(MetaOptNet trains 15-shot for its 5-shot test), recorded, resolved from --shots once, and
refused in one line when the data set cannot give it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from metalearn.checkpoint import load_checkpoint
from metalearn.runs.lifecycle import UserError
from metalearn.runs.recipe import read_recipe
from tests.conftest import OMNIGLOT, needs_omniglot
from tests.helpers.image_set_fixtures import write_folder
from tests.helpers.run_helpers import fs, make, om, recipe_of, samplers_of

TINY = dict(
    iterations=1, meta_batch=2, query=1, eval_query=2, hidden=8, val_every=1, val_tasks=2,
    test_tasks=2, checkpoint_every=1, data_root=str(OMNIGLOT), track=False, device="cpu",
)  # fmt: skip


def tiny(tmp_path: Path, **overrides) -> om.Args:
    return make(om, **{**TINY, "out_dir": str(tmp_path), **overrides})


@needs_omniglot
def test_training_tasks_draw_train_shots_and_evaluation_tasks_shots(tmp_path):
    args = tiny(tmp_path, algorithm="maml", shots=1, train_shots=3, run_name="more")
    recipe = recipe_of(om, args)
    assert (recipe.data.shots, recipe.data.train_shots) == (1, 3)
    samplers = samplers_of(om, args)
    assert samplers["train"].shots == 3 and samplers["val"].shots == samplers["test"].shots == 1
    task = samplers["train"].sample(torch.Generator().manual_seed(0))
    assert task.support[0].shape[0] == 5 * 3 and task.query[0].shape[0] == 5 * 1
    name = om.resolve_args(tiny(tmp_path, algorithm="protonet", train_shots=3)).tracking.run_name
    assert re.fullmatch(r"protonet-5w1s-train3s-seed0-[a-z0-9]{8}", name), name
    results = om.main(args)
    saved = load_checkpoint(tmp_path / "more" / "checkpoint.pt")
    assert saved["recipe"]["data"]["train_shots"] == 3 and 0 <= results["test/acc"] <= 1


def test_train_shots_default_to_shots_once(tmp_path):
    recipe = recipe_of(om, tiny(tmp_path, shots=2))
    assert (recipe.data.shots, recipe.data.train_shots) == (2, 2)
    assert read_recipe({"recipe": recipe.to_dict()}).data.train_shots == 2


@pytest.mark.filterwarnings("ignore:.*published:UserWarning")
def test_fewshot_trains_with_more_shots_on_an_image_folder(tmp_path):
    root = write_folder(tmp_path / "folder")
    args = make(fs, dataset="folder", data_root=str(root), image_size=16, channels=1,
                algorithm="protonet", ways=2, shots=1, train_shots=2, query=1, eval_query=1,
                hidden=4, iterations=1, meta_batch=2, val_every=1, val_tasks=2, test_tasks=2,
                checkpoint_every=1, track=False, device="cpu", out_dir=str(tmp_path / "runs"),
                run_name="more")  # fmt: skip
    samplers = samplers_of(fs, args)
    assert samplers["train"].shots == 2 and samplers["val"].shots == samplers["test"].shots == 1
    results = fs.main(args)
    saved = load_checkpoint(tmp_path / "runs" / "more" / "checkpoint.pt")
    assert saved["recipe"]["data"]["train_shots"] == 2 and 0 <= results["test/acc"] <= 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"train_shots": 0}, "--train-shots 0: must be at least 1"),
     ({"train_shots": 19, "query": 2},
      "--train-shots 19 with --query 2 needs 21 examples per class; Omniglot has 20"),
     ({"train_min_shots": 0}, "--train-min-shots 0: must be at least 1"),
     ({"train_min_shots": 3, "train_shots": 2},
      "--train-min-shots 3: must be at most --train-shots 2, the most support examples a "
      "training task draws"),
     ({"train_min_shots": 1, "train_shots": 2, "train_tasks": "within-alphabet",
       "split": "alphabet"},
      "--train-min-shots with --train-tasks within-alphabet: random shots need --train-tasks "
      "episodic")],
)  # fmt: skip
def test_train_shots_the_data_cannot_give_are_refused(tmp_path, overrides, message):
    with pytest.raises(UserError) as info:
        om.resolve_args(tiny(tmp_path, **overrides))
    assert str(info.value) == message
    assert list(tmp_path.iterdir()) == []


@needs_omniglot
@pytest.mark.parametrize(
    "overrides",
    [
        {"backbone": "rrnet", "algorithm": "r2d2", "hidden": 4},
        {"head": "flatten", "algorithm": "reptile"},
    ],
)
def test_omniglot_trains_r2d2s_encoder_and_a_flattened_conv4(tmp_path, overrides):
    """--backbone rrnet and --head flatten on Omniglot: sized for its 28x28 images."""
    args = tiny(tmp_path, run_name="net", **overrides)
    recipe = recipe_of(om, args)
    assert recipe.model.image_size == 28
    results = om.main(args)
    saved = load_checkpoint(tmp_path / "net" / "checkpoint.pt")
    assert saved["recipe"]["model"]["image_size"] == 28 and 0 <= results["test/acc"] <= 1


@needs_omniglot
def test_random_training_shots_are_recorded_drawn_and_trained(tmp_path):
    """--train-min-shots: each training task's support size is drawn in [min, train_shots],
    its queries the rest of train_shots + query; evaluation tasks keep --shots."""
    args = tiny(tmp_path, algorithm="protonet", shots=1, train_shots=4, train_min_shots=2,
                query=1, meta_batch=8, run_name="random")  # fmt: skip
    recipe = recipe_of(om, args)
    assert (recipe.data.train_min_shots, recipe.data.train_shots) == (2, 4)
    samplers = samplers_of(om, args)
    assert samplers["train"].min_shots == 2 and samplers["test"].min_shots is None
    tasks = samplers["train"].batch(8, torch.Generator().manual_seed(0))
    supports = {len(t.support[0]) // 5 for t in tasks}
    assert supports <= {2, 3, 4} and len(supports) > 1
    assert all(len(t.support[0]) + len(t.query[0]) == 5 * 5 for t in tasks)
    name = om.resolve_args(tiny(tmp_path, algorithm="protonet", train_shots=4,
                                train_min_shots=2)).tracking.run_name  # fmt: skip
    assert re.fullmatch(r"protonet-5w1s-train2-4s-seed0-[a-z0-9]{8}", name), name
    results = om.main(args)
    saved = load_checkpoint(tmp_path / "random" / "checkpoint.pt")
    assert saved["recipe"]["data"]["train_min_shots"] == 2 and 0 <= results["test/acc"] <= 1
    assert read_recipe(saved).data.train_min_shots == 2
