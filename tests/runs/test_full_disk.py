"""A disk that fills under a run: one line naming the file and the way on, exit status 2,
the last checkpoint written kept whole, no temporary or empty file left behind.

Each run is the experiment itself, in a child process, writing into a folder whose room the
kernel bounds (`tests.helpers.small_disk.SmallDisk`: a tmpfs of its own, or a file-size
limit where mounting is not permitted): the refusal is the operating system's.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from metalearn.runs.lock import LOCK_NAME
from tests.conftest import OMNIGLOT, ROOT, needs_omniglot
from tests.helpers.small_disk import SmallDisk, temporary_files

OMNIGLOT_TINY = ["--iterations", "2", "--meta-batch", "2", "--query", "1", "--eval-query", "2",
                 "--hidden", "8", "--val-every", "1", "--val-tasks", "2", "--test-tasks", "2",
                 "--eval-inner-steps", "1", "--data-root", str(OMNIGLOT), "--threads", "1",
                 "--checkpoint-every", "1"]  # fmt: skip
RL_TINY = ["--iterations", "1", "--meta-batch", "2", "--fast-batch", "2", "--horizon", "5",
           "--hidden", "8", "--eval-tasks", "2", "--eval-inner-steps", "1",
           "--no-track"]  # fmt: skip
ROOM = 16 << 10  # bytes left: the lock file fits, no checkpoint of these runs (60 KB, 10 KB) does


def _experiment(disk: SmallDisk, script: str, *flags: str) -> str:
    """Run ``experiments/SCRIPT.py`` on the disk; assert exit 2 and no traceback; its last
    stderr line (after the progress bars)."""
    cmd = [sys.executable, str(ROOT / "experiments" / f"{script}.py"), *flags,
           "--out-dir", str(disk.folder)]  # fmt: skip
    done = disk.run(cmd)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Logging error" not in done.stderr, done.stderr
    line = done.stderr.strip().split("\r")[-1].splitlines()[-1]
    assert line.startswith("error: could not write "), line
    return line


def _nothing_left(disk: SmallDisk) -> None:
    """No temporary file of a failed write and no lock of the ended run anywhere."""
    assert temporary_files(disk.folder) == []
    assert list(disk.folder.rglob(LOCK_NAME)) == []


@needs_omniglot
@pytest.mark.parametrize("track", [False, True])
def test_a_full_disk_while_training_is_one_line_and_leaves_nothing(tmp_path, track):
    """Tracked, W&B's offline folder shares the disk: wandb-core drops what it cannot write
    without a word and wandb's own log file fails; the run's checkpoint is the one line."""
    with SmallDisk(tmp_path / "runs") as disk:
        disk.leave(ROOM)
        line = _experiment(disk, "omniglot_maml", *OMNIGLOT_TINY, "--run-name", "r",
                           *([] if track else ["--no-track"]))  # fmt: skip
        folder = disk.folder / "r"
        assert line.startswith(f"error: could not write {folder / 'checkpoint.pt'}: ")
        assert line.endswith(f"no checkpoint of the run was written: free space on the disk "
                             f"holding {folder}, then run it again")  # fmt: skip
        assert not folder.exists()  # the folder the run made, empty: removed with its lock
        _nothing_left(disk)
        assert (disk.folder / "wandb").is_dir() == track


def _resumed_on_a_full_disk(disk: SmallDisk, script: str, flags: list[str]) -> tuple[str, bytes]:
    """Train one step with room, then resume for a second with less room than a checkpoint
    takes: the resume's line, and the checkpoint's bytes before it."""
    cmd = [sys.executable, str(ROOT / "experiments" / f"{script}.py"), *flags, "--run-name",
           "r", "--out-dir", str(disk.folder), "--iterations", "1"]  # fmt: skip
    first = disk.run(cmd)
    assert first.returncode == 0, first.stderr[-3000:]
    before = (disk.folder / "r" / "checkpoint.pt").read_bytes()
    disk.leave(len(before) // 2)
    line = _experiment(disk, script, "--resume", "--run-name", "r", "--iterations", "2")
    return line, before


@needs_omniglot
def test_a_full_disk_during_a_resume_keeps_the_last_checkpoint(tmp_path):
    with SmallDisk(tmp_path / "runs") as disk:
        line, before = _resumed_on_a_full_disk(disk, "omniglot_maml", [*OMNIGLOT_TINY,
                                                                       "--no-track"])  # fmt: skip
        path = disk.folder / "r" / "checkpoint.pt"
        assert line.startswith(f"error: could not write {path}: ")
        assert line.endswith(f"{path} of meta-step 1 is kept: free space on the disk holding "
                             f"{path.parent}, then continue with --resume --run-name r "
                             f"--out-dir {disk.folder}")  # fmt: skip
        assert path.read_bytes() == before
        assert torch.load(path, weights_only=True)["iteration"] == 1
        assert sorted(os.listdir(path.parent)) == ["checkpoint.pt"]
        _nothing_left(disk)


def test_a_full_disk_in_the_meta_rl_experiment_keeps_the_last_checkpoint(tmp_path):
    with SmallDisk(tmp_path / "runs") as disk:
        line, before = _resumed_on_a_full_disk(disk, "rl_maml", RL_TINY)
        path = disk.folder / "r" / "checkpoint.pt"
        assert line.startswith(f"error: could not write {path}: ")
        assert line.endswith(f"{path} of iteration 1 is kept: free space on the disk holding "
                             f"{path.parent}, then continue with --resume --run-name r "
                             f"--out-dir {disk.folder}")  # fmt: skip
        assert path.read_bytes() == before
        assert sorted(os.listdir(path.parent)) == ["checkpoint.pt"]
        _nothing_left(disk)


def test_a_lock_that_cannot_be_written_is_removed_and_one_line(tmp_path):
    """The lock file is created (an inode) but its record finds no room: no empty lock is
    left to refuse the next run as "being taken"."""
    with SmallDisk(tmp_path / "runs") as disk:
        (disk.folder / "filler").write_bytes(b"x" * 4096)  # the tmpfs's one page, taken
        disk.leave(0)
        code = ("from metalearn.runs import lock\nfrom metalearn.runs.lifecycle import UserError\n"
                f"try:\n    with lock.held({str(disk.folder / 'r')!r}):\n        pass\n"
                "except UserError as err:\n    print(err)\n")  # fmt: skip
        done = disk.run([sys.executable, "-c", code], cwd=ROOT)
        assert done.returncode == 0 and done.stderr == "", done.stderr
        path = disk.folder / "r" / LOCK_NAME
        assert done.stdout.startswith(f"could not write the run folder's lock {path}: ")
        assert done.stdout.count("\n") == 1 and "free space on the disk holding" in done.stdout
        assert not path.exists()
