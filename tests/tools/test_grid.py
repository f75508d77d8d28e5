"""metalearn-grid runs a real seeds x settings grid of tiny Omniglot runs, skips the cells
it finished, and runs new cells when a flag after -- changes (tests/tools/test_grid_plan.py checks
the plan without training)."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys

from metalearn.checkpoint import load_checkpoint
from metalearn.runs.records import read_offline_run
from metalearn.tools import grid
from tests.conftest import OMNIGLOT, ROOT, needs_omniglot

DATA = OMNIGLOT
TINY = ["--iterations=1", "--meta-batch=2", "--query=1", "--eval-query=2", "--hidden=8",
        "--val-every=1", "--val-tasks=2", "--test-tasks=2", "--eval-inner-steps=1",
        f"--data-root={DATA}", "--device=cpu", "--wandb-mode=offline"]  # fmt: skip


@needs_omniglot
def test_grid_runs_every_cell_in_one_group_skips_them_and_runs_a_changed_grid(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(ROOT)  # the grid's experiments/omniglot_maml.py
    argv = ["--seeds", "0", "--set", "inner_lr=0.1,0.4", "--set", "inner_steps=1", "--jobs",
            "2", "--out-dir", str(tmp_path), "--group", "g", "--", *TINY]  # fmt: skip
    assert grid.main(argv) == 0
    out = capsys.readouterr().out
    names = [cell.name for cell in grid.plan(argv)[1]]
    assert [n.rsplit("-", 1)[0] for n in names] == ["g-lr0.1-seed0", "g-lr0.4-seed0"]
    for name, lr in zip(names, (0.1, 0.4)):
        saved = load_checkpoint(tmp_path / name / "checkpoint.pt")
        assert saved["args"]["inner_lr"] == lr and saved["results"] is not None
        assert f"| {name} | {saved['results']['test/acc']:.4f}" in out
    records = [read_offline_run(d) for d in (tmp_path / "wandb").glob("offline-run-*")]
    assert sorted(r.name for r in records) == names and {r.group for r in records} == {"g"}
    assert "| inner_lr=0.1, inner_steps=1 | 1 |" in out
    assert grid.main(argv) == 0
    assert "2 cells, 2 done, 0 to run" in capsys.readouterr().out
    # The same grid with another flag after --: new cells, trained, beside the old ones.
    changed = [*argv, "--algorithm=fomaml"]
    assert grid.main(changed) == 0
    out = capsys.readouterr().out
    assert "2 cells, 0 done, 2 to run" in out
    for name in (cell.name for cell in grid.plan(changed)[1]):
        assert name not in names
        saved = load_checkpoint(tmp_path / name / "checkpoint.pt")
        assert saved["recipe"]["learner"]["algorithm"] == "fomaml" and saved["results"]


@needs_omniglot
def test_ctrl_c_ends_with_the_cells_a_rerun_resumes_not_a_traceback(tmp_path):
    experiment = str(ROOT / "experiments" / "omniglot_maml.py")
    argv = ["--experiment", experiment, "--seeds", "0", "1", "--out-dir", str(tmp_path),
            "--group", "g", "--", *TINY[1:], "--iterations=500"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # SIGINT at its default, as a terminal's processes have it: an ignored SIGINT is
    # inherited through exec, and Python then installs no KeyboardInterrupt handler.
    grid_run = subprocess.Popen(
        [sys.executable, "-m", "metalearn.tools.grid", *argv], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    first = ""
    while not first.startswith("start "):  # the first cell is running
        first = grid_run.stdout.readline()
        assert first, grid_run.stderr.read()
    os.killpg(grid_run.pid, signal.SIGINT)  # Ctrl-C in a terminal: the grid and its cells
    out, err = grid_run.communicate(timeout=300)
    assert grid_run.returncode == 130, err
    assert "Traceback" not in out + err, err
    names = [cell.name for cell in grid.plan(argv)[1]]
    lines = out.splitlines()
    start = lines.index("stopped; 2 cell(s) to run, resumed by running the same command again:")
    assert lines[start + 1] == f"  metalearn-grid {shlex.join(argv)}"
    listed = [line.split()[0] for line in lines[start + 2 :]]
    assert listed == names
