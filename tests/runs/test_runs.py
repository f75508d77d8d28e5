"""Run plumbing: resume merging, checkpoints, seeding, and building exactly what is recorded."""

from __future__ import annotations

import inspect
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from metalearn.algorithms import FOMAML, IMAML, LEARNERS, MAML, MetaLearner, Reptile
from metalearn.algorithms.heads import HeadLearner
from metalearn.algorithms.inner_optimizer import InnerOptimizerLearner
from metalearn.algorithms.registry import complete_arguments, make_learner
from metalearn.checkpoint import HOST, load_checkpoint, save_checkpoint
from metalearn.models import Conv4
from metalearn.runs.experiment import require_at_least_one, require_positive_finite
from metalearn.runs.lifecycle import RunState, UserError, merge_resumed_args
from metalearn.runs.recipe import learner_recipe, resolve_learner_args
from metalearn.runs.seeding import seed_everything

ARGS = {"algorithm": "maml", "ways": 5, "hidden": 8, "vectorize": "auto", "inner_lr": None,
        "inner_steps": None, "cg_damping": None, "outer_lr": None}  # fmt: skip


def test_merge_keeps_the_saved_run_and_names_both_values():
    saved = {"algorithm": "fomaml", "iterations": 10, "seed": 0}
    merged = merge_resumed_args(saved, {"algorithm": None, "iterations": 20, "seed": 0},
                                changeable={"iterations"})  # fmt: skip
    assert merged == {"algorithm": "fomaml", "iterations": 20, "seed": 0}
    with pytest.raises(UserError, match="--seed 7 differs from the resumed run's 0"):
        merge_resumed_args(saved, {"seed": 7}, changeable={"iterations"})


def test_run_state_round_trips_through_a_checkpoint(tmp_path):
    state = RunState("r", iteration=3, best_val=0.5, history=[{"step": 1, "train/loss": 1.0}])
    save_checkpoint(tmp_path / "c.pt", {"args": {}, **state.to_dict()})
    assert RunState.from_dict(load_checkpoint(tmp_path / "c.pt")) == state


def test_a_killed_writers_temporary_file_is_removed_by_the_next_save(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    orphan = tmp_path / f".checkpoint.pt.{HOST}.{dead}.abc123.tmp"  # its writer has exited
    live = tmp_path / f".checkpoint.pt.{HOST}.{os.getpid()}.def456.tmp"  # a live writer's
    elsewhere = tmp_path / f".checkpoint.pt.otherhost.{dead}.ghi789.tmp"  # unknowable: kept
    other = tmp_path / f".other.pt.{HOST}.{dead}.abc123.tmp"  # another target's
    for path in (orphan, live, elsewhere, other):
        path.write_bytes(b"half a checkpoint")
    save_checkpoint(tmp_path / "checkpoint.pt", {"w": torch.ones(2)})
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (live, elsewhere, other, tmp_path / "checkpoint.pt")
    )
    assert torch.equal(load_checkpoint(tmp_path / "checkpoint.pt")["w"], torch.ones(2))


def test_seed_everything_repeats_python_numpy_and_torch():
    def draws():
        return random.random(), np.random.rand(), torch.rand(1).item()  # noqa: NPY002

    seed_everything(3)
    first = draws()
    seed_everything(3)
    assert draws() == first
    seed_everything(4)
    assert draws() != first
    with pytest.raises(ValueError, match="seed=-1 is out of range"):
        seed_everything(-1)


@pytest.mark.parametrize(
    ("algorithm", "cls", "lr", "steps", "damping"),
    [("fomaml", FOMAML, 2.0, 1, None), ("imaml", IMAML, 0.1, 16, 11.0),
     ("reptile", Reptile, 1e-3, 5, None)],
)  # fmt: skip
def test_open_values_come_from_the_constructor_and_are_built_as_resolved(
    algorithm, cls, lr, steps, damping
):
    resolved = resolve_learner_args({**ARGS, "algorithm": algorithm})
    # One source: the learner built with no arguments is the one the flag builds.
    default = cls(Conv4(hidden=8))
    assert (default.inner_lr, default.inner_steps) == (lr, steps)
    assert getattr(default, "cg_damping", None) == damping
    assert (resolved["inner_lr"], resolved["inner_steps"], resolved["cg_damping"]) == (
        lr,
        steps,
        damping,
    )
    learner = make_learner(algorithm, Conv4(hidden=8), learner_recipe(resolved).arguments)
    assert type(learner) is cls and (learner.inner_lr, learner.inner_steps) == (lr, steps)
    # Given values win, and are built exactly (no hidden floor or cap).
    given = learner_recipe(resolve_learner_args({**ARGS, "algorithm": algorithm,
                                                 "inner_lr": 0.3, "inner_steps": 2}))  # fmt: skip
    built = make_learner(algorithm, Conv4(hidden=8), given.arguments)
    assert (built.inner_lr, built.inner_steps) == (0.3, 2)


