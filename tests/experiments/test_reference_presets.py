"""The presets of the algorithms' reference commands record those commands' values.

Each expected value below is read off the reference repository named beside it (commits
in docs/algorithms.md), not off the preset: openai/supervised-reptile's README commands,
bertinetto/r2d2's scripts/train/experiments.sh and conf/fewshots.yaml,
jakesnell/prototypical-networks' run_train.py, kjunelee/MetaOptNet's README and train.py,
aravindr93/imaml_dev's examples/README.md."""

from __future__ import annotations

import pytest

from metalearn.algorithms import IMAML, make_learner
from metalearn.checkpoint import load_checkpoint
from metalearn.runs.outer_loop import scheduled_lr
from metalearn.runs.recipe import build_model, read_recipe
from tests.conftest import OMNIGLOT, needs_omniglot
from tests.helpers.run_helpers import fs, make, om, recipe_of

# Reptile: preset -> (--classes, --shots, --train-shots, --inner-batch, --inner-iters,
# --learning-rate, --eval-batch, --meta-iters)
REPTILE = {
    (om, "reptile-5w1s"): (5, 1, 10, 10, 5, 1e-3, 5, 100_000),
    (om, "reptile-5w5s"): (5, 5, 10, 10, 5, 1e-3, 5, 100_000),
    (om, "reptile-20w1s"): (20, 1, 10, 20, 10, 5e-4, 10, 200_000),
    (om, "reptile-20w5s"): (20, 5, 10, 20, 10, 5e-4, 10, 200_000),
    (fs, "reptile-miniimagenet-5w1s"): (5, 1, 15, 10, 8, 1e-3, 5, 100_000),
    (fs, "reptile-miniimagenet-5w5s"): (5, 5, 15, 10, 8, 1e-3, 15, 100_000),
}


def preset(experiment, name: str, *extra: str):
    root = ["--data-root", "."] if experiment is fs else []
    return recipe_of(experiment, experiment.parse_args(["--preset", name, *root, *extra]))


@pytest.mark.parametrize(("experiment", "name"), list(REPTILE))
def test_reptile_presets_are_its_readme_commands(experiment, name):
    ways, shots, train_shots, batch, iters, lr, eval_batch, meta_iters = REPTILE[experiment, name]
    recipe = preset(experiment, name)
    d, t, a = recipe.data, recipe.training, recipe.learner.arguments
    assert recipe.learner.algorithm == "reptile"
    assert (d.ways, d.shots, d.train_shots, d.query) == (ways, shots, train_shots, 1)
    assert a["train_on_query"] is False  # the --train-shots examples are the inner loop's
    # models.py: the last map flattened into the dense layer, 2x2x64 on Omniglot (stride 2,
    # 'same' padding); mini-ImageNet 5x5x32 here (its 'same' max-pool keeps 6x6x32)
    flat = 2 * 2 * 64 if experiment is om else 5 * 5 * 32
    assert (recipe.model.head, build_model(recipe).head.in_features) == ("flatten", flat)
    assert (a["inner_batch"], a["inner_steps"], a["inner_lr"]) == (batch, iters, lr)
    assert (a["inner_optimizer"], a["inner_beta1"], a["inner_state"]) == ("adam", 0.0, "carried")
    # models.py lines 27-30: minimize() of the per-example losses, which tf.gradients sums;
    # --learning-rate is Adam's step on that sum
    assert a["inner_loss"] == "sum"
    assert (a["eval_inner_batch"], t.eval_inner_steps, a["transductive"]) == (eval_batch, 50,
                                                                              False)  # fmt: skip
    assert (t.meta_batch, t.iterations, t.outer_lr, a["anneal"]) == (5, meta_iters, 1.0, True)
    assert t.test_tasks == 10_000  # --eval-samples


def test_reptile_cpu_preset_is_the_5w1s_recipe_shorter():
    full, cpu = preset(om, "reptile-5w1s"), preset(om, "reptile-cpu")
    assert cpu.learner == full.learner and cpu.data == full.data
    assert (cpu.training.iterations, cpu.training.meta_batch) == (1000, 5)


