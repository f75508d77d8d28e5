"""metalearn-grid before anything runs: a cell is its whole recipe, its --set names are the
experiment's flags, every cell's command line is checked, and a cell's folder says what it
holds (new, stopped, done, another recipe). No training here: tests/tools/test_grid.py runs a
grid."""

from __future__ import annotations

import dataclasses
import re
import sys

import pytest
import torch

from metalearn.checkpoint import save_checkpoint
from metalearn.runs.cli import flatten
from metalearn.tools import grid
from tests.conftest import ROOT
from tests.helpers.run_helpers import checkpoint_of, om

FEWSHOT = grid.experiment_module(ROOT / "experiments" / "fewshot_maml.py")


@pytest.fixture(autouse=True)
def _in_the_clone(monkeypatch):
    """``--experiment NAME`` is ``experiments/NAME.py`` under the current folder."""
    monkeypatch.chdir(ROOT)


def test_an_experiment_is_loaded_by_its_path_and_sys_path_is_left_alone(tmp_path, capsys):
    before = list(sys.path)
    own = tmp_path / "mine.py"
    own.write_text((ROOT / "experiments" / "omniglot_maml.py").read_text())
    cells = grid.plan(["--experiment", str(own), "--set", "inner_lr=0.1,0.4", "--out-dir",
                       str(tmp_path)])[1]  # fmt: skip
    assert [c.name.rsplit("-", 1)[0] for c in cells] == ["grid-lr0.1-seed0", "grid-lr0.4-seed0"]
    assert sys.path == before
    missing = refused(capsys, ["--experiment", "nope"])
    assert "no experiment file experiments/nope.py here" in missing
    not_one = tmp_path / "plain.py"
    not_one.write_text("x = 1\n")
    assert "not an experiment file (it defines no Args, EXPERIMENT, parse_args)" in refused(
        capsys, ["--experiment", str(not_one)]
    )


def names(argv: list[str]) -> list[str]:
    return [cell.name for cell in grid.plan(argv)[1]]


def refused(capsys, argv: list[str]) -> str:
    assert grid.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("metalearn-grid: error: "), err
    return err


def test_cells_are_named_by_what_differs_their_seed_and_their_recipe(tmp_path):
    argv = ["--seeds", "0", "1", "--set", "inner_lr=0.1,0.4", "--set", "ways=20",
            "--out-dir", str(tmp_path)]  # fmt: skip
    cells = grid.plan(argv)[1]
    assert [c.name.rsplit("-", 1)[0] for c in cells] == [
        "grid-lr0.1-seed0", "grid-lr0.1-seed1", "grid-lr0.4-seed0", "grid-lr0.4-seed1"]  # fmt: skip
    assert len({c.key for c in cells}) == 4 and all(c.name.endswith(c.key) for c in cells)
    assert cells[0].argv[:3] == ["--inner_lr=0.1", "--ways=20", "--seed=0"]
    # The key is the recipe the cell's command line makes, as the experiment makes it.
    recipe = grid.cell_recipe(om, cells[3].argv)
    assert recipe.learner.arguments["inner_lr"] == 0.4 and recipe.data.ways == 20
    assert recipe.training.seed == 1 and grid.cell_key(recipe) == cells[3].key


def test_a_changed_flag_after_the_separator_makes_new_cells(tmp_path):
    base = ["--set", "inner_lr=0.1,0.4", "--out-dir", str(tmp_path), "--"]
    first = names(base)
    assert names(base) == first  # the same grid: the same cells
    for changed in (["--hidden", "32"], ["--algorithm=fomaml"], ["--ways", "20",
                    "--split", "alphabet"]):  # fmt: skip
        assert not set(names([*base, *changed])) & set(first), changed
    # Where the data lives and how much memory a step takes are not what a cell computes.
    same = names([*base, f"--data-root={tmp_path}", "--chunk-size=2", "--checkpoint-every=7"])
    assert same == first


def test_set_names_and_cell_values_are_checked_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "runs"
    err = refused(capsys, ["--set", "inner_lrr=0.1,0.4", "--out-dir", str(out)])
    assert "no flag --inner-lrr; did you mean inner_lr" in err
    assert "the grid sets --seed" in refused(capsys, ["--set", "seed=1,2"])
    assert "(give --seeds)" in refused(capsys, ["--", "--seed=3"])
    assert "write NAME=V1,V2" in refused(capsys, ["--set", "inner_lr"])
    err = refused(capsys, ["--set", "inner_lr=0.1,-1", "--out-dir", str(out)])
    assert "cell inner_lr=-1, seed 0: --inner-lr -1.0: must be a positive" in err
    assert "--jobs 0: must be at least 1" in refused(capsys, ["--jobs", "0"])
    assert refused(capsys, ["--seeds", "--out-dir", str(out)]) == (
        "metalearn-grid: error: --seeds names no seed: give at least one (--seeds 0 1 2), or "
        "drop --seeds for seed 0\n")  # fmt: skip
    assert "seed 1 is given twice (one run each)" in refused(capsys, ["--seeds", "1", "0", "1"])
    with pytest.raises(SystemExit) as stop:  # the experiment's own parser: its one line
        grid.main(["--out-dir", str(out), "--", "--hiden=3"])
    assert stop.value.code == 2 and "did you mean --hidden" in capsys.readouterr().err
    assert not out.exists()  # nothing launched, nothing written


def test_either_experiment_can_be_gridded(tmp_path):
    argv = ["--experiment", "fewshot_maml", "--set", "backbone=conv4,resnet12", "--out-dir",
            str(tmp_path), "--", "--dataset", "cifar-fs", f"--data-root={tmp_path}"]  # fmt: skip
    args, cells = grid.plan(argv)
    assert [c.name.rsplit("-", 1)[0] for c in cells] == [
        "grid-backboneconv4-seed0", "grid-backboneresnet12-seed0"]  # fmt: skip
    recipe = grid.cell_recipe(FEWSHOT, cells[1].argv)
    assert recipe.experiment == "fewshot_maml" and recipe.model.backbone == "resnet12"
    assert recipe.data.dataset == "cifar-fs" and recipe.data.image.size == 32


def test_a_cells_folder_says_new_stopped_done_or_another_recipe(tmp_path):
    (cell,) = grid.plan(["--out-dir", str(tmp_path), "--", "--hidden=8"])[1]
    cell = dataclasses.replace(cell, name="run")  # where checkpoint_of writes
    assert grid.status(cell, str(tmp_path)) == "new"
    args = om.parse_args(cell.argv)
    path = checkpoint_of(tmp_path, om, args)
    assert grid.status(cell, str(tmp_path)) == "stopped"
    saved = torch.load(path, weights_only=True)
    save_checkpoint(path, {**saved, "results": {"test/acc": 0.5, "test/acc_ci95": 0.1}})
    assert grid.status(cell, str(tmp_path)) == "done"
    assert grid.results(cell, str(tmp_path)) == {"test/acc": 0.5, "test/acc_ci95": 0.1}
    other = om.parse_args([*cell.argv, "--hidden=16"])
    checkpoint_of(tmp_path, om, other)
    assert flatten(other)["hidden"] == 16 and grid.status(cell, str(tmp_path)) == "differs"


def test_help_lists_each_flag_once(capsys):
    with pytest.raises(SystemExit) as stop:
        grid.main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    for name in ("--seeds", "--set", "--experiment", "--jobs", "--group", "--out-dir"):
        assert len(re.findall(rf"(?<![\w-]){name}(?=[ ,])", out)) == 1, name
