"""metalearn.tools.experiments: an experiment or script is found one way, loaded by its path,
and no file of the project edits ``sys.path``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from metalearn.runs.lifecycle import UserError
from metalearn.tools import experiments, grid
from tests.conftest import ROOT, experiment, script

EDITS = {"insert", "append", "extend", "__setitem__"}


def sys_path_edits(path: Path) -> list[int]:
    """Lines of ``path`` that call ``sys.path.<insert|append|extend>`` or assign ``sys.path``."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in EDITS:
                target = node.func.value
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            target = next((t for t in targets if isinstance(t, ast.Attribute)), None)
        if (isinstance(target, ast.Attribute) and target.attr == "path"
                and isinstance(target.value, ast.Name) and target.value.id == "sys"):  # fmt: skip
            lines.append(node.lineno)
    return sorted(lines)


def test_the_detector_finds_each_way_of_editing_sys_path(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import sys\nsys.path.insert(0, 'x')\nsys.path.append('y')\n"
                     "sys.path += ['z']\nsys.path = []\nprint(sys.path)\n")  # fmt: skip
    assert sys_path_edits(probe) == [2, 3, 4, 5]


def test_no_file_of_the_project_edits_sys_path():
    files = [p for room in ("metalearn", "tests", "scripts", "experiments")
             for p in sorted((ROOT / room).rglob("*.py"))]  # fmt: skip
    assert len(files) > 150
    edits = {str(p.relative_to(ROOT)): sys_path_edits(p) for p in files}
    assert {name: lines for name, lines in edits.items() if lines} == {}


def test_an_experiment_is_one_module_however_it_is_found(monkeypatch):
    monkeypatch.chdir(ROOT)
    om = experiment("omniglot_maml")
    assert experiments.load_experiment("omniglot_maml") is om
    assert grid.experiment_module(grid.experiment_file("experiments/omniglot_maml.py")) is om
    assert Path(om.__file__) == ROOT / "experiments" / "omniglot_maml.py"


def test_a_script_imports_benchtools_as_the_test_loaded_it():
    assert script("bench_maml").SETTINGS is script("benchtools").SETTINGS


def test_a_missing_or_foreign_file_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"no experiment file .*experiments/nope\.py"):
        experiments.load_experiment("nope", tmp_path)
    (tmp_path / "plain.py").write_text("X = 1\n")
    with pytest.raises(UserError, match="defines no Args, EXPERIMENT, parse_args"):
        experiments.load_experiment(tmp_path / "plain.py")
