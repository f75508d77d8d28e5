"""The sweep files run as written: every cell of every file in experiments/sweeps/ becomes the
command line wandb's own agent would build for it, and the experiment parses and resolves it
to exactly the cell's values; sweep runs and runs started by hand never share a name."""

from __future__ import annotations

import itertools

import pytest
import yaml
from wandb.sdk.launch.sweeps.utils import create_sweep_command_args

from metalearn.runs.cli import flatten
from metalearn.runs.experiment import new_run_identity
from tests.conftest import ROOT
from tests.conftest import experiment as load_experiment

SWEEPS = sorted((ROOT / "experiments" / "sweeps").glob("*.yaml"))


def cells(parameters: dict) -> list[dict]:
    """Every grid point of a sweep's parameters (a distribution: its two bounds)."""
    choices = {}
    for name, spec in parameters.items():
        if "values" in spec:
            choices[name] = list(spec["values"])
        elif "value" in spec:
            choices[name] = [spec["value"]]
        else:
            choices[name] = [spec["min"], spec["max"]]
    return [dict(zip(choices, combo)) for combo in itertools.product(*choices.values())]


def test_there_are_sweep_files():
    assert SWEEPS, "experiments/sweeps/ holds no sweep file"


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_every_cell_is_a_command_line_the_experiment_takes(path, tmp_path):
    sweep = yaml.safe_load(path.read_text())
    program = ROOT / sweep["program"]
    assert program.is_file() and program.parent.name == "experiments"
    assert "${args}" in sweep["command"]  # the agent passes --name=value flags
    experiment = load_experiment(program.stem)
    # The best validation accuracy: val/best_acc's last value (tests/runs/test_tracking.py).
    assert sweep["metric"] == {"name": "val/best_acc", "goal": "maximize"}
    for cell in cells(sweep["parameters"]):
        built = create_sweep_command_args({"args": {k: {"value": v} for k, v in cell.items()}})
        args = experiment.resolve_args(experiment.parse_args([*built["args"],
                                                             f"--out-dir={tmp_path}"]))  # fmt: skip
        flat = flatten(args)
        assert {k: flat[k] for k in cell} == cell, built["args"]


def test_sweep_runs_and_runs_started_by_hand_never_share_a_name(monkeypatch, tmp_path):
    om = load_experiment("omniglot_maml")
    monkeypatch.delenv("WANDB_SWEEP_ID", raising=False)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    first = om.resolve_args(om.parse_args([f"--out-dir={tmp_path}"]))  # the README's run
    again = om.resolve_args(om.parse_args([f"--out-dir={tmp_path}"]))
    runs = [first, again]
    for sweep, run_id in (("sweep1", "run00001"), ("sweep2", "run00002")):  # two sweeps
        monkeypatch.setenv("WANDB_SWEEP_ID", sweep)
        monkeypatch.setenv("WANDB_RUN_ID", run_id)
        cell = ["--inner_lr=0.4", "--inner_steps=1", "--seed=0", f"--out-dir={tmp_path}"]
        runs.append(om.resolve_args(om.parse_args(cell)))
    names = [r.tracking.run_name for r in runs]
    assert len(set(names)) == 4 and all(
        n.startswith("protomaml-5w1s-lr0.4-steps1-seed0-") for n in names
    )
    assert len({r.tracking.wandb_id for r in runs}) == 4
    assert first.tracking.run_name.endswith("-" + first.tracking.wandb_id)
    assert names[2].endswith("-sweep1-run00001") and runs[2].tracking.wandb_id == "run00001"
    # A name the user gives is the run's name, and resolving again keeps it.
    named = om.resolve_args(om.parse_args(["--run-name=mine", f"--out-dir={tmp_path}"]))
    assert named.tracking.run_name == "mine" and om.resolve_args(named) == named


def test_new_names_are_unique_and_the_agent_decides_the_id():
    names = {new_run_identity("maml-5w1s", environ={})[0] for _ in range(1000)}
    assert len(names) == 1000
    name, run_id = new_run_identity("d", environ={"WANDB_SWEEP_ID": "s", "WANDB_RUN_ID": "r"})
    assert (name, run_id) == ("d-s-r", "r")