@pytest.mark.parametrize(
    ("experiment", "name", "train_ways", "episode", "scale", "drop"),
    [(om, "r2d2-5w-paper", 60, 600, 10.0, 0.0), (om, "r2d2-20w-paper", 60, 600, 10.0, 0.0),
     (fs, "r2d2-miniimagenet", 16, 240, 1e-4, 0.1), (fs, "r2d2-cifarfs", 20, 240, 10.0, 0.4)],
)  # fmt: skip
def test_r2d2_presets_are_its_scripts(experiment, name, train_ways, episode, scale, drop):
    recipe = preset(experiment, name)
    d, t, a = recipe.data, recipe.training, recipe.learner.arguments
    # RRNet's encoder: model.out_dim 1536 + 2048 (Omniglot), 31104 + 41472 (mini-ImageNet),
    # 3456 + 4608 (cifar100, i.e. CIFAR-FS); --model.drop 0 (Omniglot), 0.1, 0.4
    features = {28: 1536 + 2048, 84: 31104 + 41472, 32: 3456 + 4608}[d.image.size]
    model = build_model(recipe)
    assert (recipe.model.backbone, model.head.in_features) == ("rrnet", features)
    assert (recipe.model.dropout, model.features.dropout) == (drop, drop)
    assert (a["ridge_form"], a["lam"], a["learn_lambda"], a["scale"]) == ("rrnet", 50.0, False,
                                                                          scale)  # fmt: skip
    # data.way, data.batch_size 600 (Omniglot) or 240 (the others) examples an episode,
    # the shots drawn from range(data.shot_min 1, data.shot_max 10), tested at 5
    assert (d.train_ways, d.train_ways * (d.train_shots + d.query)) == (train_ways, episode)
    assert (d.train_min_shots, d.train_shots, d.shots) == (1, 9, 5)
    assert (t.outer_optimizer, t.outer_lr, t.lr_schedule) == ("adam", 5e-3, "step")
    assert (t.step_size, t.gamma, t.schedule_every, t.meta_batch) == (20, 0.5, 100, 1)
    learner = make_learner("r2d2", build_model(recipe), a)
    assert float(learner.scale.detach()) == pytest.approx(scale)


@pytest.mark.parametrize("name", ["protonet-5w-paper", "protonet-20w-paper"])
def test_protonet_presets_are_run_train_defaults(name):
    recipe = preset(om, name)
    d, t = recipe.data, recipe.training
    assert recipe.learner.algorithm == "protonet"
    assert (d.train_ways, d.shots, d.query, d.eval_query) == (60, 5, 5, 15)
    assert (t.outer_optimizer, t.outer_lr, t.weight_decay) == ("adam", 1e-3, 0.0)
    assert (t.lr_schedule, t.step_size, t.gamma, t.schedule_every) == ("step", 20, 0.5, 100)


def test_metaoptnet_preset_is_its_svm_command():
    recipe = preset(fs, "metaoptnet-miniimagenet")
    d, t, a, m = recipe.data, recipe.training, recipe.learner.arguments, recipe.model
    assert (recipe.learner.algorithm, m.backbone, m.hidden) == ("metaoptnet", "resnet12", 64)
    assert (a["c_reg"], a["ipm_steps"], a["label_smoothing"]) == (0.1, 15, 0.1)  # --eps 0.1
    assert (d.query, t.meta_batch, t.val_tasks) == (6, 8, 2000)  # --train-query, episodes
    # --train-shot 15 (README's command, train.py's default), --val-shot 5, --val-query 15
    assert (d.train_shots, d.shots, d.eval_query) == (15, 5, 15)
    assert (t.outer_optimizer, t.outer_lr, t.outer_momentum, t.nesterov, t.weight_decay) == (
        "sgd", 0.1, 0.9, True, 5e-4)  # fmt: skip
    assert t.iterations == 60 * 1000  # --num-epoch 60 of episodes_per_batch * 1000 episodes
    # train.py: LambdaLR(lambda e: 1.0 if e < 20 else (0.06 if e < 40 else 0.012 if e < 50
    # else 0.0024)), stepped at the start of epochs 1..60
    lam = lambda e: 1.0 if e < 20 else (0.06 if e < 40 else 0.012 if e < 50 else 0.0024)  # noqa: E731
    expected = [0.1 * lam(epoch) for epoch in range(1, 61)]
    assert [scheduled_lr(t, 1000 * k) for k in range(60)] == pytest.approx(expected, rel=1e-15)
    assert scheduled_lr(t, 1000 * 19 - 1) == 0.1 and scheduled_lr(t, 1000 * 19) == 0.1 * 0.06


