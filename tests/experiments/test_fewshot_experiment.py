"""experiments/fewshot_maml.py end to end on every data set, written in its published layout.

Each run is the real experiment (a tiny backbone, two meta-steps, offline W&B read back with
wandb's own reader); its test accuracy is checked against the checkpoint's best weights
rebuilt from the recorded arguments alone (`metalearn.deploy.load_learner`) and evaluated
again on the same test tasks.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import wandb

from metalearn.algorithms import FOMAML, MAML
from metalearn.checkpoint import load_checkpoint
from metalearn.data import load_image_set, load_omniglot, omniglot_samplers
from metalearn.deploy import load_learner
from metalearn.models import Conv4, ResNet12
from metalearn.runs.cli import flatten, replace_flat
from metalearn.runs.evaluation import TEST_SEED, evaluate_tasks
from metalearn.runs.lifecycle import UserError
from metalearn.runs.records import read_offline_run
from metalearn.runs.run import load_samplers as make_samplers
from tests.conftest import HAS_OMNIGLOT, NO_OMNIGLOT, OMNIGLOT, ROOT
from tests.helpers.image_set_fixtures import (
    write_cifar,
    write_cub,
    write_folder,
    write_mini_cache,
    write_mini_csv,
    write_tiered,
)
from tests.helpers.pickle_writers import payloads
from tests.helpers.run_helpers import fs, learner_of, make, samplers_of

# The fixtures hold 2 images per class (CIFAR 3, CUB 2 or 3): 1 shot + 1 query.
TINY = dict(
    iterations=2, meta_batch=2, query=1, eval_query=1, hidden=4, inner_steps=1, val_every=1,
    val_tasks=2, test_tasks=3, eval_inner_steps=1, checkpoint_every=1, track=True,
    wandb_mode="offline", device="cpu",
)  # fmt: skip
# The fixtures hold fewer images per class than published: their loaders warn.
pytestmark = pytest.mark.filterwarnings("ignore:.*published:UserWarning")


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> dict[str, Path]:
    """Every data set's fixture (CIFAR-FS and FC100 read the same CIFAR-100 release)."""
    tmp = tmp_path_factory.mktemp("data")
    cifar = write_cifar(tmp / "cifar")
    tiered, _ = write_tiered(tmp / "tiered", {s: "npz" for s in ("train", "val", "test")})
    return {
        "mini-imagenet": write_mini_csv(tmp / "mini"), "tiered-imagenet": tiered,
        "cifar-fs": cifar, "fc100": cifar, "cub": write_cub(tmp / "cub"),
        "folder": write_folder(tmp / "folder"), "omniglot": OMNIGLOT,
    }  # fmt: skip


# Per data set: what the tiny run changes (small images where the loader decodes any size;
# the folder has 3 classes of grayscale images) and the image shape it trains on.
CASES = {
    "mini-imagenet": ({"image_size": 16}, (3, 16)),
    "tiered-imagenet": ({}, (3, 84)),
    "cifar-fs": ({}, (3, 32)),
    "fc100": ({"backbone": "resnet12", "hidden": 2, "head": "mean"}, (3, 32)),
    "cub": ({"image_size": 16, "augment": True}, (3, 16)),
    "folder": ({"image_size": 16, "channels": 1, "ways": 3}, (1, 16)),
    "omniglot": ({"gradient_checkpointing": True, "chunk_size": 1, "first_order": False}, (1, 28)),
}


