"""experiments/sequence_maml.py: a transformer meta-learned on sequence tasks, end to end."""

from __future__ import annotations

import pytest
import torch

from metalearn.runs.lifecycle import UserError
from tests.conftest import experiment

sequence_maml = experiment("sequence_maml")


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["maml", "lora"])
def test_a_tiny_run_trains_and_tests(tmp_path, algorithm):
    threads = torch.get_num_threads()
    args = sequence_maml.Args(algorithm=algorithm, iterations=3, meta_batch=2, eval_tasks=4,
                              out_dir=str(tmp_path), track=False)  # fmt: skip
    results = sequence_maml.main(args)
    torch.set_num_threads(threads)
    assert 0.0 <= results["test/acc"] <= 1.0 and results["test/acc_ci95"] >= 0.0
    assert results["perf/step_s"] > 0


def test_bad_values_are_refused_before_training(tmp_path):
    with pytest.raises(UserError, match="--width 30: must be divisible by --heads 4"):
        sequence_maml.main(sequence_maml.Args(width=30, heads=4, out_dir=str(tmp_path),
                                              track=False))  # fmt: skip
    with pytest.raises(UserError, match="--inner-lr -1.0: must be positive"):
        sequence_maml.main(sequence_maml.Args(inner_lr=-1.0, track=False))
    assert list(tmp_path.iterdir()) == []