@pytest.mark.parametrize(("name", "meta_steps"), [("imaml-5w1s", 500), ("imaml-5w1s-gpu", 20_000)])
def test_imaml_presets_are_its_command_and_a_cpu_run(name, meta_steps):
    """examples/README.md line 12 (--inner_lr 1e-1 --outer_lr 1e-3 --n_steps 16 --meta_steps
    500 --task_mb_size 32 --lam 2.0 --cg_steps 5), line 14 (replicating: meta_steps 20000),
    line 17 (measure_accuracy.py --num_tasks 600 --n_steps 16 --lam 0.0 --inner_lr 1e-1);
    implicit_maml/dataset.py lines 147-148 (num_inst support and query instances a class)."""
    recipe = preset(om, name)
    d, a, t = recipe.data, recipe.learner.arguments, recipe.training
    assert (d.ways, d.shots, d.query, d.eval_query) == (5, 1, 1, 1)
    assert (a["inner_lr"], a["inner_steps"], a["lam"], a["cg_steps"]) == (0.1, 16, 2.0, 5)
    assert a["eval_lam"] == 0.0  # tested without the proximal term, at the same rate
    assert (t.meta_batch, t.outer_lr, t.eval_inner_steps, t.test_tasks) == (32, 1e-3, 16, 600)
    assert t.iterations == meta_steps
    assert preset(om, "imaml-cpu").learner.arguments["inner_steps"] == 5


