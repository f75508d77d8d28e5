"""MAML++'s test ensemble written out, for the tests that check a run's ensemble test: the
run's test tasks drawn as its test draws them, and the reference's combination of the kept
models' query logits (HowToTrainYourMAMLPytorch, experiment_builder.py,
``evaluated_test_set_using_the_best_models``: ``np.mean`` over models, ``np.argmax`` over
classes)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from metalearn.runs.evaluation import TEST_SEED
from metalearn.runs.recipe import Recipe
from metalearn.runs.run import load_samplers
from metalearn.task import Task


def run_test_tasks(recipe: Recipe) -> list[Task]:
    """The run's test tasks: ``test_tasks`` of them from the test seed, on the CPU."""
    sampler = load_samplers(recipe, "cpu")["test"]
    gen = torch.Generator().manual_seed(TEST_SEED)
    classes, examples = sampler.sample_indices(gen, recipe.training.test_tasks)
    return sampler.tasks_from_indices(classes, examples)


def ensemble_task_accuracies(per_model: Sequence[Sequence[np.ndarray]], tasks: Sequence[Task]
                             ) -> np.ndarray:  # fmt: skip
    """Each task's query accuracy, ``[T]``, from ``per_model[m][t]``, model m's query logits
    ``[Q, C]`` on task t: their mean over the models, argmaxed."""
    preds = np.argmax(np.mean(np.array(per_model), axis=0), axis=2)
    targets = np.array([task.query[1].numpy() for task in tasks])
    return np.equal(targets, preds).mean(1)
