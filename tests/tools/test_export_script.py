"""metalearn-export never destroys data: an existing --out package (or --program file,
--aot package, latency table) is replaced only with --overwrite, a training checkpoint or
a folder that is no package never; every refusal is one line on stderr, exit status 2, and
leaves every file as it was; the write is atomic. (--aot's compile itself is tested in
test_aot.py.)"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from metalearn.deploy import is_run_checkpoint, load_package, load_program
from metalearn.tools import export as script
from tests.conftest import NO_OMNIGLOT, ROOT
from tests.deploy.test_deploy import CHARACTERS, _args, experiment_checkpoint, make_support_folder

pytestmark = pytest.mark.skipif(not CHARACTERS.is_dir(), reason=NO_OMNIGLOT)


@pytest.fixture
def run(tmp_path) -> tuple[Path, Path]:
    """An experiment-format checkpoint (tmp/run/checkpoint.pt) and a 5-way support folder."""
    checkpoint = experiment_checkpoint(tmp_path, _args(eval_inner_steps=2))
    return checkpoint, make_support_folder(tmp_path, shots=1)


def _files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes: what 'nothing on disk changed' compares."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _refused(capsys, argv: list[str], root: Path, message: str) -> None:
    """``argv`` exits 2 with one line naming ``message`` and leaves ``root`` untouched."""
    before = _files(root)
    assert script.main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("metalearn-export: error: "), captured.err
    assert message in lines[0], lines[0]
    assert captured.out == ""
    assert _files(root) == before


def test_prints_the_path_and_the_self_check(run, capsys) -> None:
    checkpoint, support = run
    args = script.Args(checkpoint=str(checkpoint), support=str(support), which="last",
                       dynamic_batch=False)  # fmt: skip
    report = script.export(args)
    printed = capsys.readouterr().out
    assert report.path == checkpoint.parent / "adapted" and report.path.is_dir()
    assert f"package: {report.path}" in printed and "inner steps: 2" in printed
    assert "self-check: max |package - eager| logit on the support set = 0" in printed
    assert report.max_abs_diff == 0 and report.program_path is None
    assert load_package(report.path).class_names == tuple(f"class{c}" for c in range(5))
    assert sorted(p.name for p in report.path.iterdir()) == ["package.json", "weights.safetensors"]
    assert not list(checkpoint.parent.glob(".*"))  # the atomic write left no staging folder


def test_an_existing_out_is_replaced_only_with_overwrite(run, tmp_path, capsys) -> None:
    checkpoint, support = run
    out = tmp_path / "adapted"
    argv = ["--checkpoint", str(checkpoint), "--support", str(support), "--out", str(out)]
    assert script.main([*argv, "--which", "last"]) == 0
    capsys.readouterr()
    _refused(capsys, argv, tmp_path, f"--out {out} exists; pass --overwrite")
    assert script.main([*argv, "--overwrite"]) == 0
    assert f"package: {out}" in capsys.readouterr().out
    assert load_package(out).document["source"]["which"] == "best"
    # Anything else at --out is never replaced: a file, a folder that is no package.
    (tmp_path / "kept.txt").write_bytes(b"an earlier file someone kept")
    for kept, what in ((tmp_path / "kept.txt", "a file"), (support, "a folder")):
        _refused(capsys, [*argv[:4], "--out", str(kept), "--overwrite"], tmp_path,
                 f"--out {kept} is {what}, not a metalearn package, never replaced")  # fmt: skip
    # The default --out (adapted beside the checkpoint) is refused the same way.
    (checkpoint.parent / "adapted").write_bytes(b"kept")
    _refused(capsys, argv[:4], tmp_path, "adapted is a file, not a metalearn package")


def test_the_checkpoint_is_never_the_out_even_with_overwrite(run, tmp_path, capsys) -> None:
    checkpoint, support = run
    base = ["--checkpoint", str(checkpoint), "--support", str(support), "--overwrite"]
    _refused(capsys, [*base, "--out", str(checkpoint)], tmp_path, "is the checkpoint being")
    # The same file spelled another way is still the checkpoint.
    other_spelling = checkpoint.parent / ".." / "run" / "checkpoint.pt"
    _refused(capsys, [*base, "--out", str(other_spelling)], tmp_path, "is the checkpoint being")
    assert is_run_checkpoint(checkpoint)


def test_no_training_checkpoint_is_written_over(run, tmp_path, capsys) -> None:
    checkpoint, support = run
    other = experiment_checkpoint(tmp_path / "second", _args(algorithm="anil"))
    argv = ["--checkpoint", str(checkpoint), "--support", str(support), "--out", str(other),
            "--overwrite"]  # fmt: skip
    _refused(capsys, argv, tmp_path, "is a file, not a metalearn package, never replaced")


def test_other_user_errors_are_one_line_and_change_nothing(run, tmp_path, capsys) -> None:
    checkpoint, support = run
    for given in (["--checkpoint", str(checkpoint)], ["--support", str(support)]):
        with pytest.raises(SystemExit) as stop:  # required flags: the parser's one line
            script.main(given)
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and len(err) == 1 and "Missing" in err[0], err
        assert ("--support" if "--checkpoint" in given else "--checkpoint") in err[0]
    missing = ["--checkpoint", str(tmp_path / "nope.pt"), "--support", str(support)]
    _refused(capsys, missing, tmp_path, "no checkpoint at")
    argv = ["--checkpoint", str(checkpoint), "--support", str(tmp_path / "nowhere")]
    _refused(capsys, argv, tmp_path, "does not exist or is not a folder")


def test_the_command_exits_2_with_one_line(run, tmp_path) -> None:
    checkpoint, support = run
    before = _files(tmp_path)
    command = [sys.executable, "-m", "metalearn.tools.export", "--checkpoint",
               str(checkpoint), "--support", str(support), "--out", str(checkpoint)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"metalearn-export: error: --out {checkpoint} is the checkpoint being exported; choose "
        "another --out (a package is a folder)"
    ]
    assert _files(tmp_path) == before


def test_a_crash_while_writing_leaves_the_previous_package_intact(run, tmp_path, monkeypatch):
    """Ctrl-C after the new package's files are written, before it is renamed into place."""
    import metalearn.deploy.package as package

    checkpoint, support = run
    out = tmp_path / "adapted"
    argv = ["--checkpoint", str(checkpoint), "--support", str(support), "--out", str(out)]
    assert script.main([*argv, "--which", "last"]) == 0
    before = _files(out)

    def crash(staging: Path, target: Path, overwrite: bool) -> None:
        assert sorted(p.name for p in staging.iterdir()) == ["package.json", "weights.safetensors"]
        raise KeyboardInterrupt("interrupted before the rename")

    monkeypatch.setattr(package, "_move_folder", crash)
    with pytest.raises(KeyboardInterrupt):
        script.main([*argv, "--overwrite"])
    assert _files(out) == before and load_package(out).document["source"]["which"] == "last"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapted", "run", "support-0"]


