"""A training run's checkpoint read back: is a file one, and the learner it holds.

The experiments write ``runs/<run_name>/checkpoint.pt`` (`metalearn.checkpoint`) as a dict
holding the run's ``args`` and ``recipe`` (`metalearn.runs.recipe`), the latest weights
``learner`` and the best-validation weights ``best_learner`` (None until the first
validation). Evaluating and deploying start here, rebuilding the learner from the recipe
(`metalearn.runs.recipe.read_recipe`, which refuses a record of another format, naming the
metalearn version that wrote it); export refuses to write over such a file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from metalearn.algorithms import MetaLearner
from metalearn.checkpoint import load_checkpoint
from metalearn.runs.recipe import Recipe, build_learner, read_recipe

__all__ = ["is_run_checkpoint", "learner_from", "load_learner", "read_run_checkpoint"]

_HOW = "pass a run's checkpoint, runs/<run_name>/checkpoint.pt"


def read_run_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The contents of a training run's checkpoint, checked to be one.

    Raises:
        FileNotFoundError: no file at ``path`` (or a folder).
        ValueError: the file is not a metalearn training checkpoint (unreadable by
            ``torch.load(weights_only=True)``, or without ``args``/``learner`` entries).
    """
    path = Path(path)
    if not path.is_file():
        what = "a folder, not a checkpoint file:" if path.is_dir() else "no checkpoint at"
        raise FileNotFoundError(f"{what} {path}; {_HOW}")
    try:
        saved = load_checkpoint(path)
    except Exception as err:  # any reader failure means: not a checkpoint (say why, briefly)
        raise ValueError(
            f"{path} is not a metalearn checkpoint (torch.load: {type(err).__name__}: "
            f"{_one_line(err)}); {_HOW}"
        ) from None
    if not isinstance(saved, dict) or "args" not in saved or "learner" not in saved:
        raise ValueError(
            f"{path} is not a metalearn training checkpoint (no 'args'/'learner' entries); {_HOW}"
        )
    return saved


def is_run_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` is a file `read_run_checkpoint` accepts."""
    try:
        read_run_checkpoint(path)
    except (FileNotFoundError, ValueError):
        return False
    return True


def load_learner(
    path: str | os.PathLike,
    which: Literal["best", "last"] = "best",
    device: torch.device | str = "cpu",
) -> tuple[MetaLearner, Recipe]:
    """Rebuild a run's learner from its checkpoint (``runs/<name>/checkpoint.pt``).

    Args:
        path: the checkpoint file (of either experiment).
        which: ``"best"``: the best-validation weights (what the experiment tests);
            ``"last"``: the weights of the last completed meta-step.
        device: where the learner goes.

    Returns:
        ``(learner, recipe)``: the learner with the chosen weights, in evaluation mode (no
        dropout; ``learner.train()`` before training it further), and the run's recipe
        (``recipe.data.ways``, ``recipe.training.eval_inner_steps``, ``recipe.data.image``).

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        ValueError: ``which`` is unknown, the file is not a training checkpoint, its recipe
            cannot be rebuilt, it holds no best weights yet, or its weights do not fit the
            learner its recipe describes.
    """
    return learner_from(read_run_checkpoint(path), which, device, source=path)


def learner_from(
    saved: Mapping[str, Any],
    which: Literal["best", "last"] = "best",
    device: torch.device | str = "cpu",
    *,
    source: str | os.PathLike = "the checkpoint",
) -> tuple[MetaLearner, Recipe]:
    """`load_learner` of a checkpoint already read (`read_run_checkpoint`); ``source`` names
    it in errors."""
    path = source
    if which not in ("best", "last"):
        raise ValueError(f"which={which!r}; choose 'best' (best validation) or 'last'")
    state = saved.get("best_learner") if which == "best" else saved["learner"]
    if state is None:
        raise ValueError(
            f"{path} holds no best-validation weights yet (the run stopped before its first "
            "validation); pass which='last' (--which last) for the latest weights"
        )
    try:
        recipe = read_recipe(saved)
        learner = build_learner(recipe)
    except ValueError as err:
        raise ValueError(f"{path}: {_one_line(err)}") from None
    try:
        learner.load_state_dict(state)
    except RuntimeError as err:
        raise ValueError(
            f"the weights in {path} do not fit the {recipe.learner.algorithm} learner its "
            f"recipe describes (ways={recipe.model.ways}, hidden={recipe.model.hidden}): "
            f"{_one_line(err)}"
        ) from None
    return learner.to(device).eval(), recipe  # a trained learner: dropout off


def _one_line(err: Exception, limit: int = 160) -> str:
    """``err``'s message on one line, cut at ``limit`` characters (torch's span many lines)."""
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
