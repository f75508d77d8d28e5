"""A training run's checkpoint read back: is a file one, and the learner it holds.

The Omniglot experiment writes ``runs/<run_name>/checkpoint.pt`` (`metalearn.checkpoint`)
as a dict holding the run's ``args``, the latest weights ``learner`` and the
best-validation weights ``best_learner`` (None until the first validation). Evaluating
and deploying start here; export refuses to write over such a file.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import torch

from metalearn.algorithms import MetaLearner, build_learner
from metalearn.checkpoint import load_checkpoint

__all__ = ["is_run_checkpoint", "load_learner", "read_run_checkpoint"]

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
) -> tuple[MetaLearner, dict[str, Any]]:
    """Rebuild a learner from an Omniglot experiment checkpoint (``runs/<name>/checkpoint.pt``).

    Args:
        path: the checkpoint file.
        which: ``"best"``: the best-validation weights (what the experiment tests);
            ``"last"``: the weights of the last completed meta-step.
        device: where the learner goes.

    Returns:
        ``(learner, args)``: the learner with the chosen weights, and the run's arguments
        (``args["ways"]``, ``args["eval_inner_steps"]``, ...).

    Raises:
        FileNotFoundError: no checkpoint at ``path``.
        ValueError: ``which`` is unknown, the file is not a training checkpoint, it holds
            no best weights yet, or its weights do not fit the learner its args describe.
    """
    if which not in ("best", "last"):
        raise ValueError(f"which={which!r}; choose 'best' (best validation) or 'last'")
    saved = read_run_checkpoint(path)
    state = saved.get("best_learner") if which == "best" else saved["learner"]
    if state is None:
        raise ValueError(
            f"{path} holds no best-validation weights yet (the run stopped before its first "
            "validation); pass which='last' (--which last) for the latest weights"
        )
    args = dict(saved["args"])
    learner = build_learner(args)
    try:
        learner.load_state_dict(state)
    except RuntimeError as err:
        raise ValueError(
            f"the weights in {path} do not fit the {args['algorithm']} learner its args "
            f"describe (ways={args['ways']}, hidden={args['hidden']}): {_one_line(err)}"
        ) from None
    return learner.to(device), args


def _one_line(err: Exception, limit: int = 160) -> str:
    """``err``'s message on one line, cut at ``limit`` characters (torch's span many lines)."""
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
