"""scripts/bench_maml.py's ``torchopt`` method: verified against metalearn before it is timed,
and its ``speedup_vs_torchopt`` line printed before the last line (no timings asserted).

TorchOpt lives in the baselines environment: ``.venv-baselines/bin/python -m pytest -q -m
baselines``.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.conftest import script

bench_maml = script("bench_maml")


@pytest.mark.baselines("torchopt")
@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_torchopt_is_verified_then_timed_and_has_its_speedup_line(inner, capsys) -> None:
    args = bench_maml.parse_args(
        f"--tasks 2 --repeats 1 --warmup 0 --settings q1-second --methods auto,torchopt "
        f"--inner-optimizer {inner} --no-memory --malloc default".split()
    )
    last = bench_maml.main(args)
    out = capsys.readouterr().out
    assert torch.get_default_dtype() == torch.float32  # restored after TorchOpt's steps
    verified = re.search(r"torchopt verified before timing, q1-second: float64 meta-gradient "
                         r"vs metalearn loop (\S+) ", out)  # fmt: skip
    assert verified is not None and out.index(verified.group(0)) < out.index("timed q1-second")
    # Equal to rounding: to 1e-13 with SGD; inner Adam amplifies the rounding of the gradient
    # entries a batch norm cancels, where metalearn's own vmap and loop differ by ~1e-10.
    assert float(verified.group(1)) < (1e-13 if inner == "sgd" else 1e-8)
    lines = out.strip().splitlines()
    assert re.fullmatch(r"speedup_vs_torchopt: \d+\.\d\d", lines[-2]), lines[-2]
    assert lines[-1] == last and last.startswith("speedup_vs_")
    table = out[out.index("## float64 meta-gradient") :]
    assert "| auto | torchopt |" in table


def test_without_torchopt_named_the_output_has_no_torchopt_line(capsys) -> None:
    args = bench_maml.parse_args(
        "--tasks 2 --repeats 1 --warmup 0 --settings q1-first --methods auto "
        "--no-memory --no-float64-check --malloc default".split()
    )
    bench_maml.main(args)
    assert "torchopt" not in capsys.readouterr().out
    assert "torchopt" not in bench_maml.parse_args([]).methods  # the default run is unchanged
