"""scripts/transfer_check.py on a real tiny run: the deployed, file-fed, all-at-once accuracy
equals the experiment's own evaluation of the same tasks, and bad input is one line."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
sys.path.insert(0, str(ROOT / "scripts"))
import omniglot_maml as om  # noqa: E402
import transfer_check as script  # noqa: E402

DATA = Path(os.environ.get("METALEARN_DATA", ROOT.parent / "shared" / "data" / "omniglot"))
LINE = re.compile(r"^(\w+): (\d\.\d{4}) ± (\d\.\d{4}|nan)", re.M)


def tiny_run(tmp: Path, split: str) -> Path:
    if not (DATA / "images_background").is_dir():
        pytest.skip("full Omniglot not found: set METALEARN_DATA or put it at ../shared/data/")
    args = om.Args(
        algorithm="protomaml", ways=4, split=split, iterations=2, meta_batch=2, query=1,
        eval_query=2, hidden=8, val_every=1, val_tasks=2, test_tasks=2, eval_inner_steps=1,
        data_root=str(DATA), out_dir=str(tmp), track=False, device="cpu",
    )  # fmt: skip
    om.main(args)
    (path,) = tmp.glob("*/checkpoint.pt")
    return path


def test_all_at_once_equals_the_experiments_evaluation(tmp_path, capsys):
    checkpoint = tiny_run(tmp_path, "alphabet")
    capsys.readouterr()  # the run's own output
    argv = ["--checkpoint", str(checkpoint), "--tasks", "6", "--query", "3", "--seed", "5"]
    assert script.cli(argv) == 0
    found = {m.group(1): float(m.group(2)) for m in LINE.finditer(capsys.readouterr().out)}
    assert set(found) == {"one_at_a_time", "all_at_once", "evaluate"}
    assert found["all_at_once"] == found["evaluate"]
    assert 0.0 <= found["one_at_a_time"] <= 1.0


def test_a_maml_split_run_is_refused(tmp_path, capsys):
    checkpoint = tiny_run(tmp_path, "maml")
    capsys.readouterr()  # the run's own output
    assert script.cli(["--checkpoint", str(checkpoint), "--tasks", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "is not an Omniglot alphabet-split run" in err and len(err.splitlines()) == 1