@pytest.mark.parametrize("dataset", list(CASES))
def test_two_meta_steps_and_a_test_on_every_data_set(dataset, roots, tmp_path):
    if dataset == "omniglot" and not HAS_OMNIGLOT:
        pytest.skip(NO_OMNIGLOT)
    overrides, (channels, side) = CASES[dataset]
    args = make(fs, **{**TINY, **overrides}, dataset=dataset, data_root=str(roots[dataset]),
                out_dir=str(tmp_path), run_name="r")  # fmt: skip
    results = fs.main(args)
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    wandb.teardown()  # finish() may return before the .wandb file is complete
    record = read_offline_run(run_dir)
    assert record.config["dataset"] == dataset and record.state == "finished"
    assert [r["_step"] for r in record.history if "train/loss" in r] == [1, 2]
    assert record.summary["test/acc"] == pytest.approx(results["test/acc"])
    saved = load_checkpoint(tmp_path / "r" / "checkpoint.pt")["args"]
    assert (saved["channels"], saved["image_size"]) == (channels, side)
    # The recorded arguments alone rebuild the network; its best weights, evaluated again on
    # the same test tasks, give the accuracy the run reported.
    learner, recipe = load_learner(tmp_path / "r" / "checkpoint.pt")
    assert (recipe.data.image.channels, recipe.data.image.size) == (channels, side)
    backbone = {"conv4": Conv4, "resnet12": ResNet12}[overrides.get("backbone", "conv4")]
    assert type(learner.model) is backbone
    # Proto-MAML's own order unless set: first, as meta-dataset's fo-Proto-MAML
    assert learner.first_order == overrides.get("first_order", True)
    assert learner.gradient_checkpointing == overrides.get("gradient_checkpointing", False)
    assert learner.chunk_size == overrides.get("chunk_size", "auto")
    samplers = make_samplers(recipe, "cpu")
    assert (samplers["train"].augment is not None) == overrides.get("augment", False)
    assert samplers["val"].augment is None and samplers["test"].augment is None
    test = samplers["test"]
    task = test.sample(torch.Generator().manual_seed(0))
    assert task.query[0].shape[1:] == (channels, side, side)
    acc, _ = evaluate_tasks(learner, test, TINY["test_tasks"], TINY["eval_inner_steps"],
                            torch.Generator().manual_seed(TEST_SEED), progress=False)  # fmt: skip
    assert acc == pytest.approx(results["test/acc"])


def _same_tasks(one, two, seed: int = 0) -> bool:
    a, b = (s.batch(3, torch.Generator().manual_seed(seed)) for s in (one, two))
    return all(torch.equal(x.support[0], y.support[0]) and torch.equal(x.query[0], y.query[0])
               and torch.equal(x.query[1], y.query[1]) for x, y in zip(a, b))  # fmt: skip


def test_train_draws_training_queries_and_val_test_the_evaluation_ones(roots):
    shape = {"query": 2, "eval_query": 1, "ways": 3, "image_size": 16, "channels": 1}
    args = make(fs, **{**TINY, **shape}, dataset="folder", data_root=str(roots["folder"]))
    samplers = samplers_of(fs, args)
    for split, queries in (("train", 2), ("val", 1), ("test", 1)):
        # The reference: the split loaded alone, at the run's shape, sampled directly.
        alone = load_image_set("folder", roots["folder"], split, image_size=16, channels=1)
        reference = alone.sampler(ways=3, shots=1, queries=queries)
        assert samplers[split].sample(torch.Generator()).query[0].shape == (3 * queries, 1, 16, 16)
        assert _same_tasks(samplers[split], reference)


def test_omniglot_keeps_its_tasks(roots):
    if not HAS_OMNIGLOT:
        pytest.skip(NO_OMNIGLOT)
    args = make(fs, **{**TINY, "query": 1, "eval_query": 3}, dataset="omniglot",
                data_root=str(OMNIGLOT))  # fmt: skip
    samplers = samplers_of(fs, args)
    data = load_omniglot(OMNIGLOT, download=False, progress=False)
    for split, queries in (("train", 1), ("val", 3), ("test", 3)):
        reference = omniglot_samplers(data, "maml", ways=5, shots=1, queries=queries)[split]
        assert _same_tasks(samplers[split], reference, seed=7)


@pytest.mark.parametrize("algorithm", ["protonet", "r2d2", "metaoptnet", "maml", "imaml",
                                       "reptile", "protomaml", "boil"])  # fmt: skip
