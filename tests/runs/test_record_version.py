"""A run's record states its format (`RECIPE_VERSION`) and the metalearn version that wrote
it; a record of another format, or a checkpoint with no recipe, is refused in one line that
names that version and what to do, by every reader: `read_recipe`, ``--resume``,
metalearn-evaluate, metalearn-grid and deploy's `load_learner`. Nothing is upgraded."""

from __future__ import annotations

import pytest
import torch

import metalearn
from metalearn.checkpoint import save_checkpoint
from metalearn.deploy import load_learner
from metalearn.runs.lifecycle import UserError
from metalearn.runs.recipe import RECIPE_VERSION, Recipe, check_version, read_recipe
from metalearn.tools import evaluate, grid
from tests.conftest import OMNIGLOT
from tests.helpers.run_helpers import checkpoint_of, make, om, recipe_of

OLD = "0.0.9"  # a metalearn version that wrote another format


def args_in(tmp_path):
    return make(om, data_root=str(OMNIGLOT), out_dir=str(tmp_path), run_name="run", hidden=4,
                track=False, device="cpu")  # fmt: skip


def old_checkpoint(tmp_path, **recipe_edits):
    """A run's checkpoint whose recipe states ``recipe_edits`` (another format)."""
    path = checkpoint_of(tmp_path, om, args_in(tmp_path))
    saved = torch.load(path, weights_only=True)
    saved["recipe"].update(recipe_edits)
    for key, value in list(saved["recipe"].items()):
        if value is None:
            del saved["recipe"][key]
    return save_checkpoint(path, saved)


def test_a_record_states_its_format_and_the_version_that_wrote_it(tmp_path):
    record = recipe_of(om, args_in(tmp_path)).to_dict()
    assert record["version"] == RECIPE_VERSION == 2
    assert record["metalearn_version"] == metalearn.__version__
    assert Recipe.from_dict(record) == recipe_of(om, args_in(tmp_path))


@pytest.mark.parametrize(
    ("edits", "names"),
    [
        ({"version": 1, "metalearn_version": OLD},
         f"recipe format 1, written by metalearn {OLD}; metalearn {metalearn.__version__} "
         f"reads format 2 only: pip install metalearn=={OLD} to read it or train the run again"),
        ({"version": 1, "metalearn_version": None},
         "format 1, written by a metalearn that did not record its version; metalearn "),
        ({"version": None}, "recipe format None, written by metalearn"),
        ({"version": "2"}, "recipe format '2'"),
        ({"version": 3, "metalearn_version": "9.0"}, "written by metalearn 9.0"),
    ],
)  # fmt: skip
def test_another_format_is_refused_in_one_line_naming_its_writer(tmp_path, edits, names):
    record = {**recipe_of(om, args_in(tmp_path)).to_dict(), **edits}
    record = {k: v for k, v in record.items() if v is not None}
    with pytest.raises(ValueError) as err:
        Recipe.from_dict(record)
    message = str(err.value)
    assert names in message and "\n" not in message
    assert len(message) <= 160  # whole in the tools' one-line errors (deploy's _one_line)
    with pytest.raises(ValueError, match="not a record"):
        check_version(["a", "list"])


def test_a_checkpoint_without_a_recipe_is_refused():
    with pytest.raises(ValueError, match=r"^the checkpoint holds no recipe \(.*train the run"):
        read_recipe({"args": {"algorithm": "maml", "ways": 5}})


def test_every_reader_refuses_an_old_record_in_one_line(tmp_path, capsys):
    path = old_checkpoint(tmp_path, version=1, metalearn_version=OLD)
    said = f"written by metalearn {OLD}"

    with pytest.raises(UserError) as err:  # --resume, before anything is built or written
        om.parse_args(["--resume", "--out-dir", str(tmp_path), "--run-name", "run",
                       "--data-root", str(OMNIGLOT)])  # fmt: skip
    assert said in str(err.value) and "\n" not in str(err.value)

    with pytest.raises(ValueError) as err:  # deploy
        load_learner(path)
    assert said in str(err.value) and "\n" not in str(err.value)

    capsys.readouterr()
    code = evaluate.main(["--checkpoint", str(path), "--no-track", "--tasks", "2"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and said in lines[0], lines


def test_the_grid_skips_an_old_record_naming_its_writer(tmp_path, capsys, monkeypatch):
    from tests.conftest import ROOT

    monkeypatch.chdir(ROOT)  # the grid's experiments/omniglot_maml.py
    argv = ["--seeds", "0", "--out-dir", str(tmp_path), "--group", "g", "--",
            "--iterations=1", f"--data-root={OMNIGLOT}", "--device=cpu"]  # fmt: skip
    (cell,) = grid.plan(argv)[1]
    path = old_checkpoint(tmp_path / "made", version=1, metalearn_version=OLD)
    (tmp_path / cell.name).mkdir()
    (tmp_path / cell.name / "checkpoint.pt").write_bytes(path.read_bytes())
    assert grid.main(argv) == 1
    out = capsys.readouterr().out
    assert f"SKIPPED {cell.name}: " in out and f"written by metalearn {OLD}" in out
