"""Tracking: runs made offline here are read back by wandb's own reader and compared."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from metalearn.tracking import decide_mode, graceful_shutdown, init_run, read_offline_run

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import compare_runs  # noqa: E402


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
    record = read_offline_run(second)
    assert record.name == "lr0.4" and record.group == "sweep" and "maml" in record.tags
    assert record.config["inner_lr"] == 0.4 and "git_commit" in record.config
    assert record.state == "finished"
    steps, losses = record.series("train/loss")
    assert steps == [0, 1, 2, 3]
    assert losses == pytest.approx([1 / 2, 1 / 3, 1 / 4, 1 / 5])
    assert record.summary["test/acc"] == pytest.approx(0.91)


def test_compare_runs_table_and_plot(tmp_path, capsys):
    _make_runs(tmp_path)
    out = tmp_path / "cmp.png"
    text = compare_runs.main([str(tmp_path / "wandb"), "--out", str(out)])
    header, _, row1, row2 = text.splitlines()  # runs in the order they were started
    assert "inner_lr" in header and "seed" not in header  # only differing config keys
    assert "val/acc (best)" in header
    assert "| lr0.1 |" in row1 and "0.8" in row1  # best val/acc = 0.5 + 0.3
    assert "| lr0.4 |" in row2 and "0.2" in row2  # final train/loss = 1/5
    assert out.stat().st_size > 0


def test_compare_runs_names_a_bad_source(tmp_path):
    with pytest.raises(FileNotFoundError, match="no W&B runs"):
        compare_runs.main([str(tmp_path)])


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
        from metalearn.tracking import graceful_shutdown
        try:
            with graceful_shutdown():
                os.kill(os.getpid(), signal.SIGTERM)
                sys.exit("signal was not turned into KeyboardInterrupt")
        except KeyboardInterrupt:
            print("cleaned up")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0 and "cleaned up" in done.stdout
    with graceful_shutdown():
        pass
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