def test_program_outputs_are_refused_before_any_work(run, tmp_path, capsys) -> None:
    checkpoint, support = run
    out = tmp_path / "adapted"
    argv = ["--checkpoint", str(checkpoint), "--support", str(support), "--out", str(out),
            "--aot", "--program"]  # fmt: skip
    program = tmp_path / "adapted.pt2"
    package, table = tmp_path / "adapted.aoti.pt2", tmp_path / "adapted.latency.md"
    for path, what in ((program, "the --program file"), (package, "the --aot package")):
        path.write_bytes(b"an earlier file")
        _refused(capsys, argv, tmp_path, f"{what} {path} exists; pass --overwrite")
        path.unlink()
    table.write_text("an earlier table")
    _refused(capsys, argv, tmp_path, f"the latency table {table} exists; pass --overwrite")
    table.unlink()
    _refused(capsys, [*argv, "--latency-repeats", "0"], tmp_path, "repeats >= 1")
    # A training checkpoint where the package would go: never written over.
    experiment_checkpoint(tmp_path / "second", _args()).rename(package)
    _refused(capsys, [*argv, "--overwrite"], tmp_path, "training checkpoint, never overwritten")
    assert not out.exists()  # refused before the package was written, too


def test_the_checkpoint_is_never_the_aot_package(run, tmp_path, capsys) -> None:
    checkpoint, support = run
    source = checkpoint.rename(checkpoint.with_name("model.aoti.pt2"))
    argv = ["--checkpoint", str(source), "--support", str(support), "--out",
            str(source.with_name("model")), "--aot", "--overwrite"]  # fmt: skip
    message = f"the --aot package {source} is the checkpoint being exported; choose another --out"
    _refused(capsys, argv, tmp_path, message)


