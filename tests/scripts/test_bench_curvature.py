"""scripts/bench_curvature.py: a tiny run prints its table and the fraction it derives."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import OMNIGLOT, ROOT, needs_omniglot

DATA = OMNIGLOT
SCRIPT = [sys.executable, str(ROOT / "scripts" / "bench_curvature.py")]


@needs_omniglot
def test_tiny_run_prints_the_fraction_of_its_own_medians():
    tiny = ["--data-root", str(DATA), "--steps", "2", "--repeats", "1", "--meta-batch", "2",
            "--hidden", "4", "--probe-tasks", "2", "--every", "50"]  # fmt: skip
    out = subprocess.run(SCRIPT + tiny, capture_output=True, text=True, check=True).stdout
    step = float(re.search(r"^\| meta-step \| ([0-9.]+) ", out, re.M).group(1))
    curv = float(re.search(r"^\| curvature measurement \| ([0-9.]+) ", out, re.M).group(1))
    fraction = float(re.fullmatch(r"curvature_fraction: ([0-9.]+)", out.splitlines()[-1])[1])
    # the table rounds the medians (3 and 2 decimals): the fraction agrees to that rounding
    assert fraction == pytest.approx(curv / (50 * step), rel=0.2)


def test_a_count_below_one_is_one_line_and_exit_2():
    done = subprocess.run(SCRIPT + ["--every", "0"], capture_output=True, text=True)
    assert done.returncode == 2 and "every count must be at least 1" in done.stderr
