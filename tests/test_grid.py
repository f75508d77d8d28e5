"""scripts/grid.py runs a real seeds x settings grid of tiny Omniglot runs, and resumes it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "experiments"))
import grid  # noqa: E402
import omniglot_maml as om  # noqa: E402

from metalearn.checkpoint import load_checkpoint  # noqa: E402
from metalearn.runs.cli import flatten  # noqa: E402
from metalearn.runs.records import read_offline_run  # noqa: E402

DATA = Path(os.environ.get("METALEARN_DATA", ROOT.parent / "shared" / "data" / "omniglot"))
TINY = ["--iterations=1", "--meta-batch=2", "--query=1", "--eval-query=2", "--hidden=8",
        "--val-every=1", "--val-tasks=2", "--test-tasks=2", "--eval-inner-steps=1",
        f"--data-root={DATA}", "--device=cpu", "--wandb-mode=offline"]  # fmt: skip


@pytest.mark.skipif(not (DATA / "images_background").is_dir(), reason="full Omniglot not found")
def test_grid_runs_every_cell_in_one_group_then_skips_them(tmp_path, capsys):
    argv = ["--seeds", "0", "--set", "inner_lr=0.1,0.4", "--set", "inner_steps=1", "--jobs",
            "2", "--out-dir", str(tmp_path), "--group", "g", "--", *TINY]  # fmt: skip
    assert grid.main(argv) == 0
    out = capsys.readouterr().out
    names = ["g-lr0.1-seed0", "g-lr0.4-seed0"]
    for name, lr in zip(names, (0.1, 0.4)):
        saved = load_checkpoint(tmp_path / name / "checkpoint.pt")
        assert saved["args"]["inner_lr"] == lr and saved["results"] is not None
        assert f"| {name} | {saved['results']['test/acc']:.4f}" in out
    records = [read_offline_run(d) for d in (tmp_path / "wandb").glob("offline-run-*")]
    assert sorted(r.name for r in records) == names and {r.group for r in records} == {"g"}
    assert "| inner_lr=0.1, inner_steps=1 | 1 |" in out
    assert grid.main(argv) == 0
    assert "2 cells, 2 done, 0 to run" in capsys.readouterr().out


def test_bad_set_is_one_line():
    with pytest.raises(SystemExit, match="--set inner_lr: write NAME=V1,V2"):
        grid.parse_settings(["inner_lr"])


def test_cells_are_named_by_what_differs():
    cells = grid.make_cells({"inner_lr": ["0.1", "0.4"], "ways": ["20"]}, [0, 1], "grid")
    assert [c.name for c in cells] == ["grid-lr0.1-seed0", "grid-lr0.1-seed1",
                                       "grid-lr0.4-seed0", "grid-lr0.4-seed1"]  # fmt: skip
    assert cells[0].flags("runs", "grid")[:3] == ["--inner_lr=0.1", "--ways=20", "--seed=0"]


def test_sweep_file_is_a_wandb_sweep_the_experiment_accepts():
    sweep = yaml.safe_load((ROOT / "experiments" / "sweeps" / "omniglot_maml.yaml").read_text())
    assert (ROOT / sweep["program"]).is_file()
    assert sweep["metric"] == {"name": "val/acc", "goal": "maximize"}
    assert sweep["method"] in ("grid", "random", "bayes")
    # What `wandb agent` passes: --name=value for each parameter.
    argv = [f"--{name}={(spec.get('values') or [spec.get('value')])[-1]}"
            for name, spec in sweep["parameters"].items()]  # fmt: skip
    args = flatten(om.parse_args(argv))
    for name, spec in sweep["parameters"].items():
        assert args[name] == (spec.get("values") or [spec.get("value")])[-1]