@pytest.mark.skipif(
    torch.cuda.is_available() and importlib.util.find_spec("torch_tensorrt") is not None,
    reason="TensorRT can be built here",
)
def test_tensorrt_without_its_needs_is_one_line_and_changes_nothing(run, tmp_path, capsys):
    checkpoint, support = run
    argv = ["--checkpoint", str(checkpoint), "--support", str(support), "--tensorrt"]
    _refused(capsys, argv, tmp_path, "--tensorrt needs ")


@pytest.mark.parametrize(("dataset", "shape"), [("folder", (1, 16)), ("cifar-fs", (3, 32))])
def test_a_fewshot_checkpoint_exports_a_package_for_its_own_images(tmp_path, dataset, shape):
    """A folder run (16 px grayscale) and a CIFAR-FS run (32 px RGB): the support folder is
    decoded as that run's training images, and the package and the program take them."""
    from PIL import Image

    from tests.helpers.run_helpers import checkpoint_of, fs, make

    channels, side = shape
    overrides = {"image_size": 16, "channels": 1} if dataset == "folder" else {}
    # The recipe needs no data (only an existing folder): nothing is loaded to export.
    args = make(fs, dataset=dataset, data_root=str(tmp_path), ways=3, hidden=4, device="cpu",
                **overrides)  # fmt: skip
    checkpoint = checkpoint_of(tmp_path, fs, args)
    support = tmp_path / "support"
    rng = np.random.default_rng(0)
    for c in range(3):  # RGB files of 40x40 for both: the run's decoding converts and resizes
        (support / f"c{c}").mkdir(parents=True)
        pixels = rng.integers(0, 256, (40, 40, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(support / f"c{c}" / "a.png")
    report = script.export(script.Args(checkpoint=str(checkpoint), support=str(support),
                                     out=str(tmp_path / "a"), program=True,
                                     latency_repeats=2))  # fmt: skip
    loaded = load_package(report.path)
    meta = loaded.document
    assert (meta["image"]["size"], meta["image"]["channels"]) == (side, channels)
    assert meta["image"]["invert"] is False and meta["source"]["dataset"] == dataset
    assert report.max_abs_diff == 0 and report.program_max_abs_diff <= 1e-5
    program, program_meta = load_program(report.program_path, trust=True)
    assert program_meta == {k: v for k, v in meta.items() if k != "files"}
    x = torch.rand(2, channels, side, side)
    assert program.module()(x).shape == loaded.model(x).shape == (2, 3)
    with pytest.raises(Exception):  # noqa: B017  (torch.export's guard error on the shape)
        program.module()(torch.rand(2, 1 if channels == 3 else 3, side, side))


def test_support_images_of_different_sizes_are_refused_unless_asked(run, tmp_path, capsys):
    from PIL import Image

    checkpoint, support = run
    Image.new("L", (400, 60), 255).save(support / "class0" / "wide.png")
    argv = ["--checkpoint", str(checkpoint), "--support", str(support), "--out",
            str(tmp_path / "m")]  # fmt: skip
    _refused(capsys, argv, tmp_path, "holds images of different sizes")
    assert script.main([*argv, "--mixed-sizes"]) == 0
    assert load_package(tmp_path / "m").document["source"]["mixed_sizes"] is True
