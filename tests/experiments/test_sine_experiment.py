"""experiments/sine_maml.py: a short run already beats training from scratch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import wandb

from metalearn.runs.lifecycle import UserError
from metalearn.runs.records import read_offline_run
from tests.conftest import ROOT, experiment

sine_maml = experiment("sine_maml")


def test_short_run_beats_scratch_and_logs_the_plot(tmp_path):
    threads = torch.get_num_threads()
    args = sine_maml.Args(iterations=300, eval_tasks=100, out_dir=str(tmp_path),
                          wandb_mode="offline")  # fmt: skip
    results = sine_maml.main(args)
    torch.set_num_threads(threads)
    # The same network, the same support points and steps: only the initialisation differs.
    assert results["test/mse_1step"] < 0.8 * results["test/scratch_mse_1step"]
    assert results["test/mse_10step"] < results["test/mse_1step"] < results["test/mse_0step"]
    assert (tmp_path / "sine_maml.png").stat().st_size > 0
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    wandb.teardown()  # finish() may return before the .wandb file is complete
    record = read_offline_run(run_dir)
    assert record.summary["test/mse_1step"] == results["test/mse_1step"]
    assert "test/adapted_curves" in record.summary


def test_bad_values_are_refused_before_training(tmp_path):
    with pytest.raises(UserError, match="--inner-lr -1.0: must be positive"):
        sine_maml.main(sine_maml.Args(inner_lr=-1.0, out_dir=str(tmp_path), track=False))
    assert list(tmp_path.iterdir()) == []


def test_without_matplotlib_the_results_print_and_the_plot_is_skipped(tmp_path):
    code = (
        "import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = ['sine_maml', "
        f"'--iterations', '3', '--eval-tasks', '4', '--no-track', '--out-dir', "
        f"{str(tmp_path)!r}]; runpy.run_path('experiments/sine_maml.py', run_name='__main__')"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert "matplotlib not installed (pip install matplotlib): skipping the plot" in lines
    assert lines[-4].split() == ["steps", "MAML", "MSE", "scratch", "MSE"]
    assert [line.split()[0] for line in lines[-3:]] == ["0", "1", "10"]
    assert not any(line.startswith("plot:") for line in lines) and "Traceback" not in done.stderr
    assert not (tmp_path / "sine_maml.png").exists()


def test_a_reader_that_leaves_ends_the_run_quietly_after_its_plot(tmp_path):
    """stdout's reader gone (``| head -1``): status 141, no traceback; the plot, written
    before the results print, is whole."""
    from tests.tools.test_tools import closed_stdout

    done = closed_stdout([sys.executable, str(ROOT / "experiments" / "sine_maml.py"),
                          "--iterations", "3", "--eval-tasks", "4", "--no-track", "--out-dir",
                          str(tmp_path)])  # fmt: skip
    assert done.returncode == 141, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
    assert (tmp_path / "sine_maml.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob(".*.tmp"))
