"""The curvature demo runs end to end and measures what the dense Hessian says."""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call

from metalearn import hessian
from tests.conftest import experiment

curvature_demo = experiment("curvature_demo")


def test_measure_matches_dense_hessian():
    cfg = curvature_demo.Config(width=8, n_points=32, lanczos_iters=60, trace_samples=400)
    gen = torch.Generator().manual_seed(0)
    x, y = curvature_demo.make_data(cfg, gen)
    model = curvature_demo.make_model(cfg).double()
    x, y = x.double(), y.double()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_fn(p):
        return 0.5 * ((functional_call(model, p, (x,)) - y) ** 2).mean()

    dense = hessian(loss_fn, params)
    row = curvature_demo.measure(loss_fn, params, cfg, gen)
    top = torch.linalg.eigvalsh(dense)[-1].item()
    assert row["curvature/sharpness"] == pytest.approx(top, rel=1e-8)
    exact_trace = torch.trace(dense).item()
    assert abs(row["curvature/trace"] - exact_trace) <= 3 * row["curvature/trace_stderr"]


def test_main_runs_and_logs_offline(tmp_path):
    cfg = curvature_demo.Config(steps=20, measure_every=10, width=16, out_dir=str(tmp_path))
    rows = curvature_demo.main(cfg)
    assert [r["step"] for r in rows] == [0, 10, 20]
    assert rows[-1]["train/loss"] < rows[0]["train/loss"]
    assert (tmp_path / "curvature_demo.png").stat().st_size > 0
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))


def test_cli_flags_come_from_the_dataclass():
    cfg = curvature_demo.parse_args(["--steps", "7", "--lr", "0.1", "--wandb-mode", "disabled"])
    assert (cfg.steps, cfg.lr, cfg.wandb_mode) == (7, 0.1, "disabled")


def test_cli_takes_the_underscore_form_too():
    cfg = curvature_demo.parse_args(["--measure_every=5", "--n-points", "16"])
    assert (cfg.measure_every, cfg.n_points) == (5, 16)
