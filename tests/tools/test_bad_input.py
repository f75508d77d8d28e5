"""Bad input a user (or a file from elsewhere) gives is one line and exit code 2, naming
the problem, with nothing on disk overwritten: a device this torch cannot use, learning
rates that cannot train, a run that diverges, shapes the split cannot give, a checkpoint to
resume that is not one, an export to a full disk, and grid cells that are running or
damaged (the grid goes on)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from metalearn.deploy import export_program
from metalearn.runs import lock
from metalearn.runs.cli import unflatten
from metalearn.tools import grid
from tests.conftest import OMNIGLOT, ROOT, experiment, needs_omniglot
from tests.helpers.run_helpers import checkpoint_of, fs, make

DATA = OMNIGLOT
TINY = ["--iterations", "2", "--meta-batch", "2", "--query", "1", "--eval-query", "2",
        "--hidden", "8", "--val-every", "1", "--val-tasks", "2", "--test-tasks", "2",
        "--eval-inner-steps", "1", "--data-root", str(DATA), "--no-track",
        "--threads", "1"]  # fmt: skip
RL_TINY = dict(iterations=1, meta_batch=2, fast_batch=2, horizon=5, hidden=(8,), eval_tasks=2,
               eval_inner_steps=1, track=False, device="cpu")  # fmt: skip


def _run(tmp_path: Path, *flags: str, script: str = "omniglot_maml") -> str:
    """The experiment's one stderr line (after its progress bars); asserts exit 2."""
    cmd = [sys.executable, str(ROOT / "experiments" / f"{script}.py"), *TINY,
           "--out-dir", str(tmp_path / "runs"), *flags]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    line = done.stderr.strip().split("\r")[-1].splitlines()[-1]
    assert "Traceback" not in done.stderr and line.startswith("error: "), done.stderr[-2000:]
    return line


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--device", "cuda"], "--device cuda: this torch"),
     (["--inner-lr", "inf"], "--inner-lr inf: must be a positive finite number"),
     (["--inner-lr", "nan"], "--inner-lr nan: must be a positive finite number"),
     (["--outer-lr", "inf"], "--outer-lr inf: must be a positive finite number"),
     (["--outer-lr", "0"], "--outer-lr 0.0: must be a positive finite number"),
     (["--algorithm", "mamlpp", "--msl-epoch-length", "0"],
      "--msl-epoch-length 0 must be >= 1 (meta-steps per epoch of MSL"),
     (["--algorithm", "reptile", "--adapt-norm", "True"],
      "--adapt-norm is a setting of maml or fomaml or metasgd or mamlpp or protomaml or boil or "
      "metacurvature; drop it for reptile"),

     (["--train-shots", "0"], "--train-shots 0: must be at least 1")],
)  # fmt: skip
def test_refused_before_anything_runs(tmp_path, flags, message):
    if flags[0] == "--device" and torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    assert message in _run(tmp_path, *flags)
    assert not (tmp_path / "runs").exists()


