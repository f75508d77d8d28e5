"""Every hostile file of `tests.helpers.hostile_programs` (each shown live under torch alone
in test_hostile_programs_live.py) against metalearn's loaders: nothing runs, nothing is
written outside, and each is one line.

A ``.pt2`` is a program: without ``trust`` no loader opens it (`load_package` takes only a
folder, `load_program` and `load_aot` refuse, `predict` and ``metalearn-predict`` say so in
one line, exit 2), so the guard, the renamed placeholder, the file overwrite, the three zip
differentials, the zip bomb and the sympy tower are each refused before one byte of them
is read. Around each: a marker or victim file that the payload would create or change, and
the folder holding the hostile file, watched (its listing and bytes before and after).
Also the other doors the package's readers have: a FIFO named like an image (predict and
export), a planted symbolic link at the name a fixed temporary file would use, the forged
numpy dtype through `safe_pickle`, and a checkpoint whose recorded data root holds a
hostile pickle.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from metalearn.data.safe_pickle import load_pickle
from metalearn.deploy import (
    PackageError,
    UntrustedProgramError,
    load_aot,
    load_package,
    load_program,
    predict,
)
from metalearn.tools import evaluate
from metalearn.tools import export as export_tool
from metalearn.tools import predict as predict_tool
from tests.conftest import ROOT
from tests.helpers import hostile_programs as hostile
from tests.helpers.packages import SIDE, genuine
from tests.helpers.pickle_writers import hidden
from tests.helpers.run_helpers import checkpoint_of, fs, make

BUILDERS: dict[str, Callable[[Path, Path], Path]] = {
    "guard": hostile.build_guard_program,
    "placeholder": hostile.build_placeholder_default,
    "file overwrite": hostile.build_file_overwrite,
    "hidden pickle": hostile.build_hidden_pickle,
    "hidden library": hostile.build_hidden_library,
    "hidden escape": hostile.build_hidden_escape,
    "zip bomb": hostile.build_zip_bomb,
    "sympy tower": hostile.build_tower_expression,
}


def _snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every entry under ``folder`` (files with their bytes): the watched parent."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}  # fmt: skip


def _images(folder: Path) -> Path:
    from PIL import Image

    folder.mkdir()
    Image.new("L", (SIDE, SIDE), 200).save(folder / "a.png")
    return folder


@pytest.mark.parametrize("name", list(BUILDERS))
def test_a_hostile_program_is_refused_by_every_loader_and_runs_nothing(
    tmp_path, capsys, name
) -> None:
    if name == "hidden library" and hostile.compiler() is None:
        pytest.skip("no C compiler to build the hostile library with")
    folder, outside = tmp_path / "given", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    marker = outside / "marker"
    if name == "file overwrite":
        marker.write_bytes(b"the victim's own bytes")
    path = BUILDERS[name](folder, marker)
    images = _images(tmp_path / "images")
    before, before_outside = _snapshot(folder), _snapshot(outside)
    x = torch.zeros(1, 4)
    for load, error, match in (
        (lambda: load_package(path), PackageError, "is a file, not a package"),
        (lambda: load_program(path), UntrustedProgramError, "runs code from the file"),
        (lambda: load_aot(path), UntrustedProgramError, "native code"),
        (lambda: predict(path, x), UntrustedProgramError, "runs code from the file"),
    ):
        with pytest.raises(error, match=match) as info:
            load()
        assert "\n" not in str(info.value)
    code = predict_tool.main(["--model", str(path), "--images", str(images)])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    assert captured.err.splitlines() == [
        f"metalearn-predict: error: {path} is a program file (.pt2, code): loading it runs "
        "code from the file; load only programs you compiled yourself, with trust=True "
        "(--trust), and take a package (a folder written by metalearn-export) from anyone else"
    ]
    assert _snapshot(folder) == before and _snapshot(outside) == before_outside
    assert not (Path.cwd() / "marker").exists()


def test_a_program_read_by_torch_alone_would_have_run(tmp_path) -> None:
    """The control: the guard program loaded with trust (torch.export.load, what --trust
    means) runs its payload on a call, so the refusals above kept it from running."""
    marker = tmp_path / "marker"
    path = hostile.build_guard_program(tmp_path, marker)
    program, _ = load_program(path, trust=True)
    with pytest.raises(Exception):  # noqa: B017  (the guard fails after its payload ran)
        program.module()(torch.randn(2, 4))
    assert marker.exists()


def test_a_fifo_named_like_an_image_is_refused_without_waiting(tmp_path, capsys) -> None:
    """predict's --images and export's --support: each FIFO is refused in one line (the
    commands run in a child process with a timeout, so a blocking open fails the test)."""
    from PIL import Image

    package, _ = genuine(tmp_path / "p")
    images = _images(tmp_path / "images")
    os.mkfifo(images / "f.png")
    support = tmp_path / "support"
    for c in range(3):
        (support / f"c{c}").mkdir(parents=True)
        Image.new("L", (SIDE, SIDE), 100 * c).save(support / f"c{c}" / "a.png")
    os.mkfifo(support / "c0" / "f.png")
    checkpoint = checkpoint_of(tmp_path / "run", fs, make(
        fs, dataset="folder", ways=3, hidden=4, data_root=str(tmp_path), image_size=16,
        channels=1, device="cpu"))  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    commands = [
        (predict_tool, ["--model", str(package), "--images", str(images)], images / "f.png"),
        (export_tool, ["--checkpoint", str(checkpoint), "--support", str(support), "--out",
                       str(tmp_path / "adapted")], support / "c0" / "f.png"),
    ]  # fmt: skip
    for tool, argv, fifo in commands:
        done = subprocess.run([sys.executable, "-m", tool.__name__, *argv], capture_output=True,
                              text=True, timeout=300, env=env)  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert done.stderr.splitlines() == [
            f"{tool.PROG}: error: image {fifo} is a FIFO (named pipe); give a regular file"
        ]
    assert not (tmp_path / "adapted").exists()


def test_out_is_written_through_a_fresh_name_never_a_planted_link(tmp_path, capsys) -> None:
    package, _ = genuine(tmp_path / "p")
    images = _images(tmp_path / "images")
    victim, out = tmp_path / "victim", tmp_path / "preds.csv"
    victim.write_text("the victim's own text")
    for planted in (".preds.csv.part", ".preds.csv.tmp", "preds.csv.tmp"):
        (tmp_path / planted).symlink_to(victim)
    argv = ["--model", str(package), "--images", str(images), "--format", "csv", "--out", str(out)]
    assert predict_tool.main(argv) == 0
    assert victim.read_text() == "the victim's own text"
    assert out.read_text().splitlines()[0] == "file,class,alpha,beta,gamma"


def test_the_forged_dtype_is_refused_by_safe_pickle(tmp_path) -> None:
    path = tmp_path / "forged.pkl"
    path.write_bytes(hostile.forged_dtype_pickle())
    with pytest.raises(ValueError, match="refusing to unpickle the dtype dtype\\('O'\\)") as info:
        load_pickle(path)
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_a_checkpoint_naming_a_folder_of_hostile_pickles_runs_nothing(tmp_path, capsys):
    """The checkpoint itself passes weights_only=True; its recorded data root names a
    mini-ImageNet folder whose pickle would run code: evaluate refuses it in one line."""
    marker = tmp_path / "marker"
    data = tmp_path / "mini"
    data.mkdir()
    name, pickled = hidden(str(marker), lambda p: {"image_data": p, "class_dict": {}})
    for split in ("train", "val", "test"):
        (data / f"mini-imagenet-cache-{split}.pkl").write_bytes(pickled)
    args = make(fs, dataset="mini-imagenet", data_root=str(data), out_dir=str(tmp_path / "runs"),
                track=False, device="cpu", hidden=4)  # fmt: skip
    checkpoint = checkpoint_of(tmp_path / "runs", fs, args)
    code = evaluate.main(["--checkpoint", str(checkpoint), "--no-track", "--tasks", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"mini-imagenet-cache-test.pkl: refusing to unpickle {name}" in err[0]
    assert not marker.exists()
