"""scripts/gpu_check.sh: its syntax, its help, and that bad arguments stop it before any work.

No part of the check is run here (it runs benchmarks); ``--quick --device cpu`` is its dry
run, by hand.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = ["bash", str(SCRIPT), "--python", sys.executable, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_help_names_every_option_and_part() -> None:
    done = run("--help")
    assert done.returncode == 0, done.stderr
    for word in ("--out", "--data-root", "--device", "--quick", "--iterations", "--skip"):
        assert word in done.stdout
    for part in ("tests", "bench_maml", "bench_hvp", "bench_chunks", "omniglot"):
        assert f"\n  {part} " in done.stdout


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("--bogus",), "--bogus"),
        (("--iterations", "ten"), "--iterations"),
        (("--skip", "everything"), "--skip"),
        (("--data-root", "/nonexistent/omniglot"), "--data-root"),
        (("--out",), "--out"),
    ],
)
def test_bad_argument_is_one_line_naming_it(args: tuple[str, ...], named: str) -> None:
    done = run(*args)
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and named in done.stderr


def test_existing_results_are_not_overwritten(tmp_path: Path) -> None:
    kept = tmp_path / "summary.md"
    kept.write_text("earlier results\n")
    done = run("--out", str(tmp_path), "--device", "cpu")
    assert done.returncode == 2 and "already holds files" in done.stderr
    assert kept.read_text() == "earlier results\n"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.md"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_device_names_the_fix(tmp_path: Path) -> None:
    done = run("--out", str(tmp_path / "out"), "--device", "cuda")
    assert done.returncode == 2 and "--device cpu" in done.stderr
    assert not (tmp_path / "out").exists()