def test_an_unknown_cg_negative_curvature_is_one_line_exit_2(tmp_path):
    """The parser refuses a policy that is not one of iMAML's three, naming them."""
    cmd = [sys.executable, str(ROOT / "experiments" / "omniglot_maml.py"), *TINY,
           "--out-dir", str(tmp_path / "runs"), "--algorithm", "imaml",
           "--cg-negative-curvature", "ignore"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "invalid choice 'ignore' for argument '--cg-negative-curvature'" in done.stderr
    assert all(f"'{p}'" in done.stderr for p in ("raise", "continue", "stop"))
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--inner-beta1", "1.0"], "--inner-beta1 1.0 is out of range: it must be in [0, 1)"),
     (["--inner-beta1", "1.5"], "--inner-beta1 1.5 is out of range: it must be in [0, 1)"),
     (["--inner-beta2", "1.5"], "--inner-beta2 1.5 is out of range: it must be in [0, 1)"),
     (["--inner-eps", "-1e-8"], "--inner-eps -1e-08 is out of range: it must be finite and >= 0"),
     (["--inner-eps", "inf"], "--inner-eps inf is out of range: it must be finite and >= 0"),
     (["--inner-optimizer", "momentum", "--inner-momentum", "1.5"],
      "--inner-momentum 1.5 is out of range: it must be in [0, 1)"),
     (["--inner-optimizer", "rmsprop", "--inner-alpha", "1.0"],
      "--inner-alpha 1.0 is out of range: it must be in [0, 1)"),
     (["--inner-eps", "0"], "--inner-eps 0: Adam and RMSprop divide by sqrt(v) + eps, 0 / 0 "
                            "where a gradient entry is 0 (a dead ReLU's); pass a positive "
                            "--inner-eps, e.g. 1e-8"),
     (["--inner-optimizer", "rmsprop", "--inner-eps", "0.0"], "--inner-eps 0: Adam and RMSprop")],
)  # fmt: skip
def test_inner_optimizer_settings_the_learner_refuses(tmp_path, flags, message):
    """The learner's own refusal (`InnerOptimizerLearner`), met while the arguments are
    resolved: an empty --data-root shows that nothing was loaded."""
    empty = tmp_path / "empty"
    empty.mkdir()
    adam = [] if flags[0] == "--inner-optimizer" else ["--inner-optimizer", "adam"]
    line = _run(tmp_path, "--algorithm", "maml", *adam, *flags, "--data-root", str(empty))
    assert line.startswith(f"error: {message}"), line
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("script", "flags", "message"),
    [("omniglot_maml", ["--shots", "19"],
      "--shots 19 with --eval-query 2 needs 21 examples per class; Omniglot has 20"),
     ("omniglot_maml", ["--ways", "2000"], "--ways 2000: Omniglot's val split has 400 classes"),
     ("omniglot_maml", ["--algorithm", "protonet", "--train-ways", "5000"],
      "--train-ways 5000: Omniglot's train split has 4400 classes"),
     ("omniglot_maml", ["--train-shots", "20"],
      "--train-shots 20 with --query 1 needs 21 examples per class; Omniglot has 20"),
     ("omniglot_maml", ["--split", "alphabet", "--eval-protocol", "within-alphabet", "--ways",
                        "50"], "--ways 50: Omniglot's val split has 46 classes in its largest"),
     ("fewshot_maml", ["--dataset", "mini-imagenet", "--ways", "17"],
      "--ways 17: mini-ImageNet's val split has 16 classes")],
)  # fmt: skip
def test_shapes_the_data_cannot_give_are_refused_before_it_loads(tmp_path, script, flags,
                                                                 message):  # fmt: skip
    """From the published sizes (`metalearn.data.check_task_sizes`): the --data-root given
    is empty, so a refusal that came from loading would name the missing files."""
    empty = tmp_path / "empty"
    empty.mkdir()
    line = _run(tmp_path, *flags, "--data-root", str(empty), script=script)
    assert line.startswith(f"error: {message}"), line
    assert not (tmp_path / "runs").exists()


def test_an_image_side_no_data_set_has_is_refused_before_the_data_loads(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    line = _run(tmp_path, "--dataset", "folder", "--data-root", str(empty), "--image-size",
                "100000", script="fewshot_maml")  # fmt: skip
    assert line == "error: image_size 100000: must be from 1 to 1024 pixels, or unset"
    assert not (tmp_path / "runs").exists()


def test_online_tracking_without_an_api_key_is_refused_before_the_data_loads(tmp_path):
    """No key in the environment or a netrc file: wandb's init would fail (or ask for a key)
    after the data was read; the data root given is empty, so a refusal there would name it."""
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "WANDB_MODE")}
    env.update(HOME=str(tmp_path / "home"), NETRC=str(tmp_path / "no-netrc"))
    runs = {"omniglot_maml": [*TINY, "--data-root", str(empty)], "rl_maml": ["--iterations", "1"],
            "sine_maml": ["--iterations", "1"]}  # fmt: skip
    for script, flags in runs.items():
        cmd = [sys.executable, str(ROOT / "experiments" / f"{script}.py"), *flags, "--track",
               "--wandb-mode", "online", "--out-dir", str(tmp_path / "runs")]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 2, done.stderr[-2000:]
        assert done.stderr.strip().splitlines() == [
            "error: --wandb-mode online needs a W&B API key and none is set: run `wandb login` "
            "(or set WANDB_API_KEY), or pass --wandb-mode offline (`wandb sync` later)"
        ], script
        assert not (tmp_path / "runs").exists()


