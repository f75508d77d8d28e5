"""Checkpoints written before runs carried a recipe still rebuild, evaluate, export and
resume. The files in tests/fixtures/records/ were written by the experiments of commit 68e375d
(flat ``args``, no ``recipe``): two Omniglot runs (MAML and Reptile, 4 filters, 2 steps) and
a few-shot run on the image folder beside them (3-way, 16 px grayscale). Each holds the test
accuracy that code measured, which its rebuilt learner must reproduce exactly."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from metalearn.algorithms import MetaOptNet, MetaOptNetLR, complete_arguments
from metalearn.data import ImageFormat
from metalearn.deploy import export_from_checkpoint, load_package
from metalearn.runs.lifecycle import UserError
from metalearn.runs.recipe import build_learner, read_recipe
from metalearn.tools import evaluate
from tests.conftest import HAS_OMNIGLOT, NO_OMNIGLOT, OMNIGLOT, ROOT, needs_omniglot
from tests.deploy.test_deploy import make_support_folder
from tests.helpers.run_helpers import fs, om

RECORDS = ROOT / "tests" / "fixtures" / "records"
DATA = OMNIGLOT
RESULT = re.compile(r"test/acc: (\d\.\d{4}) ± ")


def saved(name: str) -> dict:
    return torch.load(RECORDS / f"{name}.ckpt", weights_only=True)


def test_old_records_have_no_recipe_and_read_as_one():
    omniglot, reptile, folder = (saved(n) for n in ("omniglot-maml", "omniglot-reptile",
                                                    "folder-maml"))  # fmt: skip
    assert "recipe" not in omniglot and "dataset" not in omniglot["args"]
    recipe = read_recipe(omniglot)
    assert (recipe.experiment, recipe.data.dataset, recipe.data.split) == (
        "omniglot_maml", "omniglot", "maml",
    )  # fmt: skip
    assert recipe.data.image == ImageFormat(28, 1, invert=True)
    assert (recipe.model.backbone, recipe.model.pool, recipe.model.head) == ("conv4", "stride",
                                                                             "mean")  # fmt: skip
    assert recipe.learner.arguments["inner_lr"] == 0.4
    # Reptile's outer step was constant then; the record says so, so a resume keeps it.
    assert read_recipe(reptile).learner.arguments["anneal"] is False
    recipe = read_recipe(folder)
    assert (recipe.experiment, recipe.data.dataset) == ("fewshot_maml", "folder")
    assert recipe.data.image == ImageFormat(16, 1)
    assert (recipe.model.pool, recipe.model.head, recipe.model.image_size) == ("max", "flatten", 16)


@pytest.mark.parametrize("name", ["omniglot-maml", "omniglot-reptile", "folder-maml"])
def test_evaluate_reproduces_the_test_accuracy_the_old_code_measured(name, capsys):
    if name.startswith("omniglot") and not HAS_OMNIGLOT:
        pytest.skip(NO_OMNIGLOT)
    record = saved(name)
    argv = ["--checkpoint", str(RECORDS / f"{name}.ckpt"), "--no-track",
            "--tasks", str(record["args"]["test_tasks"])]  # fmt: skip
    if name == "folder-maml":
        argv += ["--data-root", str(RECORDS / "folder")]  # the recorded folder was elsewhere
    assert evaluate.main(argv) == 0
    printed = RESULT.match(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed[1] == f"{record['results']['test/acc']:.4f}"


@needs_omniglot
def test_an_old_checkpoint_exports(tmp_path):
    report = export_from_checkpoint(RECORDS / "omniglot-maml.ckpt", make_support_folder(tmp_path),
                                    tmp_path / "old")  # fmt: skip
    image = load_package(report.path).document["image"]
    assert (image["size"], image["channels"], image["invert"]) == (28, 1, True)
    assert report.max_abs_diff <= 1e-5


@needs_omniglot
def test_an_old_run_resumes_and_then_carries_its_recipe(tmp_path):
    (tmp_path / "omniglot-maml").mkdir()
    shutil.copy(RECORDS / "omniglot-maml.ckpt", tmp_path / "omniglot-maml" / "checkpoint.pt")
    args = om.parse_args(["--resume", "--run-name", "omniglot-maml", "--out-dir", str(tmp_path),
                          "--iterations", "3", "--data-root", str(DATA)])  # fmt: skip
    om.main(args)
    resumed = torch.load(tmp_path / "omniglot-maml" / "checkpoint.pt", weights_only=True)
    assert resumed["iteration"] == 3 and len(resumed["history"]) == 3
    recipe, old = read_recipe(resumed), read_recipe(saved("omniglot-maml"))
    assert "recipe" in resumed and recipe.training.iterations == 3
    assert (recipe.learner, recipe.model, recipe.experiment) == (old.learner, old.model,
                                                                 old.experiment)  # fmt: skip


def test_another_experiments_checkpoint_is_refused_in_one_line(tmp_path):
    (tmp_path / "r").mkdir()
    shutil.copy(RECORDS / "omniglot-maml.ckpt", tmp_path / "r" / "checkpoint.pt")
    with pytest.raises(UserError, match="is a run of experiments/omniglot_maml.py, not of "
                                        "experiments/fewshot_maml.py") as err:  # fmt: skip
        fs.main(fs.parse_args(["--resume", "--run-name", "r", "--out-dir", str(tmp_path),
                               "--dataset", "omniglot"]))  # fmt: skip
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("name", "value", "problem"),
    [("image_size", "abc", "'abc' is not a whole number"),
     ("image_size", 100_000, "100000 is not in [1, 1024]"),
     ("hidden", 2.5, "2.5 is not a whole number"), ("augment", "yes", "'yes' is not true or false"),
     ("lr_milestones", [10, "x"], "[10, 'x'] is not a list of whole numbers")],
)  # fmt: skip
def test_an_old_records_argument_of_the_wrong_type_is_named(name, value, problem):
    """A record without a recipe is read from its flat arguments: each is checked as the
    recipe's field it becomes, named as the checkpoint's argument."""
    record = saved("folder-maml")
    record["args"][name] = value
    with pytest.raises(ValueError) as err:
        read_recipe(record)
    assert str(err.value) == (f"the checkpoint's argument {name}: {problem}; the checkpoint was "
                              "edited or damaged: use the one its run wrote")  # fmt: skip


@needs_omniglot
def test_a_flag_the_old_record_predates_is_refused_on_resume_not_dropped(tmp_path):
    (tmp_path / "omniglot-maml").mkdir()
    shutil.copy(RECORDS / "omniglot-maml.ckpt", tmp_path / "omniglot-maml" / "checkpoint.pt")
    args = om.parse_args(["--resume", "--run-name", "omniglot-maml", "--out-dir", str(tmp_path),
                          "--iterations", "3", "--data-root", str(DATA),
                          "--inner-optimizer", "adam"])  # fmt: skip
    with pytest.raises(UserError, match="--inner-optimizer adam differs from the resumed run's "
                                        "default") as err:  # fmt: skip
        om.main(args)
    assert "\n" not in str(err.value)


# The learner arguments every `metaoptnet` run recorded while it was the logistic-regression
# head (learner_arguments("metaoptnet") before the SVM took the name).
LOGISTIC_METAOPTNET = {
    "weight_decay": 1.0, "scale": 1.0, "newton_steps": 30, "cg_steps": 200, "tol": None,
    "cg_tol": None, "head": "head", "loss_fn": "cross_entropy", "vectorize": "auto",
    "on_nonfinite": "raise", "chunk_size": "auto",
}  # fmt: skip


def test_a_metaoptnet_record_of_the_logistic_head_reads_as_metaoptnet_lr():
    """``metaoptnet`` names the SVM head now; a recipe written when it named the logistic
    head rebuilds that head (`MetaOptNetLR`), holding the recorded state; one written since
    stays the SVM."""
    recipe = read_recipe(saved("folder-maml")).to_dict()
    old = {**recipe, "learner": {"algorithm": "metaoptnet", "arguments": LOGISTIC_METAOPTNET}}
    rebuilt = read_recipe({"recipe": old})
    assert rebuilt.learner.algorithm == "metaoptnet-lr"
    assert dict(rebuilt.learner.arguments) == LOGISTIC_METAOPTNET
    learner = build_learner(rebuilt)
    assert type(learner) is MetaOptNetLR
    assert "log_scale" in learner.state_dict()  # the parameter a logistic run saved
    svm = {**recipe, "learner": {"algorithm": "metaoptnet",
                                 "arguments": complete_arguments("metaoptnet", {})}}  # fmt: skip
    assert type(build_learner(read_recipe({"recipe": svm}))) is MetaOptNet


# The learner arguments every `reptile` and `r2d2` run recorded before their reference
# recipes became the defaults (learner_arguments(...) then).
PLAIN_REPTILE = {
    "inner_lr": 0.4, "inner_steps": 5, "train_on_query": False, "anneal": True,
    "adapt_keys": None, "loss_fn": "cross_entropy", "vectorize": "auto",
    "gradient_checkpointing": False, "on_nonfinite": "raise", "chunk_size": "auto",
}  # fmt: skip
PLAIN_R2D2 = {
    "lam": 1.0, "scale": 10.0, "bias": 0.0, "head": "head", "loss_fn": "cross_entropy",
    "vectorize": "auto", "on_nonfinite": "raise", "chunk_size": "auto",
}  # fmt: skip


def test_reptile_and_r2d2_records_before_their_reference_recipes_rebuild_what_they_ran():
    """A recipe written before Reptile's inner Adam and mini-batches reads as full-batch
    gradient descent scoring the query set as one batch; one written before R2D2's reference
    head reads as the plain head with lambda learned (the state it saved loads). Flat records
    (no recipe) likewise."""
    recipe = read_recipe(saved("folder-maml")).to_dict()
    old = {"algorithm": "reptile", "arguments": PLAIN_REPTILE}
    reptile = read_recipe({"recipe": {**recipe, "learner": old}})
    learner = build_learner(reptile)
    assert (learner.inner_optimizer, learner.inner_batch, learner.eval_inner_batch,
            learner.transductive, learner.inner_lr) == ("sgd", None, None, True, 0.4)  # fmt: skip
    assert learner.inner_loss == "mean"
    flat = read_recipe(saved("omniglot-reptile")).learner.arguments
    assert (flat["inner_optimizer"], flat["inner_batch"], flat["transductive"]) == (
        "sgd", None, True)  # fmt: skip
    assert flat["inner_loss"] == "mean"
    # written with the inner Adam on mini-batches, before inner_loss (its mean): the mean
    adam = {k: v for k, v in complete_arguments("reptile", {}).items() if k != "inner_loss"}
    before_sum = read_recipe({"recipe": {**recipe, "learner": {"algorithm": "reptile",
                                                               "arguments": adam}}})  # fmt: skip
    assert build_learner(before_sum).inner_loss == "mean"
    today = {"algorithm": "reptile", "arguments": complete_arguments("reptile", {})}
    assert build_learner(read_recipe({"recipe": {**recipe, "learner": today}})).inner_loss == (
        "sum"
    )
    r2d2 = read_recipe(
        {"recipe": {**recipe, "learner": {"algorithm": "r2d2", "arguments": PLAIN_R2D2}}}
    )
    learner = build_learner(r2d2)
    assert (learner.ridge_form, float(learner.log_lam.detach().exp())) == ("plain", 1.0)
    assert {"log_lam", "log_scale", "bias"} <= {n for n, _ in learner.named_parameters()}
    learner.load_state_dict(learner.state_dict())  # the keys an old run saved
    today = {"algorithm": "r2d2", "arguments": complete_arguments("r2d2", {})}
    assert build_learner(read_recipe({"recipe": {**recipe, "learner": today}})).ridge_form == (
        "rrnet"
    )  # a record written today: the reference's head


def test_a_record_from_before_adapt_norm_adapts_the_norm_layers_as_it_ran():
    """MAML adapted its batch-norm weights in the inner loop until ``adapt_norm`` (default
    False, as the references) existed: a record without the argument, flat or recipe, reads
    as ``adapt_norm=True``, and MAML++'s as moving its loss weights every meta-step
    (``msl_epoch_length=1``); one written since keeps what it holds."""
    flat = read_recipe(saved("omniglot-maml"))
    assert flat.learner.arguments["adapt_norm"] is True
    assert build_learner(flat).adapt_keys is None  # every parameter adapted, as it ran
    recipe = read_recipe(saved("folder-maml")).to_dict()
    for algorithm, added in (("maml", {"adapt_norm": True}), ("metasgd", {"adapt_norm": True}),
                             ("mamlpp", {"adapt_norm": True, "msl_epoch_length": 1}),
                             ("anil", {})):  # fmt: skip
        arguments = {k: v for k, v in complete_arguments(algorithm, {}).items()
                     if k not in ("adapt_norm", "msl_epoch_length")}  # fmt: skip
        old = {**recipe, "learner": {"algorithm": algorithm, "arguments": arguments}}
        assert dict(read_recipe({"recipe": old}).learner.arguments) == {**arguments, **added}
        new = {**recipe, "learner": {"algorithm": algorithm,
                                     "arguments": complete_arguments(algorithm, {})}}  # fmt: skip
        assert read_recipe({"recipe": new}).learner.arguments == complete_arguments(algorithm, {})
    assert complete_arguments("maml", {})["adapt_norm"] is False


def test_a_proto_maml_record_from_before_the_reference_defaults_reads_as_it_ran():
    """Proto-MAML trained at 0.4, 1 step, second order, every weight adapted until its
    defaults became meta-dataset's (0.01, 5 steps, first order, norm layers held): a flat
    record that left them open (``--first-order`` a switch, off) and a recipe without
    ``adapt_norm`` read as the former; one written since keeps what it holds."""
    args = {k: v for k, v in saved("omniglot-maml")["args"].items()
            if k not in ("inner_lr", "inner_steps")}  # fmt: skip
    for first_order in ({}, {"first_order": False}):
        flat = read_recipe({"args": {**args, "algorithm": "protomaml", **first_order}})
        arguments = flat.learner.arguments
        assert (arguments["inner_lr"], arguments["inner_steps"]) == (0.4, 1)
        assert (arguments["first_order"], arguments["adapt_norm"]) == (False, True)
        assert build_learner(flat).adapt_keys is None  # every parameter adapted, as it ran
    recipe = read_recipe(saved("folder-maml")).to_dict()
    before = {**complete_arguments("protomaml", {}), "inner_lr": 0.4, "inner_steps": 1,
              "first_order": False}  # fmt: skip
    before.pop("adapt_norm")
    old = {**recipe, "learner": {"algorithm": "protomaml", "arguments": before}}
    assert dict(read_recipe({"recipe": old}).learner.arguments) == {**before, "adapt_norm": True}
    today = complete_arguments("protomaml", {})
    new = {**recipe, "learner": {"algorithm": "protomaml", "arguments": today}}
    assert read_recipe({"recipe": new}).learner.arguments == today
    assert (today["inner_lr"], today["inner_steps"], today["first_order"],
            today["adapt_norm"]) == (0.01, 5, True, False)  # fmt: skip


def test_an_imaml_record_from_before_the_negative_curvature_policy_reads_as_raise():
    """iMAML's CG raised at non-positive curvature until ``cg_negative_curvature`` (default
    "continue", the reference's CG) existed: a record without it, recipe or flat, reads as
    "raise" and builds that learner; one written since keeps what it holds."""
    recipe = read_recipe(saved("folder-maml")).to_dict()
    today = complete_arguments("imaml", {})
    before = {k: v for k, v in today.items() if k != "cg_negative_curvature"}
    old = read_recipe({"recipe": {**recipe, "learner": {"algorithm": "imaml",
                                                        "arguments": before}}})  # fmt: skip
    assert old.learner.arguments["cg_negative_curvature"] == "raise"
    assert build_learner(old).cg_negative_curvature == "raise"
    flat = read_recipe({"args": {**saved("omniglot-maml")["args"], "algorithm": "imaml"}})
    assert flat.learner.arguments["cg_negative_curvature"] == "raise"
    new = read_recipe({"recipe": {**recipe, "learner": {"algorithm": "imaml",
                                                        "arguments": today}}})  # fmt: skip
    assert new.learner.arguments == today and today["cg_negative_curvature"] == "continue"
