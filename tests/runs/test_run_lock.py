"""One writer per run folder (metalearn.runs.lock): a live holder refuses a second process in
one line naming it, a dead holder's lock is taken over with a warning, another machine's
lock never is; two real runs of one name: the second exits 2 within seconds and the first
finishes whole. Run names are one folder name, --out-dir is writable, both checked first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import wandb

from metalearn.checkpoint import HOST, load_checkpoint
from metalearn.runs.lifecycle import UserError, latest_segment
from metalearn.runs.lock import LOCK_NAME, held, run_holder
from metalearn.runs.records import read_offline_run
from tests.conftest import ROOT, needs_omniglot
from tests.experiments.test_omniglot_experiment import (
    TINY,
    _flags,
    _spawn,
    _steps,
    _wait_for_step,
)
from tests.helpers.run_helpers import make, om


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(done.stdout)


def _write_lock(folder: Path, host: str, pid: int, age: float = 60.0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    path.write_text(json.dumps({"host": host, "pid": pid, "started": time.time() - age}))
    os.utime(path, (time.time() - age, time.time() - age))
    return path


def test_a_live_holder_is_named_and_the_lock_goes_with_the_block(tmp_path):
    with held(tmp_path / "r") as path:
        assert run_holder(tmp_path / "r")["pid"] == os.getpid()
        with pytest.raises(UserError, match=f"in use by process {os.getpid()} on host {HOST}"):
            with held(tmp_path / "r"):
                pass
        assert path.is_file()
    assert not (tmp_path / "r" / LOCK_NAME).exists() and run_holder(tmp_path / "r") is None


def test_a_dead_holders_lock_is_taken_over_with_a_warning(tmp_path):
    _write_lock(tmp_path / "r", HOST, _dead_pid())
    assert run_holder(tmp_path / "r") is None
    with pytest.warns(UserWarning, match="taking over a stale lock"):
        with held(tmp_path / "r"):
            assert run_holder(tmp_path / "r")["pid"] == os.getpid()


def test_another_machines_lock_is_never_taken_over(tmp_path):
    _write_lock(tmp_path / "r", "some-other-host", _dead_pid())
    with pytest.raises(UserError, match="on host some-other-host"):
        with held(tmp_path / "r"):
            pass


def test_an_unreadable_lock_is_in_use_while_young_and_taken_over_when_old(tmp_path):
    path = tmp_path / "r" / LOCK_NAME
    path.parent.mkdir()
    path.write_text("")  # its creator has not written it yet
    with pytest.raises(UserError, match="being taken by another process"):
        with held(tmp_path / "r"):
            pass
    os.utime(path, (time.time() - 600, time.time() - 600))
    with pytest.warns(UserWarning, match="damaged lock"):
        with held(tmp_path / "r"):
            pass


@pytest.mark.parametrize("name", ["../x", "/abs", "a/b/c", "", ".", ".."])
def test_a_run_name_is_one_folder_name(tmp_path, name):
    with pytest.raises(UserError, match="a run's name is one folder name"):
        om.main(make(om, out_dir=str(tmp_path / "runs"), run_name=name, track=False))
    assert list(tmp_path.iterdir()) == []


def test_an_out_dir_that_cannot_hold_runs_is_refused_before_anything_runs(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(UserError, match="is a file, not a folder"):
        om.main(make(om, out_dir=str(afile / "runs"), track=False))
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "ro"
        locked.mkdir(mode=0o500)
        with pytest.raises(UserError, match="is not writable"):
            om.main(make(om, out_dir=str(locked), track=False))


@needs_omniglot
@pytest.mark.slow
def test_two_runs_of_one_name_the_second_exits_2_and_the_first_finishes(tmp_path):
    n = 400  # long enough to be still training when the second process starts
    run = dict(iterations=n, val_every=200, run_name="same", track=True, wandb_mode="offline")
    first = _spawn(tmp_path, **run)
    path = tmp_path / "same" / "checkpoint.pt"
    _wait_for_step(first, path, 2)
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    for extra in ([], ["--resume"]):
        cmd = [sys.executable, str(ROOT / "experiments" / "omniglot_maml.py"),
               *_flags(tmp_path, **run), *extra]  # fmt: skip
        start = time.monotonic()
        second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
        assert second.returncode == 2 and time.monotonic() - start < 30, second.stderr
        (line,) = second.stderr.strip().splitlines()
        assert f"is in use by process {first.pid} on host {HOST}" in line
    assert first.wait(timeout=600) == 0, (tmp_path / "child.log").read_text()
    saved = load_checkpoint(path)
    assert saved["iteration"] == n and saved["results"] is not None
    wandb.teardown()
    record = read_offline_run(latest_segment(tmp_path / "wandb", saved["wandb_id"]))
    assert _steps(record) == list(range(1, n + 1)) and record.state == "finished"
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 1  # one W&B run
    assert not (tmp_path / "same" / LOCK_NAME).exists()


def test_tiny_settings_are_the_omniglot_tests():  # the import above is what this file reuses
    assert TINY["algorithm"] == "maml"
