"""scripts/bench_maml.py: its statistics, and one tiny run end to end (no timings asserted)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import script

bench_maml = script("bench_maml")


def test_paired_ratios_pair_each_round_and_middle_half_is_the_quartiles() -> None:
    timed = bench_maml.Timings(
        seconds={"learn2learn": [4.0, 6.0, 3.0, 9.0, 5.0], "auto": [2.0, 2.0, 1.0, 3.0, 2.5]},
        faults={"learn2learn": [0] * 5, "auto": [0] * 5},
        auto_plan="vmap, 1x32",
    )
    ratios = bench_maml.paired_ratios(timed, "learn2learn", "auto")
    assert ratios == [2.0, 3.0, 3.0, 3.0, 2.0]
    values = [1.0, 7.0, 2.0, 5.0, 3.0, 11.0]
    low, high = bench_maml.middle_half(values)
    assert (low, high) == pytest.approx(tuple(np.percentile(values, [25, 75])))
    assert bench_maml.middle_half([2.5]) == (2.5, 2.5)


def test_a_tiny_run_prints_its_tables_and_says_why_there_is_no_headline(capsys) -> None:
    # --malloc default: "tuned" would change this pytest process's malloc for later tests.
    args = bench_maml.parse_args(
        "--tasks 2 --repeats 2 --warmup 0 --settings q1-first --methods loop,auto "
        "--no-memory --no-float64-check --malloc default".split()
    )
    last = bench_maml.main(args)
    out = capsys.readouterr().out
    assert last.startswith("speedup_vs_learn2learn: n/a"), last
    assert "| q1-first |" in out and "auto ran" in out


def test_inner_adam_runs_and_compares_with_higher(capsys) -> None:
    args = bench_maml.parse_args(
        "--tasks 2 --repeats 1 --warmup 0 --settings q1-second --methods auto,learn2learn "
        "--inner-optimizer adam --no-memory --no-float64-check --malloc default".split()
    )
    last = bench_maml.main(args)
    out = capsys.readouterr().out
    assert last.startswith("speedup_vs_higher: n/a"), last
    assert "skipping learn2learn: it has no differentiable adam" in out
    assert "inner Adam" in out and "higher / auto" in out
