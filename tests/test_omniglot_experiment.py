"""experiments/omniglot_maml.py on the real Omniglot data: runs, logs, checkpoints, resumes."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import omniglot_maml as om  # noqa: E402

from metalearn.checkpoint import load_checkpoint  # noqa: E402
from metalearn.tracking import read_offline_run  # noqa: E402

DATA = Path(os.environ.get("METALEARN_DATA", ROOT.parent / "shared" / "data" / "omniglot"))
pytestmark = pytest.mark.skipif(
    not (DATA / "images_background").is_dir(),
    reason="full Omniglot not found: set METALEARN_DATA or put it at ../shared/data/omniglot",
)


def tiny_args(tmp_path: Path, **overrides) -> om.Args:
    """Two meta-steps of a small conv4: the real code path, sized for a test."""
    base = om.Args(
        iterations=2, meta_batch=2, query=1, eval_query=2, hidden=8, val_every=1, val_tasks=3,
        test_tasks=4, eval_inner_steps=2, checkpoint_every=1, data_root=str(DATA),
        out_dir=str(tmp_path), track=False, device="cpu",
    )  # fmt: skip
    return replace(base, **overrides)


def test_two_meta_steps_log_to_wandb_and_report_test_accuracy(tmp_path):
    results = om.main(tiny_args(tmp_path, track=True, wandb_mode="offline"))
    assert 0.0 <= results["test/acc"] <= 1.0 and results["test/acc_ci95"] >= 0.0
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    record = read_offline_run(run_dir)
    assert record.config["algorithm"] == "maml" and record.config["split"] == "maml"
    assert record.config["dataset"] == "omniglot" and "git_commit" in record.config
    assert len(record.series("train/loss")[1]) == 2 and record.series("val/acc")[1]
    assert record.summary["test/acc"] == pytest.approx(results["test/acc"])
    assert "maml" in record.tags and "5w1s" in record.tags


def _final_weights(tmp_path: Path, name: str) -> dict[str, torch.Tensor]:
    return load_checkpoint(tmp_path / name / "checkpoint.pt")["learner"]


def test_resume_reaches_the_uninterrupted_result(tmp_path):
    om.main(tiny_args(tmp_path, iterations=4, run_name="straight"))
    om.main(tiny_args(tmp_path, iterations=2, run_name="split"))
    om.main(tiny_args(tmp_path, iterations=4, run_name="split", resume=True))
    straight, split = _final_weights(tmp_path, "straight"), _final_weights(tmp_path, "split")
    for key in straight:
        assert torch.equal(straight[key], split[key]), key


def test_an_interrupted_run_keeps_its_last_step_and_resumes(tmp_path, monkeypatch):
    om.main(tiny_args(tmp_path, iterations=4, run_name="straight"))
    original = om.MetaLearner.backward
    calls = {"n": 0}

    def flaky_backward(self, tasks):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("simulated Ctrl-C / SIGTERM")
        return original(self, tasks)

    monkeypatch.setattr(om.MetaLearner, "backward", flaky_backward)
    with pytest.raises(KeyboardInterrupt):
        om.main(tiny_args(tmp_path, iterations=4, run_name="killed"))
    assert load_checkpoint(tmp_path / "killed" / "checkpoint.pt")["iteration"] == 2
    monkeypatch.setattr(om.MetaLearner, "backward", original)
    om.main(tiny_args(tmp_path, iterations=4, run_name="killed", resume=True))
    straight, resumed = _final_weights(tmp_path, "straight"), _final_weights(tmp_path, "killed")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_clear_errors_for_resume_mistakes(tmp_path):
    with pytest.raises(FileNotFoundError, match="drop --resume"):
        om.main(tiny_args(tmp_path, run_name="nothing-here", resume=True))
    om.main(tiny_args(tmp_path, iterations=1, run_name="done"))
    with pytest.raises(FileExistsError, match="pass --resume"):
        om.main(tiny_args(tmp_path, iterations=1, run_name="done"))


@pytest.mark.parametrize("algorithm", ["fomaml", "anil", "metasgd", "mamlpp", "imaml", "reptile"])
def test_every_algorithm_runs_a_meta_step(tmp_path, algorithm):
    results = om.main(tiny_args(tmp_path, algorithm=algorithm, iterations=1, test_tasks=2))
    assert 0.0 <= results["test/acc"] <= 1.0


def test_help_lists_every_documented_flag(capsys):
    with pytest.raises(SystemExit):
        om.parse_dataclass(om.Args, ["--help"], presets=om.PRESETS)
    out = capsys.readouterr().out
    assert "95%" in out and "--no-track" in out and "--resume" in out


def test_presets_and_flags():
    args = om.parse_dataclass(om.Args, ["--preset", "paper-20w1s", "--iterations", "5"],
                              presets=om.PRESETS)  # fmt: skip
    assert (args.ways, args.meta_batch, args.inner_lr, args.inner_steps) == (20, 16, 0.1, 5)
    assert args.iterations == 5  # an explicit flag wins over the preset