def test_a_learner_without_an_inner_loop_needs_no_flag_dropped(algorithm):
    """The experiment's open inner-loop values (0.05 and 5) go to learners with a
    gradient-descent inner loop at Omniglot's values only: a head learner runs with no
    learner flag given, and records none; Reptile keeps its own (Adam at 1e-3, 5
    iterations), Proto-MAML meta-dataset's (0.01, 5), BOIL its CIFAR-FS values (0.5, 1)."""
    args = flatten(fs.resolve_args(fs.parse_args(["--algorithm", algorithm,
                                                  "--data-root", str(ROOT)])))  # fmt: skip
    heads = ("protonet", "r2d2", "metaoptnet")
    own = {"reptile": (1e-3, 5), "protomaml": (0.01, 5), "boil": (0.5, 1)}.get(
        algorithm, (0.05, 5))  # fmt: skip
    assert (args["inner_lr"], args["inner_steps"]) == ((None, None) if algorithm in heads else own)
    if algorithm in heads:  # a flag given for the inner loop it lacks is still refused
        with pytest.raises(UserError, match=f"{algorithm} solves its head.*drop --inner-lr"):
            fs.resolve_args(fs.parse_args(["--algorithm", algorithm, "--data-root", str(ROOT),
                                           "--inner-lr", "0.1"]))  # fmt: skip


def test_paper_presets_build_the_papers_network():
    one = fs.resolve_args(fs.parse_args(["--preset", "paper-miniimagenet-5w1s",
                                         "--data-root", str(ROOT)]))  # fmt: skip
    a = flatten(one)
    assert (a["meta_batch"], a["inner_lr"], a["inner_steps"], a["eval_inner_steps"]) == (
        4, 0.05, 5, 10,
    )  # fmt: skip  # cbfinn/maml's update_lr 0.01 on N = 5 times the mean loss
    assert (a["query"], a["iterations"], a["outer_lr"], a["hidden"]) == (15, 60_000, 1e-3, 32)
    assert a["grad_clamp"] == 10.0  # maml.py line 148: tf.clip_by_value(grad, -10, 10)
    assert (a["channels"], a["image_size"], a["head"], a["pool"]) == (3, 84, "flatten", "max")
    # cbfinn/maml's main.py: K + 15 examples per class in training, 2K at test (K queries).
    assert a["eval_query"] == 1
    five = flatten(fs.parse_args(["--preset", "paper-miniimagenet-5w5s"]))
    assert (five["shots"], five["meta_batch"], five["query"], five["eval_query"]) == (5, 2, 15, 5)
    assert fs.parse_args(["--preset", "paper-miniimagenet-5w1s-fo"]).learner.algorithm == "fomaml"
    learner = learner_of(fs, replace_flat(one, device="cpu"))
    assert type(learner) is MAML and not learner.first_order
    # 3->32, then 3 x 32->32 3x3 convs with biases, 4 norms of 32 weights and 32 biases, and
    # a head on the 5x5x32 = 800 flattened features: 896 + 3 * 9248 + 256 + 4005.
    assert sum(p.numel() for p in learner.parameters()) == 32_901
    # fomaml sets its own order: the resolved MAML's first_order (False) is left open
    first = learner_of(fs, replace_flat(one, device="cpu", algorithm="fomaml", first_order=None))
    assert type(first) is FOMAML


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"dataset": "cub"}, "--dataset cub needs --data-root: .* docs/datasets.md"),
     ({"dataset": "cifar-fs", "data_root": "/no/such/dir"}, "--data-root /no/such/dir does not"),
     ({"dataset": "tiered-imagenet", "data_root": ".", "image_size": 32},
      "image_size 32: tiered-imagenet holds 84x84 images"),
     ({"dataset": "cub", "data_root": ".", "channels": 1}, "channels 1: cub gives 3"),
     ({"dataset": "cub", "data_root": ".", "chunk_size": 0}, "--chunk-size 0: must be at least"),
     ({"dataset": "cub", "data_root": ".", "algorithm": "mamlpp", "first_order": True},
      "mamlpp sets its own derivative order .*--first-order-steps.*; drop --first-order"),
     ({"dataset": "cub", "data_root": ".", "algorithm": "reptile", "first_order": True},
      "reptile sets its own derivative order; drop --first-order")],
)  # fmt: skip
def test_bad_values_are_refused_before_anything_runs(tmp_path, overrides, message):
    with pytest.raises(UserError, match=message):
        fs.main(make(fs, **{**TINY, **overrides}, out_dir=str(tmp_path)))
    assert list(tmp_path.iterdir()) == []


