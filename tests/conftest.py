"""Shared test set-up: W&B stays offline, inside each test's tmp dir, and is torn down."""

from __future__ import annotations

import pytest
import torch

# Tests use tiny models: with torch's default threads on a shared 2-core machine, small ops
# spend most of their time in thread hand-off (measured: 0.46 s vs 8 ms for one meta-loss).
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _session_data_cache(tmp_path_factory):
    """One decoded-Omniglot cache for the whole session (decoding 32k PNGs takes ~10 s)."""
    import os

    previous = os.environ.get("METALEARN_CACHE")
    os.environ["METALEARN_CACHE"] = str(tmp_path_factory.mktemp("metalearn-cache"))
    yield
    if previous is None:
        os.environ.pop("METALEARN_CACHE", None)
    else:
        os.environ["METALEARN_CACHE"] = previous


@pytest.fixture(autouse=True)
def _isolated_wandb(tmp_path, monkeypatch):
    """wandb reads its environment once per process; point it into tmp and reset after."""
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-env" / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")  # also avoids a telemetry DNS lookup
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield
    import sys

    if "wandb" in sys.modules:  # only tear down what a test actually started
        sys.modules["wandb"].teardown()


# Modules whose tests train, run scripts end to end or spawn processes (seconds each): the
# quick subset, ``pytest -m "not slow"``, leaves them out. One list, so a new end-to-end
# module is marked in one place.
SLOW_MODULES = {
    "test_bench_curvature",
    "test_bench_memory",
    "test_compare_runs",
    "test_compiled",
    "test_distributed",
    "test_evaluate",
    "test_fewshot_experiment",
    "test_grid",
    "test_omniglot_experiment",
    "test_run_records",
    "test_sine_experiment",
    "test_transfer_check",
    "test_within_alphabet",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
