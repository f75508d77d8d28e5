"""Tests' shorthands for the experiments' arguments, recipes, learners and checkpoints.

Arguments are given by their flat names (the flags' names), as a user gives them; the rest
goes through the same functions a run uses (`metalearn.runs.experiment`, `metalearn.runs.run`,
`metalearn.runs.recipe`).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from metalearn.algorithms import MetaLearner
from metalearn.checkpoint import save_checkpoint
from metalearn.runs.cli import flatten, unflatten
from metalearn.runs.experiment import make_recipe
from metalearn.runs.recipe import Recipe, build_learner
from metalearn.runs.run import load_samplers
from metalearn.runs.seeding import seed_everything
from tests.conftest import experiment

fs = experiment("fewshot_maml")
om = experiment("omniglot_maml")

__all__ = [
    "checkpoint_of", "fs", "learner_of", "make", "om", "recipe_of", "samplers_of", "seeded_learner",
]  # fmt: skip


def make(experiment: ModuleType, **flat: Any) -> Any:
    """The experiment's `Args` with the named flat values (the rest: its defaults)."""
    return unflatten(experiment.Args, flat)


def recipe_of(experiment: ModuleType, args: Any) -> Recipe:
    """The recipe a run of ``args`` records (resolved first, as the run resolves them)."""
    return make_recipe(experiment.EXPERIMENT, experiment.resolve_args(args))


def learner_of(experiment: ModuleType, args: Any) -> MetaLearner:
    """The learner a run of ``args`` starts from (seeded by its seed)."""
    return seeded_learner(recipe_of(experiment, args))


def seeded_learner(recipe: Recipe) -> MetaLearner:
    """The learner a run of ``recipe`` starts from: seeded by its seed, as the run seeds it."""
    seed_everything(recipe.training.seed)
    return build_learner(recipe, "cpu")


def samplers_of(experiment: ModuleType, args: Any) -> dict:
    """The samplers a run of ``args`` draws its tasks from."""
    return load_samplers(recipe_of(experiment, args), "cpu")


def checkpoint_of(
    path: Path, experiment: ModuleType, args: Any, *, best: bool = True, perturb: bool = True
) -> Path:
    """A checkpoint in a run's format at ``path/run/checkpoint.pt``: its arguments, recipe
    and the weights of its own learner, moved off their initial values so loading shows."""
    args = experiment.resolve_args(args)
    learner = learner_of(experiment, args)
    if perturb:
        with torch.no_grad():
            for p in learner.parameters():
                p.add_(0.01 * torch.randn_like(p))
    state = {k: v.detach().clone() for k, v in learner.state_dict().items()}
    saved = {"args": flatten(args), "recipe": recipe_of(experiment, args).to_dict(),
             "learner": state, "iteration": 2, "best_learner": state if best else None,
             "best_val": 0.5}  # fmt: skip
    return save_checkpoint(path / "run" / "checkpoint.pt", saved)


def main_interrupted(monkeypatch: Any, args: Any, at_step: int = 3) -> None:
    """``om.main(args)`` stopped by Ctrl-C inside its meta-step ``at_step`` (the
    ``KeyboardInterrupt`` is expected and caught); ``om.meta_step`` is restored after."""
    original = om.meta_step
    calls = {"n": 0}

    def interrupted_step(*step_args: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == at_step:
            raise KeyboardInterrupt("simulated Ctrl-C")
        return original(*step_args)

    monkeypatch.setattr(om, "meta_step", interrupted_step)
    try:
        with pytest.raises(KeyboardInterrupt):
            om.main(args)
    finally:
        monkeypatch.setattr(om, "meta_step", original)