def test_missing_data_is_one_line_naming_the_layout(tmp_path):
    (tmp_path / "empty").mkdir()
    cmd = [sys.executable, str(ROOT / "experiments" / "fewshot_maml.py"), "--dataset",
           "mini-imagenet", "--data-root", str(tmp_path / "empty"), "--out-dir",
           str(tmp_path / "runs"), "--no-track"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: ") and "docs/datasets.md" in line and "train.csv" in line


def test_rens_mini_imagenet_pickles_train_and_test(tmp_path):
    """Ren et al.'s archive (the one torchmeta downloads): *-cache-{train,val,test}.pkl."""
    root = write_mini_cache(tmp_path / "ren", validation="val")
    assert sorted(p.name for p in root.iterdir()) == [
        "mini-imagenet-cache-test.pkl", "mini-imagenet-cache-train.pkl",
        "mini-imagenet-cache-val.pkl",
    ]  # fmt: skip
    args = make(fs, **TINY, dataset="mini-imagenet", data_root=str(root), out_dir=str(tmp_path),
                run_name="r")  # fmt: skip
    results = fs.main(args)
    assert 0.0 <= results["test/acc"] <= 1.0
    saved = load_checkpoint(tmp_path / "r" / "checkpoint.pt")["args"]
    assert (saved["channels"], saved["image_size"]) == (3, 84)


def test_a_hostile_data_file_is_one_line_and_runs_nothing(tmp_path):
    root = write_mini_cache(tmp_path / "data", validation="val")
    marker = tmp_path / "marker"
    ((name, payload),) = list(payloads(str(marker), protocol=4).items())[:1]
    (root / "mini-imagenet-cache-train.pkl").write_bytes(payload)
    cmd = [sys.executable, str(ROOT / "experiments" / "fewshot_maml.py"), "--dataset",
           "mini-imagenet", "--data-root", str(root), "--out-dir", str(tmp_path / "runs"),
           "--no-track"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and not marker.exists()
    (line,) = done.stderr.strip().splitlines()
    assert f"mini-imagenet-cache-train.pkl: refusing to unpickle {name}:" in line


def test_defaults_are_the_command_line_without_flags():
    """Args() and the command line with no flags agree on every field (one source)."""
    assert fs.parse_args([]) == fs.Args()


@pytest.mark.parametrize("shots", [1, 5])
def test_mamlpp_presets_are_the_references_mini_imagenet_configs(shots):
    """experiment_config/mini-imagenet_maml++-mini-imagenet_{1,5}_2_0.01_48_5_0.json at
    86964701, as its code reads them (inner rate 0.1: init_inner_loop_learning_rate unread)."""
    args = fs.resolve_args(fs.parse_args([
        "--preset", f"mamlpp-miniimagenet-5w{shots}s", "--data-root", str(ROOT),
    ]))  # fmt: skip
    a = flatten(args)
    assert (a["algorithm"], a["shots"], a["ways"], a["meta_batch"]) == ("mamlpp", shots, 5, 2)
    assert (a["inner_lr"], a["inner_steps"], a["eval_inner_steps"]) == (0.1, 5, 5)
    assert (a["msl_steps"], a["msl_epoch_length"], a["first_order_steps"]) == (7500, 500, 0)
    assert (a["query"], a["eval_query"], a["iterations"], a["outer_lr"]) == (15, 15, 50_000, 1e-3)
    # few_shot_learning_system.py, meta_update: clamp_(-10, 10) when 'imagenet' in
    # dataset_name (mini_imagenet_full_size); experiment_builder.py: the top 5 tested
    assert (a["grad_clamp"], a["ensemble_top_k"]) == (10.0, 5)
    assert (a["hidden"], a["pool"], a["head"], a["activation"]) == (48, "max", "flatten",
                                                                   "leaky_relu")  # fmt: skip
    learner = learner_of(fs, replace_flat(args, device="cpu"))
    # 3->48, 3 x 48->48 3x3 convs with biases, 4 norms, a head on 5x5x48 = 1200 features.
    model = sum(p.numel() for p in learner.model.parameters())
    assert model == 1344 + 3 * 20784 + 4 * 96 + 1200 * 5 + 5