def test_a_reader_that_leaves_ends_the_run_quietly_and_leaves_no_lock(tmp_path):
    """``omniglot_maml.py | head -1`` once the line is read: its first print (the checkpoint's
    path) fails; the run ends with status 141 before it trains, its lock and folder removed."""
    from tests.tools.test_tools import closed_stdout

    cmd = [sys.executable, str(ROOT / "experiments" / "omniglot_maml.py"), *TINY, "--out-dir",
           str(tmp_path / "runs"), "--run-name", "r"]  # fmt: skip
    done = closed_stdout(cmd)
    assert done.returncode == 141 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "runs" / "r").exists()


@needs_omniglot
def test_a_diverging_run_names_the_meta_step_and_the_flag(tmp_path):
    # The norm layers adapted (--adapt-norm True): held fixed, the losses stay finite.
    line = _run(tmp_path, "--algorithm", "maml", "--inner-lr", "1e30", "--inner-steps", "5",
                "--adapt-norm", "True", "--run-name", "d")  # fmt: skip
    assert line.startswith("error: meta-step ") and ", task " in line
    assert "non-finite" in line and "--on-nonfinite skip" in line and "\n" not in line
    saved = torch.load(tmp_path / "runs" / "d" / "checkpoint.pt", weights_only=True)
    assert saved["recipe"]["learner"]["arguments"]["on_nonfinite"] == "raise"


def test_an_overflowing_meta_gradient_is_not_taken_even_when_skipping(tmp_path):
    # --inner-lr 200 on a fewshot image folder: the losses stay finite (about 1e18) while the
    # meta-gradient overflows; --on-nonfinite skip drops tasks with non-finite losses only.
    # The norm layers adapted (--adapt-norm True), as the run this reproduces.
    from tests.helpers.image_set_fixtures import write_folder

    folder = write_folder(tmp_path / "folder")
    line = _run(tmp_path, "--dataset", "folder", "--data-root", str(folder), "--image-size",
                "16", "--channels", "1", "--ways", "3", "--shots", "1", "--hidden", "4",
                "--inner-lr", "200", "--inner-steps", "5", "--on-nonfinite", "skip",
                "--adapt-norm", "True", "--run-name", "d", script="fewshot_maml")  # fmt: skip
    assert line.startswith("error: meta-step 1: non-finite meta-gradient of model.")
    assert "from finite losses" in line and "the step was not taken" in line
    saved = torch.load(tmp_path / "runs" / "d" / "checkpoint.pt", weights_only=True)
    assert saved["iteration"] == 0
    assert saved["recipe"]["learner"]["arguments"]["on_nonfinite"] == "skip"
    assert all(v.isfinite().all() for v in saved["learner"].values() if v.is_floating_point())