@pytest.mark.parametrize(("name", "shots"), [("protomaml-5w1s", 1), ("protomaml-5w5s", 5)])
def test_protomaml_presets_are_meta_datasets_gin_files(name, shots):
    """google-research/meta-dataset's meta_dataset/learn/gin/: learners/learner_config.gin
    lines 15-18 (learning_rate 1e-4, decay_every 5000, decay_rate 0.5),
    learners/maml_init_with_proto_config.gin lines 3, 7, 9-16 (decay_learning_rate True,
    weight_decay 1e-4, the learner), setups/trainer_config.gin lines 1, 3, 5 (75,000
    updates, 600 evaluation episodes, validation every 500), setups/fixed_way_and_shot.gin
    line 3 (15 queries); its weight decay a Keras L2 on the kernels, 1e-4 ||w||^2, whose
    gradient is torch's 2e-4 w on the weights alone."""
    recipe = preset(om, name)
    d, t, a = recipe.data, recipe.training, recipe.learner.arguments
    assert recipe.learner.algorithm == "protomaml"
    learner = (a["inner_lr"], a["inner_steps"], a["first_order"], a["adapt_norm"])
    assert learner == (0.01, 5, True, False)
    assert a["transductive"] is False  # Learner.transductive_batch_norm = False
    assert (d.ways, d.shots, d.query, d.eval_query) == (5, shots, 15, 15)
    assert (t.outer_optimizer, t.outer_lr, t.meta_batch, t.iterations) == ("adam", 1e-4, 1, 75_000)
    assert (t.weight_decay, t.weight_decay_on) == (2e-4, "weights")
    # exponential_decay(1e-4, global_step, 5000, 0.5, staircase=True) at each update
    for step in (0, 4999, 5000, 9999, 10_000, 74_999):
        assert scheduled_lr(t, step) == pytest.approx(1e-4 * 0.5 ** (step // 5000), rel=1e-15)
    assert (t.eval_inner_steps, t.val_every, t.val_tasks, t.test_tasks) == (5, 500, 600, 600)
    assert (recipe.model.pool, recipe.model.hidden) == ("max", 64)  # four_layer_convnet


def _captured_learners(monkeypatch) -> list:
    """The learners the Omniglot experiment builds, as it builds them."""
    built, build = [], om.make_learner
    monkeypatch.setattr(om, "make_learner", lambda *a: built.append(build(*a)) or built[-1])
    return built


@needs_omniglot
def test_the_imaml_replication_preset_runs_two_steps_on_the_cpu(tmp_path, monkeypatch):
    """imaml-5w1s-gpu end to end at a tiny size (2 meta-steps, 8 filters, few evaluation
    tasks): the learner that trains and tests is the recorded one, its evaluation the
    reference's plain gradient descent (eval_lam 0; the learner's evaluate against
    measure_accuracy.py written out: tests/algorithms/test_imaml_reptile.py)."""
    built = _captured_learners(monkeypatch)
    argv = ["--preset", "imaml-5w1s-gpu", "--iterations", "2", "--hidden", "8",
            "--val-tasks", "2", "--test-tasks", "3", "--data-root", str(OMNIGLOT), "--no-track",
            "--out-dir", str(tmp_path), "--run-name", "r", "--device", "cpu"]  # fmt: skip
    results = om.main(om.parse_args(argv))
    (learner,) = built
    assert type(learner) is IMAML
    settings = (learner.eval_lam, learner.lam, learner.inner_steps, learner.cg_steps)
    assert settings == (0.0, 2.0, 16, 5)
    recipe = read_recipe(load_checkpoint(tmp_path / "r" / "checkpoint.pt"))
    assert recipe.learner.arguments["eval_lam"] == 0.0
    assert (recipe.training.iterations, recipe.training.meta_batch) == (2, 32)
    assert (recipe.data.query, recipe.data.eval_query, recipe.training.eval_inner_steps) == (
        1, 1, 16)  # fmt: skip
    assert 0.0 <= results["test/acc"] <= 1.0


def test_the_cpu_preset_names_the_proto_maml_its_result_was_measured_with():
    """The default run (no flags) trains the Proto-MAML docs/benchmarks.md measured (0.4, 1
    step, second order, norm layers adapted); its defaults are meta-dataset's
    (learn/gin/learners/maml_init_with_proto_config.gin: alpha 0.01, num_update_steps 5,
    first_order True, adapt_batch_norm False), which Proto-MAML's arguments without a preset
    hold."""
    measured = {"inner_lr": 0.4, "inner_steps": 1, "first_order": False, "adapt_norm": True}
    for argv in ([], ["--preset", "cpu"], ["--algorithm", "protomaml"]):
        recipe = recipe_of(om, om.parse_args(argv))
        assert recipe.learner.algorithm == "protomaml"
        assert {k: recipe.learner.arguments[k] for k in measured} == measured
    reference = {"inner_lr": 0.01, "inner_steps": 5, "first_order": True, "adapt_norm": False}
    recipe = recipe_of(om, make(om, algorithm="protomaml"))
    assert {k: recipe.learner.arguments[k] for k in reference} == reference


@pytest.mark.parametrize("algorithm", ["maml", "anil", "protonet", "boil"])
def test_another_algorithm_without_a_preset_trains_at_its_own_defaults(algorithm):
    """The cpu preset's learner values are Proto-MAML's: naming another algorithm leaves
    them out, so its constructor's defaults stand (and a learner without an inner loop is
    not handed an inner rate)."""
    for argv in (["--algorithm", algorithm], [f"--algorithm={algorithm}", "--preset", "cpu"]):
        recipe = recipe_of(om, om.parse_args(argv))
        own = make_learner(algorithm, build_model(recipe), {})
        for name in ("inner_lr", "inner_steps", "first_order", "adapt_norm"):
            if name in recipe.learner.arguments:
                assert recipe.learner.arguments[name] == getattr(own, name), name


@pytest.mark.parametrize(("flags", "first_order"), [
    (["--first-order", "True"], True), (["--first-order", "False"], False),
    (["--first-order"], True), (["--no-first-order"], False), (["--first-order=False"], False),
    ([], True),
])  # fmt: skip
def test_first_order_is_a_flag_with_both_values(flags, first_order):
    """Proto-MAML's default is first order, so second order must be writable: --first-order
    takes True or False (alone: True; --no-first-order: False); left open, the learner's."""
    recipe = preset(fs, "cpu", "--algorithm", "protomaml", *flags)
    assert recipe.learner.arguments["first_order"] is first_order
    maml = preset(fs, "cpu", "--algorithm", "maml", *flags)
    assert maml.learner.arguments["first_order"] is (first_order and bool(flags))
