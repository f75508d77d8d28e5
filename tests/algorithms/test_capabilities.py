"""What a learner can do is a class attribute read through `metalearn.algorithms.registry`
(`can`, `algorithms_that`), and the rooms above the algorithms hold no list of algorithm
names: a new algorithm is one registry line, and every check and message follows it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from metalearn.algorithms import LEARNERS, HeadLearner, MetaLossLearner
from metalearn.algorithms.inner_optimizer import InnerOptimizerLearner
from metalearn.algorithms.registry import (
    algorithms_taking,
    algorithms_that,
    can,
    learner_arguments,
)
from metalearn.algorithms.reptile import Reptile
from metalearn.runs.recipe import resolve_learner_args
from tests.conftest import ROOT

ABOVE = [ROOT / "metalearn" / "runs", ROOT / "metalearn" / "tools", ROOT / "metalearn" / "deploy",
         ROOT / "experiments"]  # fmt: skip


@pytest.mark.parametrize("name", list(LEARNERS))
def test_each_capability_agrees_with_what_the_learner_takes_and_is(name):
    takes = learner_arguments(name)
    cls = LEARNERS[name]
    assert can(name, "inner_loop") == ("inner_lr" in takes and "inner_steps" in takes)
    assert can(name, "inner_optimizer") == ("inner_optimizer" in takes)
    # Reptile chooses its own (Adam or SGD, the reference's two), outside MAML's family;
    # Meta-Curvature fixes its own (its transformed gradient step) inside it
    chooses = "inner_optimizer" not in cls.fixed_arguments
    assert can(name, "inner_optimizer") == (issubclass(cls, InnerOptimizerLearner) and chooses
                                            or cls is Reptile)  # fmt: skip
    # Curvature needs a meta-loss to differentiate and a support loss where an inner loop
    # starts (metalearn.algorithms.curvature).
    assert can(name, "curvature") == (issubclass(cls, MetaLossLearner) and can(name, "inner_loop"))
    assert can(name, "head_sized_per_task") == issubclass(cls, HeadLearner)


def test_the_lists_follow_the_registry():
    assert algorithms_that("inner_optimizer") == ("maml", "fomaml", "anil", "reptile", "boil")
    assert set(algorithms_that("inner_loop")) == set(LEARNERS) - set(
        algorithms_that("head_sized_per_task")
    )
    assert algorithms_taking("cg_damping") == ("imaml",)
    with pytest.raises(ValueError, match="capability 'wings'"):
        can("maml", "wings")  # type: ignore[arg-type]


def test_refusals_name_the_algorithms_the_registry_gives():
    base = {"algorithm": "protonet", "ways": 5, "inner_optimizer": "adam"}
    takers = ", ".join(algorithms_that("inner_optimizer"))
    with pytest.raises(ValueError, match=f"inner optimizer of {takers}; drop it for protonet"):
        resolve_learner_args(base)
    with pytest.raises(ValueError, match="--lora-rank is a setting of lora; drop it for maml"):
        resolve_learner_args({"algorithm": "maml", "lora_rank": 2})


def algorithm_lists(path: Path) -> list[tuple[int, str]]:
    """Containers or strings (docstrings aside) of ``path`` naming two or more algorithms
    (a container) or three or more (a message), with their lines."""
    names = set(LEARNERS)
    tree = ast.parse(path.read_text())
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            elements = node.keys + node.values if isinstance(node, ast.Dict) else node.elts
            named = [e.value for e in elements
                     if isinstance(e, ast.Constant) and e.value in names]  # fmt: skip
            if len(named) >= 2:
                found.append((node.lineno, ", ".join(named)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in docstrings:
                continue
            named = set(re.findall(r"[a-z0-9-]+", node.value)) & names
            if len(named) >= 3:
                found.append((node.lineno, node.value))
    return found


def test_the_detector_finds_a_list_and_a_message(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('"""maml, anil, lora in a docstring."""\nX = ("maml", "anil")\n'
                     'Y = f"use maml, fomaml or anil"\nZ = {"algorithm": "maml"}\n')  # fmt: skip
    assert [line for line, _ in algorithm_lists(probe)] == [2, 3]


def test_no_list_of_algorithm_names_above_the_algorithms():
    files = [p for room in ABOVE for p in sorted(room.rglob("*.py"))]
    assert len(files) > 20
    lists = {str(p.relative_to(ROOT)): algorithm_lists(p) for p in files}
    assert {name: found for name, found in lists.items() if found} == {}