def test_the_record_names_every_argument_the_learner_takes():
    """Every keyword of the learner's signature (its own and MetaLearner's it passes on) is
    in the record, at its default unless given, and the learner is built with exactly it."""
    for algorithm, cls in LEARNERS.items():
        record = learner_recipe(resolve_learner_args({**ARGS, "algorithm": algorithm}))
        own = inspect.signature(cls.__init__).parameters
        names = {n for n, p in own.items() if n not in ("self", "model") and p.kind in
                 (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}  # fmt: skip
        if any(p.kind is p.VAR_KEYWORD for p in own.values()):
            base = inspect.signature(MetaLearner.__init__).parameters
            names |= {n for n in base if n not in ("self", "model")}
            if issubclass(cls, InnerOptimizerLearner):  # FOMAML, ANIL pass the optimizer's on
                middle = inspect.signature(InnerOptimizerLearner.__init__).parameters
                names |= {n for n, p in middle.items() if p.kind is p.KEYWORD_ONLY}
            if issubclass(cls, HeadLearner):  # the solved heads pass theirs on (transductive)
                middle = inspect.signature(HeadLearner.__init__).parameters
                names |= {n for n, p in middle.items() if p.kind is p.KEYWORD_ONLY}
            if issubclass(cls, MAML):  # FOMAML passes MAML's on (adapt_norm)
                middle = inspect.signature(MAML.__init__).parameters
                names |= {n for n, p in middle.items() if p.kind is p.KEYWORD_ONLY}
        assert set(record.arguments) == names - set(cls.fixed_arguments), algorithm
        assert record.arguments["loss_fn"] == "cross_entropy"


def test_flags_of_another_algorithm_and_unknown_algorithms_are_refused():
    with pytest.raises(ValueError, match="--cg-damping is a setting of imaml; drop it for maml"):
        resolve_learner_args({**ARGS, "cg_damping": 1.0})
    with pytest.raises(ValueError, match="unknown algorithm 'mamI'"):
        resolve_learner_args({**ARGS, "algorithm": "mamI"})
    with pytest.raises(ValueError, match="mamlpp sets its own derivative order"):
        resolve_learner_args({**ARGS, "algorithm": "mamlpp", "first_order": True})
    with pytest.raises(ValueError, match="maml takes no argument rank"):
        complete_arguments("maml", {"rank": 4})


def test_a_nan_validation_is_never_the_best_and_all_nan_has_no_best():
    """`Run.keep_best` on a run's sequence of validations: NaN never replaces (or becomes)
    the best; the test loads the weights of the best finite one; every validation NaN is
    refused in one line; with --ensemble-top-k, NaN never enters the kept best either."""
    import dataclasses

    from torch import nn

    from metalearn.algorithms import MAML
    from metalearn.runs.run import Run
    from tests.helpers.run_helpers import om, recipe_of

    run = Run(om.EXPERIMENT, om.Args())
    recipe = recipe_of(om, om.Args())
    run.recipe = dataclasses.replace(
        recipe, training=dataclasses.replace(recipe.training, ensemble_top_k=3)
    )
    run.state = RunState("r")
    learner = MAML(nn.Linear(2, 2))

    def validated(accuracy: float) -> float:
        best = run.keep_best(learner, accuracy)
        run.state.iteration += 1
        run.state.history.append({"step": run.state.iteration, "val/acc": accuracy})
        return best

    assert np.isnan(validated(float("nan"))) and run.state.best_learner is None
    with pytest.raises(UserError, match="all 1 validations of r were NaN"):
        run.load_best(learner)
    with torch.no_grad():
        learner.model.weight.add_(1.0)
    best_weight = learner.model.weight.detach().clone()
    assert validated(0.3) == 0.3 and run.state.best_iteration == 2
    with torch.no_grad():
        learner.model.weight.add_(1.0)
    assert validated(float("nan")) == 0.3 and validated(0.2) == 0.3
    assert run.state.best_iteration == 2
    assert [(e["iteration"], e["val"]) for e in run.state.top] == [(2, 0.3), (4, 0.2)]
    assert run.state.top[0]["learner"] is run.state.best_learner  # one copy of the weights
    run.load_best(learner)
    assert torch.equal(learner.model.weight, best_weight)


def test_range_checks_name_the_first_bad_flag_and_allow_unset():
    values = {"meta_batch": 4, "fast_batch": 0, "inner_lr": None, "max_kl": 0.01}
    require_at_least_one(values, ("meta_batch", "inner_steps"))  # absent: unset
    with pytest.raises(UserError, match="^--fast-batch 0: must be at least 1$"):
        require_at_least_one(values, ("meta_batch", "fast_batch"))
    require_positive_finite(values, ("inner_lr", "max_kl"))  # None: unset
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(UserError, match=f"^--max-kl {bad}: must be a positive finite"):
            require_positive_finite({**values, "max_kl": bad}, ("inner_lr", "max_kl"))
