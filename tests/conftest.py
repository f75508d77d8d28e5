"""Shared test set-up: where the real Omniglot is (`OMNIGLOT`, the tools' own rule); W&B stays
offline, inside each test's tmp dir, and is torn down; the ``slow`` modules; the
``baselines`` marker (tests against learn2learn or higher); `experiment` and `script`, the
one way a test loads a file of experiments/ or scripts/ (by its path, ``sys.path`` as it is)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest

# Bit-identical runs (a resume equals the uninterrupted run): MKL's kernels independent of
# memory alignment, set before torch's first MKL call (as experiments/rl_maml.py sets it).
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

import torch  # noqa: E402

from metalearn.data.omniglot import resolve_data_root  # noqa: E402
from metalearn.tools.experiments import PREFIX, experiment_file, load_file  # noqa: E402

# tests/baselines/test_baselines_marker.py runs pytest on a made-up test
pytest_plugins = ["pytester"]

# Set (to anything but "" or "0") where the baselines are meant to be installed, as CI does
# for its .venv-baselines run: there a missing learn2learn or higher fails its tests.
REQUIRE_BASELINES = "METALEARN_REQUIRE_BASELINES"

# Tests use tiny models: with torch's default threads on a shared 2-core machine, small ops
# spend most of their time in thread hand-off (measured: 0.46 s vs 8 ms for one meta-loss).
torch.set_num_threads(1)

OMNIGLOT: Path = resolve_data_root()
"""The real Omniglot, found as the tools find it (`resolve_data_root`: ``$METALEARN_DATA``, else
the cache's ``omniglot/``), read once before the session's cache moves into tmp. Every test
that needs the real data takes it from here; the session hands the same folder to the tools
(`_session_data`), so a test and the command it runs never look in different places."""

HAS_OMNIGLOT = (OMNIGLOT / "images_background").is_dir()

NO_OMNIGLOT = (
    f"Omniglot not found at {OMNIGLOT}: set METALEARN_DATA to an extracted Omniglot "
    "(images_background/, images_evaluation/)"
)

needs_omniglot = pytest.mark.skipif(not HAS_OMNIGLOT, reason=NO_OMNIGLOT)

ROOT = Path(__file__).resolve().parents[1]


def experiment(name: str) -> ModuleType:
    """``experiments/<name>.py``, loaded as the grid loads it (the same module object)."""
    return load_file(experiment_file(name, ROOT), PREFIX + name)


def script(name: str) -> ModuleType:
    """``scripts/<name>.py``, loaded by its path; ``benchtools`` first, under the name the
    bench scripts import it by."""
    load_file(ROOT / "scripts" / "benchtools.py", "benchtools")
    return load_file(ROOT / "scripts" / f"{name}.py", name)


@pytest.fixture(scope="session", autouse=True)
def _session_data(tmp_path_factory):
    """One decoded-Omniglot cache for the whole session (decoding 32k PNGs takes ~10 s), and
    ``$METALEARN_DATA`` at `OMNIGLOT` where it was found, for the tools the tests run."""
    saved = {k: os.environ.get(k) for k in ("METALEARN_CACHE", "METALEARN_DATA")}
    os.environ["METALEARN_CACHE"] = str(tmp_path_factory.mktemp("metalearn-cache"))
    if HAS_OMNIGLOT:
        os.environ["METALEARN_DATA"] = str(OMNIGLOT)
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


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
    "test_bad_input",
    "test_bench_memory",
    "test_compare_runs",
    "test_compiled",
    "test_distributed",
    "test_evaluate",
    "test_fewshot_experiment",
    "test_full_disk",
    "test_grid",
    "test_omniglot_experiment",
    "test_readme_commands",
    "test_run_records",
    "test_seam_matrix",
    "test_sine_experiment",
    "test_transfer_check",
    "test_within_alphabet",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        marker = item.get_closest_marker("baselines")
        if marker is not None and not marker.args:
            raise pytest.UsageError(
                f"{item.nodeid}: @pytest.mark.baselines names the modules the test needs, "
                "e.g. @pytest.mark.baselines('learn2learn')"
            )


def _missing_baselines(item: pytest.Item) -> list[str]:
    """The modules that ``@pytest.mark.baselines(...)`` on ``item`` names and that don't import.

    A find_spec check, not an import: a module that is there but broken fails the test itself.
    """
    marker = item.get_closest_marker("baselines")
    if marker is None:
        return []
    return [name for name in marker.args if importlib.util.find_spec(name) is None]


def _baselines_message(missing: list[str]) -> str:
    return (
        f"{', '.join(missing)} not installed here; the baselines live in .venv-baselines "
        "(bash scripts/install_baselines.sh, then "
        ".venv-baselines/bin/python -m pytest -m baselines)"
    )


def _baselines_required() -> bool:
    return os.environ.get(REQUIRE_BASELINES, "") not in ("", "0")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A baselines test skips where its modules are missing, unless they are required."""
    missing = _missing_baselines(item)
    if missing and not _baselines_required():
        pytest.skip(_baselines_message(missing))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    """Where the baselines are required (REQUIRE_BASELINES), a missing one fails the test."""
    missing = _missing_baselines(item)
    if missing:
        pytest.fail(f"{REQUIRE_BASELINES} is set: {_baselines_message(missing)}", pytrace=False)
