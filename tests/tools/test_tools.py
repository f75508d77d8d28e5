"""The commands of `metalearn.tools` (``[project.scripts]``): each module's ``main`` is the
declared entry point, and its ``--help`` loads neither torch nor wandb (which take seconds
to import), so it answers at once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

TOOLS = ("evaluate", "grid", "compare", "export", "predict")


def test_each_tool_is_a_declared_command():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {f"metalearn-{tool}": f"metalearn.tools.{tool}:main" for tool in TOOLS}


@pytest.mark.parametrize("tool", TOOLS)
def test_help_imports_neither_torch_nor_wandb(tool):
    code = (
        "import sys\n"
        f"from metalearn.tools import {tool}\n"
        "try:\n"
        f"    {tool}.main(['--help'])\n"
        "except SystemExit as stop:\n"
        "    assert stop.code == 0, stop.code\n"
        "print(sorted(m for m in ('torch', 'wandb', 'numpy') if m in sys.modules))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "--help" in done.stdout and done.stdout.strip().splitlines()[-1] == "[]"


def closed_stdout(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``cmd`` run with stdout a pipe whose reader has already left (as ``| head -1`` does
    after its line): the first write fails with EPIPE, deterministically."""
    read, write = os.pipe()
    os.close(read)
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        return subprocess.run(cmd, stdout=write, stderr=subprocess.PIPE, text=True, env=env,
                              timeout=300, **kwargs)  # fmt: skip
    finally:
        os.close(write)


@pytest.mark.parametrize("tool", ["evaluate", "grid", "compare", "export", "predict"])
def test_a_reader_that_leaves_ends_the_tool_quietly_with_status_141(tool):
    """141 (128 + SIGPIPE), what a shell reports for a program SIGPIPE ended; no traceback,
    no "Exception ignored" at exit (`metalearn.runs.cli.quiet_on_closed_stdout`)."""
    done = closed_stdout([sys.executable, "-m", f"metalearn.tools.{tool}", "--help"])
    assert (done.returncode, done.stderr) == (141, "")
