"""scripts/bench_anomaly_guard.py: the timed variants run the real meta-step, the guarded
ones really guard (a NaN stops them), and bad arguments are one line; no timings asserted."""

from __future__ import annotations

import pytest
import torch

from metalearn.debug import NonFiniteError
from tests.conftest import script

bench_anomaly_guard = script("bench_anomaly_guard")


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")  # torch's own variant
def test_every_variant_runs_the_meta_step_and_updates_the_weights() -> None:
    step, learner = bench_anomaly_guard.make_step("auto", tasks=2)
    params = list(learner.parameters())
    for name, context in bench_anomaly_guard.VARIANTS.items():
        before = [p.detach().clone() for p in params]
        bench_anomaly_guard.guarded(step, context)()
        assert any(not torch.equal(b, p) for b, p in zip(before, params)), name


def test_the_guarded_variants_stop_at_a_nan_and_plain_does_not() -> None:
    def make_nan() -> None:
        torch.log(-torch.ones(3))

    for name in ("anomaly_guard(backward_origin=False)", "anomaly_guard()"):
        with pytest.raises(NonFiniteError):
            bench_anomaly_guard.guarded(make_nan, bench_anomaly_guard.VARIANTS[name])()
    bench_anomaly_guard.guarded(make_nan, bench_anomaly_guard.VARIANTS["plain"])()


def test_bad_arguments_are_one_line_and_exit_2(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_anomaly_guard.parse_args(["--repeats", "0"])
    assert exit_info.value.code == 2 and "at least 1" in capsys.readouterr().err
