"""Tracking: runs made offline here are read back by wandb's own reader (compare_runs has
tests/tools/test_compare_runs.py)."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import wandb

from metalearn.runs.records import find_offline_artifact, read_offline_run
from metalearn.runs.tracking import (
    decide_mode,
    define_summaries,
    graceful_shutdown,
    init_run,
    log_model,
)


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


def test_accuracies_are_summarised_by_their_best_value_losses_by_their_lowest(tmp_path):
    run = init_run({}, project="t", mode="offline", dir=tmp_path, job_type="train")
    define_summaries(run)
    accs, losses = [0.5, 0.9, 0.7], [1.0, 0.4, 0.6]
    for step, (acc, loss) in enumerate(zip(accs, losses)):
        best = max(accs[: step + 1])
        run.log({"val/acc": acc, "train/loss": loss, "val/best_acc": best}, step=step)
    folder = Path(run.dir).parent
    run.finish()
    wandb.teardown()
    record = read_offline_run(folder)
    assert record.summary["val/acc"] == {"max": 0.9}  # not the last validation, 0.7
    assert record.summary["train/loss"] == {"min": 0.4}
    assert record.summary["val/best_acc"] == 0.9  # a plain number: what the sweeps optimise
    assert record.job_type == "train"


def _leet_artifacts(run_dir: Path) -> list[dict]:
    """The artifact records of an offline run, as wandb's own reader prints them."""
    exe = Path(sys.executable).with_name("wandb")
    out = subprocess.run([str(exe), "leet", "inspect", "--json", str(run_dir)], check=True,
                         capture_output=True, text=True, timeout=120).stdout  # fmt: skip
    return [json.loads(line)["artifact"] for line in out.splitlines() if '"artifact"' in line]


def test_an_offline_model_stays_with_its_run_folder_when_moved(tmp_path):
    model = tmp_path / "runs" / "r" / "checkpoint.pt"
    model.parent.mkdir(parents=True)
    data = bytes(range(256)) * 400
    model.write_bytes(data)
    run = init_run({}, project="t", mode="offline", dir=tmp_path / "runs")
    folder = Path(run.dir).parent
    log_model(run, model, name="r-model")
    run.finish()
    wandb.teardown()
    model.write_bytes(b"a later checkpoint")  # what the artifact holds must not change
    moved = tmp_path / "elsewhere"
    shutil.move(tmp_path / "runs", moved)  # another machine: the old paths are gone
    (artifact,) = _leet_artifacts(moved / "wandb" / folder.name)
    assert artifact["name"] == "r-model" and set(artifact["aliases"]) == {"best", "latest"}
    (entry,) = artifact["manifest"]["contents"]
    assert entry["path"] == "checkpoint.pt" and not Path(entry["local_path"]).is_absolute()
    kept = moved / "wandb" / folder.name / entry["local_path"]
    assert kept.read_bytes() == data
    assert entry["digest"] == base64.b64encode(hashlib.md5(data).digest()).decode()
    found = find_offline_artifact(moved / "wandb", "r-model", "best")
    assert found.files == {"checkpoint.pt": kept} and found.digest == artifact["digest"]
    with pytest.raises(FileNotFoundError, match="r-model:v3"):
        find_offline_artifact(moved / "wandb", "r-model", "v3")


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
