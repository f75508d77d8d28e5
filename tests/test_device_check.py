"""scripts/device_check.sh, the prepared GPU session, dry-run on the CPU so it cannot rot.

Its ``QUICK=1 DEVICE=cpu`` mode runs every part at toy sizes: the test subset, bench_maml,
bench_chunks, bench_hvp and (when scripts/prepare_device.sh has packed the data) a
two-step Omniglot run. Each part must exit 0 and leave its log in ``$OUT``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_device_check_dry_run_passes_every_part(tmp_path: Path) -> None:
    env = {
        **os.environ, "QUICK": "1", "DEVICE": "cpu", "PYTHON": sys.executable,
        "OUT": str(tmp_path / "out"), "SCRATCH": str(tmp_path / "scratch"),
    }  # fmt: skip
    done = subprocess.run(
        ["bash", "scripts/device_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    exits = dict(re.findall(r"^== (\w+): exit (\d+)", done.stdout, re.M))
    expected = {"tests", "bench_maml", "bench_chunks", "bench_hvp"}
    assert expected <= set(exits), done.stdout[-3000:]
    assert all(code == "0" for code in exits.values()), (exits, done.stdout[-3000:])
    for name in exits:
        assert (tmp_path / "out" / f"{name}.txt").stat().st_size > 0
    assert "speedup_vs_learn2learn" in (tmp_path / "out" / "bench_maml.txt").read_text()
