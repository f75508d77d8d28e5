"""experiments/sine_maml.py: a short run already beats training from scratch."""

from __future__ import annotations

import pytest
import torch
import wandb

from metalearn.runs.lifecycle import UserError
from metalearn.runs.records import read_offline_run
from tests.conftest import experiment

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
