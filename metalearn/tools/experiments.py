"""Experiment files, found one way: by name under ``experiments/`` or by path, loaded with
importlib by their path. Nothing is added to ``sys.path``.

An experiment is a file, not an installed module (``experiments/omniglot_maml.py`` is meant
to be read and changed). `experiment_file` names it, `load_experiment` loads it and checks
that it is one (it defines ``Args``, ``EXPERIMENT`` and ``parse_args``), `load_file` loads
any Python file by its path (a benchmark script, a demo). A file is loaded once per process
and registered in ``sys.modules`` under the name given, which its dataclasses need while they
are built; its ``__main__`` block does not run.

Example:
    >>> om = load_experiment("omniglot_maml")  # experiments/omniglot_maml.py, cwd a clone
    >>> args = om.parse_args(["--no-track"])
"""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

from metalearn.runs.lifecycle import UserError

PREFIX = "metalearn_experiment_"
"""``sys.modules`` name of a loaded experiment: this prefix and the file's stem."""

REQUIRED = ("Args", "EXPERIMENT", "parse_args")
"""What a file defines to be an experiment (the grid and the recipe tools read these)."""


def experiment_file(experiment: str | Path, root: Path | None = None) -> Path:
    """The experiment's file: ``experiment`` itself when it ends in ``.py``, else
    ``experiments/<experiment>.py`` under ``root`` (default: the current folder).

    Raises:
        UserError: no such file.
    """
    name = str(experiment)
    path = Path(name if name.endswith(".py") else f"experiments/{name}.py")
    path = path if root is None else root / path
    if not path.is_file():
        raise UserError(f"--experiment {name}: no experiment file {path} here; run from the folder "
                        "that holds experiments/ (a clone of metalearn) or pass "
                        "--experiment PATH.py")  # fmt: skip
    return path.resolve()


@cache
def load_file(path: Path, name: str) -> ModuleType:
    """The Python file at ``path``, loaded by its path as module ``name``.

    Args:
        path: the file (resolved).
        name: its name in ``sys.modules``; another file loaded later may import it by this
            name (a benchmark script's ``import benchtools``).

    Raises:
        UserError: ``path`` is not a Python file.
    """
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UserError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def experiment_module(path: Path) -> ModuleType:
    """The experiment file at ``path``, loaded once, checked to be an experiment.

    Raises:
        UserError: the file defines no ``Args``, ``EXPERIMENT`` or ``parse_args``.
    """
    module = load_file(path.resolve(), PREFIX + path.stem)
    missing = [a for a in REQUIRED if not hasattr(module, a)]
    if missing:
        raise UserError(f"--experiment {path}: not an experiment file (it defines no "
                        f"{', '.join(missing)})")  # fmt: skip
    return module


def load_experiment(experiment: str | Path, root: Path | None = None) -> ModuleType:
    """The experiment named ``experiment`` (a name under ``experiments/`` or a path ending in
    ``.py``, see `experiment_file`), loaded once."""
    return experiment_module(experiment_file(experiment, root))
