"""scripts/transfer_check.py on real tiny runs of both experiments: the deployed, file-fed,
all-at-once accuracy equals the experiment's own evaluation of the same tasks, for
Omniglot (either split, its inverted ink), an image folder read as 16 px grayscale and
CIFAR-FS (RGB arrays written to files); a changed decoding is caught; bad input is one
line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import HAS_OMNIGLOT, NO_OMNIGLOT, OMNIGLOT
from tests.conftest import script as load_script
from tests.helpers.image_set_fixtures import write_cifar, write_folder
from tests.helpers.run_helpers import fs, make, om

script = load_script("transfer_check")

DATA = OMNIGLOT
LINE = re.compile(r"^(\w+): (\d\.\d{4}) ± (\d\.\d{4}|nan)", re.M)
TINY = dict(iterations=2, meta_batch=2, query=1, eval_query=1, val_every=1, val_tasks=2,
            test_tasks=2, eval_inner_steps=1, track=False, device="cpu")  # fmt: skip
pytestmark = pytest.mark.filterwarnings("ignore:.*published:UserWarning")


def omniglot_run(tmp: Path, split: str) -> Path:
    if not HAS_OMNIGLOT:
        pytest.skip(NO_OMNIGLOT)
    protocol = "within-alphabet" if split == "alphabet" else "episodic"
    om.main(make(om, **TINY, algorithm="protomaml", transductive=True, ways=4, split=split,
                 hidden=8, eval_protocol=protocol, data_root=str(DATA), out_dir=str(tmp),
                 run_name="r"))  # fmt: skip
    return tmp / "r" / "checkpoint.pt"


def fewshot_run(tmp: Path, dataset: str) -> Path:
    if dataset == "folder":
        root, shape = write_folder(tmp / "data"), {"image_size": 16, "channels": 1}
    else:
        root, shape = write_cifar(tmp / "data"), {}
    fs.main(make(fs, **TINY, **shape, algorithm="maml", dataset=dataset, ways=3, hidden=4,
                 inner_steps=1, data_root=str(root), out_dir=str(tmp / "runs"),
                 run_name="r"))  # fmt: skip
    return tmp / "runs" / "r" / "checkpoint.pt"


def _check(capsys, checkpoint: Path, *flags: str) -> tuple[int, dict[str, float], str]:
    capsys.readouterr()  # the run's own output
    code = script.cli(["--checkpoint", str(checkpoint), "--tasks", "4", "--seed", "5", *flags])
    out = capsys.readouterr().out
    found = {m.group(1): float(m.group(2)) for m in LINE.finditer(out)}
    return code, found, out.strip().splitlines()[-1]


@pytest.mark.parametrize("run", ["omniglot-alphabet", "omniglot-maml", "folder", "cifar-fs"])
def test_all_at_once_equals_the_experiments_evaluation(tmp_path, capsys, run):
    kind, _, split = run.partition("-")
    checkpoint = omniglot_run(tmp_path, split) if kind == "omniglot" else fewshot_run(tmp_path, run)
    code, found, last = _check(capsys, checkpoint, "--query", "2")
    assert set(found) == {"one_at_a_time", "all_at_once", "beside_support", "evaluate"}
    assert found["all_at_once"] == found["evaluate"]
    assert 0.0 <= found["one_at_a_time"] <= 1.0 and 0.0 <= found["beside_support"] <= 1.0
    assert last == "deploy_matches_evaluate: true" and code == 0


@pytest.mark.parametrize("transductive", [False, True])
def test_reptile_is_compared_in_the_reading_it_evaluates_with(tmp_path, capsys, transductive):
    """Reptile's default scores each query beside the support set: that row, not the
    all-at-once one, is compared with its evaluation (``--transductive``: all at once)."""
    if not HAS_OMNIGLOT:
        pytest.skip(NO_OMNIGLOT)
    om.main(make(om, **TINY, algorithm="reptile", ways=4, hidden=8, transductive=transductive,
                 data_root=str(DATA), out_dir=str(tmp_path), run_name="r"))  # fmt: skip
    capsys.readouterr()  # the run's own output
    code = script.cli(["--checkpoint", str(tmp_path / "r" / "checkpoint.pt"), "--tasks", "4",
                       "--seed", "5", "--query", "2"])  # fmt: skip
    lines = capsys.readouterr().out.strip().splitlines()
    found = {m.group(1): float(m.group(2)) for m in LINE.finditer("\n".join(lines))}
    compared, norm = ("all_at_once", "transductive") if transductive else ("beside_support",) * 2
    assert lines[-2] == f"evaluate_reads: {compared} (norm={norm!r})"
    assert found[compared] == found["evaluate"]
    assert lines[-1] == "deploy_matches_evaluate: true" and code == 0


def test_a_decoding_that_differs_from_training_is_caught(tmp_path, capsys, monkeypatch):
    """Files written with the ink the other way round decode to other images: the check
    must say so (false, exit 1) rather than report the deployed numbers as the run's."""
    checkpoint = omniglot_run(tmp_path, "alphabet")
    original = script.write_images

    def flipped(images, paths, image):
        original(1 - images, paths, image)

    monkeypatch.setattr(script, "write_images", flipped)
    code, found, last = _check(capsys, checkpoint, "--query", "2")
    assert last == "deploy_matches_evaluate: false" and code == 1


def test_bad_input_is_one_line(tmp_path, capsys):
    assert script.cli(["--tasks", "1"]) == 2
    assert "--checkpoint is required" in capsys.readouterr().err
    assert script.cli(["--checkpoint", str(tmp_path / "gone.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no checkpoint at" in err and len(err.splitlines()) == 1