@needs_omniglot
@pytest.mark.parametrize("kind", ["truncated", "empty", "foreign", "fewshot", "rl"])
def test_resuming_what_is_not_this_experiments_checkpoint(tmp_path, kind):
    folder = tmp_path / "runs" / "r"
    folder.mkdir(parents=True)
    path = folder / "checkpoint.pt"
    if kind == "rl":  # a meta-RL run's checkpoint, written by experiments/rl_maml.py
        rl_maml = experiment("rl_maml")
        rl_maml.main(unflatten(rl_maml.Args, {**RL_TINY, "out_dir": str(tmp_path / "rl"),
                                              "run_name": "q"}))  # fmt: skip
        os.replace(tmp_path / "rl" / "q" / "checkpoint.pt", path)
    elif kind == "fewshot":
        args = make(fs, dataset="folder", data_root=str(tmp_path), out_dir=str(tmp_path),
                    track=False, device="cpu", hidden=4, image_size=16)  # fmt: skip
        os.replace(checkpoint_of(tmp_path, fs, args), path)
    elif kind == "foreign":
        torch.save({"state_dict": {"w": torch.ones(2)}}, path)
    elif kind == "truncated":
        torch.save({"args": {"w": torch.ones(1000)}}, path)
        path.write_bytes(path.read_bytes()[:300])
    else:
        path.write_bytes(b"")
    before = path.read_bytes()
    line = _run(tmp_path, "--resume", "--run-name", "r")
    expected = {"truncated": "cannot be read as a checkpoint", "empty": "cannot be read",
                "foreign": "is not a metalearn run's checkpoint",
                "fewshot": "is a run of experiments/fewshot_maml.py",
                "rl": "is a run of experiments/rl_maml.py, not of experiments/omniglot_maml.py; "
                      "resume it with that script"}[kind]  # fmt: skip
    assert str(path) in line and expected in line
    assert path.read_bytes() == before
    if kind == "rl":  # the few-shot experiment names the owner too
        line = _run(tmp_path, "--resume", "--run-name", "r", script="fewshot_maml")
        assert line == (f"error: {path} is a run of experiments/rl_maml.py, not of "
                        "experiments/fewshot_maml.py; resume it with that script")  # fmt: skip
        assert path.read_bytes() == before


def test_a_program_to_a_full_disk_is_one_line_and_keeps_the_old_file(tmp_path, monkeypatch):
    """The disk fills while the program is written (the real `write_atomically`; only the
    bytes it is handed stop with ENOSPC halfway)."""
    import metalearn.deploy.program as program

    target = tmp_path / "adapted.pt2"
    target.write_bytes(b"the previous export")
    real = program.write_atomically

    def full(path, data, **kwargs):
        def half_then_full(file) -> None:
            file.write(bytes(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        return real(path, half_then_full, **kwargs)

    monkeypatch.setattr(program, "write_atomically", full)
    model, x = torch.nn.Linear(4, 3), torch.randn(2, 4)
    with pytest.raises(ValueError) as info:
        export_program(model, x, target, overwrite=True)
    monkeypatch.undo()
    assert str(info.value) == (
        f"could not write --program {target}: No space left on device; free space on the "
        f"disk holding {tmp_path}, or write elsewhere (nothing was replaced)"
    )
    assert target.read_bytes() == b"the previous export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapted.pt2"]


def test_the_grid_skips_a_running_and_a_damaged_cell(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # the grid's experiments/omniglot_maml.py
    argv = ["--seeds", "0", "1", "--out-dir", str(tmp_path), "--group", "g", "--",
            "--iterations=1", f"--data-root={DATA}", "--device=cpu"]  # fmt: skip
    running, damaged = grid.plan(argv)[1]
    (tmp_path / damaged.name).mkdir()
    (tmp_path / damaged.name / "checkpoint.pt").write_bytes(b"PK\x03\x04 cut short")
    with lock.held(tmp_path / running.name):
        assert grid.main(argv) == 1
    out = capsys.readouterr().out
    assert f"SKIPPED {running.name}: running now, by process {os.getpid()}" in out
    assert (
        f"SKIPPED {damaged.name}: {tmp_path / damaged.name / 'checkpoint.pt'} cannot be read" in out
    )
    assert f"| {running.name} | not finished |" in out and "Traceback" not in out
    assert (tmp_path / damaged.name / "checkpoint.pt").read_bytes() == b"PK\x03\x04 cut short"
