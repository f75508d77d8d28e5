"""scripts/bench_sequence.py: a tiny run prints MAML's and LoRA-MAML's rows and their ratio."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPT = [sys.executable, str(ROOT / "scripts" / "bench_sequence.py")]


@pytest.mark.slow
def test_tiny_run_prints_both_rows_and_the_ratio_of_its_own_medians():
    tiny = ["--iterations", "2", "--eval-tasks", "4", "--repeats", "2"]
    out = subprocess.run(SCRIPT + tiny, capture_output=True, text=True, check=True).stdout
    ms = {m[1]: float(m[2]) for m in re.finditer(r"^\| (maml|lora) \| ([0-9]+) \|", out, re.M)}
    assert set(ms) == {"maml", "lora"}
    ratio = float(re.search(r"over MAML's: ([0-9.]+)$", out, re.M)[1])
    assert ratio == pytest.approx(ms["lora"] / ms["maml"], rel=0.05, abs=0.02)


def test_a_count_below_one_is_one_line_and_exit_2():
    done = subprocess.run(SCRIPT + ["--iterations", "0"], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith("--iterations 0: must be at least 1")
