"""Tracking: runs made offline here are read back by wandb's own reader (compare_runs has
tests/test_compare_runs.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import wandb

from metalearn.runs.records import read_offline_run
from metalearn.runs.tracking import decide_mode, graceful_shutdown, init_run


def _make_runs(tmp_path: Path) -> list[Path]:
    dirs = []
    for i, lr in enumerate([0.1, 0.4]):
        run = init_run(
            {"inner_lr": lr, "algorithm": "maml", "seed": 0}, project="t", mode="offline",
            name=f"lr{lr}", group="sweep", tags=["maml"], dir=tmp_path,
        )  # fmt: skip
        for step in range(4):
            run.log({"train/loss": 1.0 / (step + 1 + i), "val/acc": 0.5 + 0.1 * step}, step=step)
        run.summary["test/acc"] = 0.9 + 0.01 * i
        dirs.append(Path(run.dir).parent)
        run.finish()
    return dirs


def test_offline_runs_round_trip(tmp_path):
    first, second = _make_runs(tmp_path)
    wandb.teardown()  # finish() may return before the .wandb file is complete
    record = read_offline_run(second)
    assert record.name == "lr0.4" and record.group == "sweep" and "maml" in record.tags
    assert record.config["inner_lr"] == 0.4 and "git_commit" in record.config
    assert record.state == "finished"
    steps, losses = record.series("train/loss")
    assert steps == [0, 1, 2, 3]
    assert losses == pytest.approx([1 / 2, 1 / 3, 1 / 4, 1 / 5])
    assert record.summary["test/acc"] == pytest.approx(0.91)


def test_decide_mode(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert decide_mode("auto") == "offline"
    assert decide_mode("disabled") == "disabled"
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", "/nonexistent")
    assert decide_mode(None) == "offline"  # no key: never blocks on an online init
    with pytest.raises(ValueError, match="unknown W&B mode"):
        decide_mode("cloud")


def test_sigterm_finishes_cleanly(tmp_path):
    script = textwrap.dedent(
        """
        import os, signal, sys
        from metalearn.runs.tracking import graceful_shutdown
        try:
            with graceful_shutdown():
                os.kill(os.getpid(), signal.SIGTERM)
                sys.exit("signal was not turned into KeyboardInterrupt")
        except KeyboardInterrupt as stop:  # metalearn.runs.lifecycle.Stopped
            print("cleaned up", stop.exit_code)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0 and "cleaned up 143" in done.stdout
    with graceful_shutdown():
        pass
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
