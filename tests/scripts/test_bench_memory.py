"""scripts/bench_memory.py: its arguments, and tiny runs end to end (no timings asserted)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.conftest import script

bench_memory = script("bench_memory")

TINY = bench_memory.Workload(inner_steps=1, query=1, tasks=2, threads=1, repeats=1)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("--chunk-size 0", "--chunk-size: expected auto, none or a positive integer, got '0'"),
        ("--query 0", "--query: expected a positive integer, got 0"),
        ("--model vgg", "invalid choice 'vgg' for argument '--model'"),
        ("--algorithm reptile", "invalid choice 'reptile' for argument '--algorithm'"),
        ("--suite --checkpoint", "--suite chooses each row's model"),
        ("--limit-gb -1", "--limit-gb must be >= 0"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(argv: str, message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_memory.parse_args(argv.split())
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in last, last


def test_each_configuration_round_trips_through_its_flags() -> None:
    # The subprocess rebuilds its configuration from Config.argv: it must be the same one.
    for config in bench_memory.SUITE:
        configs, work, is_probe = bench_memory.parse_args([*config.argv(), "--tasks", "3"])
        assert configs == [config] and work.tasks == 3 and not is_probe
    configs, _, _ = bench_memory.parse_args(["--chunk-size", "none"])
    assert configs[0].chunk_size is None
    configs, _, _ = bench_memory.parse_args(["--suite"])
    assert configs == list(bench_memory.SUITE)


def test_a_tiny_run_prints_its_table(capsys) -> None:
    config = bench_memory.Config("conv4-84", "maml")
    table = bench_memory.main([config], TINY)
    assert "measured: conv4-84 | maml" in capsys.readouterr().out
    header, rule, row = table.splitlines()
    assert header.startswith("| model | algorithm |") and "peak RSS MB" in header
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:5] == ["conv4-84", "maml", "auto", "off", "vmap, 1x2"]
    peak, above, seconds = float(cells[5]), float(cells[6]), float(cells[7])
    assert 0 < above < peak < 8 * 1024  # torch alone is hundreds of MB
    assert seconds > 0 and cells[8] == "yes"


def test_a_run_over_the_limit_says_so() -> None:
    # 0.3 GB is less than the tiny step needs (about 0.45 GB of RSS): torch's allocator fails.
    work = dataclasses.replace(TINY, limit_gb=0.3)
    table = bench_memory.main([bench_memory.Config("conv4-84", "fomaml")], work)
    row = [c.strip() for c in table.splitlines()[-1].strip("|").split("|")]
    assert row[5] == "over 0.3 GB" and row[-1] == "no"


def test_the_omniglot_conv4_gets_omniglot_images() -> None:
    work = dataclasses.replace(TINY, tasks=2, query=1)
    tasks = bench_memory.make_tasks(work, "conv4-28")
    model = bench_memory.make_model("conv4-28")
    assert tasks[0].support[0].shape == (5, 1, 28, 28) and tasks[0].query[0].shape == (5, 1, 28, 28)
    assert sum(p.numel() for p in model.parameters()) == 112_261  # MAML's Omniglot Conv4
    assert model(tasks[0].query[0]).shape == (5, 5)
    assert bench_memory.make_tasks(work)[0].support[0].shape == (5, 3, 84, 84)
