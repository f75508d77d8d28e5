"""The README's tool commands (metalearn-evaluate, -compare, -export, -predict), run as written
on a real tiny run of the experiment and on its real evaluation run, each output checked
against what it must equal: compare's evaluation row against evaluate's printed result,
predict's probabilities against the learner adapted in this process (load_learner,
adapt_to_support, adapted_model: no package loader)."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from metalearn.deploy import adapt_to_support, adapted_model, load_learner, load_support_folder
from metalearn.tools import compare, evaluate, export, predict
from tests.conftest import OMNIGLOT, ROOT, needs_omniglot
from tests.deploy.test_deploy import make_support_folder

TOOLS = {"metalearn-evaluate": evaluate, "metalearn-compare": compare,
         "metalearn-export": export, "metalearn-predict": predict}  # fmt: skip
RESULT = re.compile(r"test/acc: (\d\.\d{4}) ± (\d\.\d{4})")

pytestmark = needs_omniglot


def readme_commands() -> dict[str, list[str]]:
    """Each tool's command lines in the README's bash blocks (continuations joined)."""
    text = (ROOT / "README.md").read_text()
    found: dict[str, list[str]] = {}
    for block in (part.split("```", 1)[0] for part in text.split("```bash\n")[1:]):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0] in TOOLS:
                found.setdefault(words[0], []).append(line)
    return found


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A folder as a user has it after the README's first command: runs/NAME from a tiny
    tracked (offline) run of experiments/omniglot_maml.py, and support and query folders."""
    tmp = tmp_path_factory.mktemp("clone")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_DIR"):
        env[var] = str(tmp / "wandb-env" / var.lower())
    tiny = ["--algorithm", "maml", "--iterations", "2", "--meta-batch", "2", "--query", "1",
            "--eval-query", "2", "--hidden", "8", "--val-every", "1", "--val-tasks", "3",
            "--test-tasks", "4", "--eval-inner-steps", "2", "--wandb-mode", "offline",
            "--out-dir", "runs", "--data-root", str(OMNIGLOT), "--device", "cpu"]  # fmt: skip
    experiment = str(ROOT / "experiments" / "omniglot_maml.py")
    done = subprocess.run([sys.executable, experiment, *tiny], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    support = make_support_folder(tmp, shots=1)
    support.rename(tmp / "my_support")
    queries = tmp / "my_queries"
    queries.mkdir()
    for c, folder in enumerate(sorted(make_support_folder(tmp, shots=1, offset=3).iterdir())):
        (png,) = folder.iterdir()
        png.rename(queries / f"q{c}-{png.name}")
    return tmp


def run_tool(line: str, name: str, tasks: str | None = None) -> int:
    """One README line with NAME the run's folder name (and ``--tasks`` made smaller)."""
    words = shlex.split(line.replace("runs/NAME/", f"runs/{name}/"), comments=True)
    if tasks is not None and "--tasks" in words:
        words[words.index("--tasks") + 1] = tasks  # 2,000 tasks: minutes on a loaded CPU
    return TOOLS[words[0]].main(words[1:])


def test_the_readme_names_each_tool(clone):
    commands = readme_commands()
    assert set(commands) == set(TOOLS), commands


def test_the_readmes_commands_run_on_a_real_run_and_its_evaluation(clone, capsys, monkeypatch):
    monkeypatch.chdir(clone)  # the README's paths are relative: runs/, my_support/, ...
    (checkpoint,) = Path("runs").glob("*/checkpoint.pt")
    name = checkpoint.parent.name
    commands = readme_commands()
    (evaluate_line,) = commands["metalearn-evaluate"]
    assert run_tool(evaluate_line, name, tasks="30") == 0
    sys.modules["wandb"].teardown()  # the evaluation's file is whole once wandb's service ends
    acc, half = RESULT.fullmatch(capsys.readouterr().out.strip().splitlines()[-1]).groups()

    (compare_line,) = commands["metalearn-compare"]
    assert "--evals" in compare_line and "--group-by" in compare_line
    assert run_tool(compare_line, name) == 0
    table = capsys.readouterr().out
    (eval_row,) = [row for row in table.splitlines() if row.startswith("| ↳ ")]
    assert "30 tasks" in eval_row and "20 steps" in eval_row
    rows = [row for row in table.splitlines() if row.startswith("| ")]
    assert rows.index(eval_row) == 2  # the header, the trained run's group, its evaluation
    assert rows[1].startswith("| algorithm=maml, inner_lr=2 | 1 | finished |"), rows[1]
    assert run_tool(f"{compare_line} --format csv", name) == 0
    by_label = {r["label"]: r for r in csv.DictReader(io.StringIO(capsys.readouterr().out))}
    (evaluation,) = [r for label, r in by_label.items() if label.startswith("↳ ")]
    assert f"{float(evaluation['test/acc final']):.4f}" == acc
    assert f"{float(evaluation['test/acc final ci95']):.4f}" == half

    export_lines, predict_lines = commands["metalearn-export"], commands["metalearn-predict"]
    assert [run_tool(line, name) for line in export_lines] == [0]
    assert "package: adapted\n" in capsys.readouterr().out
    assert [run_tool(line, name) for line in predict_lines] == [0]
    check_predictions(capsys.readouterr().out, checkpoint)


def check_predictions(printed: str, checkpoint: Path) -> None:
    """The README's predict (CSV): one row per query image, its class the argmax of its
    probabilities, which are the softmax of the logits of the learner adapted here on the
    support folder (its eval_inner_steps, frozen support statistics), on the images decoded
    as the run's recipe says."""
    rows = list(csv.reader(io.StringIO(printed)))
    header, rows = rows[0], rows[1:]
    classes = sorted(p.name for p in Path("my_support").iterdir())
    assert header == ["file", "class", *classes]
    files = sorted(Path("my_queries").iterdir())
    assert [r[0] for r in rows] == [f.name for f in files]
    learner, recipe = load_learner(checkpoint)
    x = torch.stack([torch.from_numpy(recipe.data.image.decode(f)) for f in files]).float() / 255
    support = load_support_folder("my_support", image=recipe.data.image, ways=recipe.model.ways)
    params = adapt_to_support(learner, support.x, support.y, recipe.training.eval_inner_steps)
    with torch.inference_mode():
        logits = adapted_model(learner, params, norm="support", support_x=support.x)(x)
    want = torch.softmax(logits.double(), dim=-1)
    got = torch.tensor([[float(v) for v in r[2:]] for r in rows], dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert [r[1] for r in rows] == [classes[i] for i in want.argmax(-1).tolist()]
    assert all(math.isclose(sum(p), 1.0, abs_tol=1e-6) for p in got.tolist())


def test_predict_writes_json_and_refuses_bad_input_in_one_line(clone, capsys, monkeypatch):
    monkeypatch.chdir(clone)
    if not Path("adapted").is_dir():  # the README test above writes it
        (checkpoint,) = Path("runs").glob("*/checkpoint.pt")
        assert export.main(["--checkpoint", str(checkpoint), "--support", "my_support"]) == 0
        Path(checkpoint.parent / "adapted").rename("adapted")
        capsys.readouterr()
    argv = ["--model", "adapted", "--images", "my_queries", "--out", "p.json"]
    assert predict.main(argv) == 0
    found = json.loads(Path("p.json").read_text())
    assert found["classes"] == sorted(p.name for p in Path("my_support").iterdir())
    assert [p["file"] for p in found["predictions"]] == sorted(
        p.name for p in Path("my_queries").iterdir()
    )
    for p in found["predictions"]:
        best = max(p["probabilities"], key=p["probabilities"].get)
        assert p["class"] == best == found["classes"][p["index"]]
    # A program of one fixed batch size (--no-dynamic-batch: the support set's 5 images)
    # classifies 3 images (padded) as the package does: each image alone.
    (checkpoint,) = Path("runs").glob("*/checkpoint.pt")
    assert export.main(["--checkpoint", str(checkpoint), "--support", "my_support", "--out",
                        "fixed", "--program", "--no-dynamic-batch",
                        "--latency-repeats", "2"]) == 0  # fmt: skip
    three = Path("three")
    three.mkdir()
    for png in sorted(Path("my_queries").iterdir())[:3]:
        (three / png.name).write_bytes(png.read_bytes())
    capsys.readouterr()
    for model in ("fixed.pt2", "adapted"):
        assert predict.main(["--model", model, "--images", "three", "--out", f"{model}.json",
                             "--trust"]) == 0  # fmt: skip
    fixed, dynamic = (json.loads(Path(f"{m}.json").read_text())["predictions"]
                      for m in ("fixed.pt2", "adapted"))  # fmt: skip
    assert [p["file"] for p in fixed] == [p["file"] for p in dynamic] and len(fixed) == 3
    for a, b in zip(fixed, dynamic):
        assert a["class"] == b["class"]
        assert all(abs(a["probabilities"][k] - v) < 1e-6 for k, v in b["probabilities"].items())
    before = Path("p.json").read_bytes()
    bad = {"exists; pass --overwrite": argv,
           "no such folder": ["--model", "adapted", "--images", "nowhere"],
           "holds folders (class0": ["--model", "adapted", "--images", "my_support"],
           "no package at none": ["--model", "none", "--images", "my_queries"],
           "runs code from the file": ["--model", "fixed.pt2", "--images", "my_queries"],
           "is a metalearn training checkpoint, never overwritten": [
               *argv[:4], "--out", str(checkpoint), "--overwrite"]}  # fmt: skip
    for message, args in bad.items():
        assert predict.main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("metalearn-predict: error: "), err
        assert message in err[0], err
    assert Path("p.json").read_bytes() == before


def test_deploy_docs_library_example_runs_and_names_the_classes(clone, capsys, monkeypatch):
    """docs/deploy.md's library example as written (its run, support folder and file names
    made this folder's), ``images`` being the query images: it prints support class names."""
    monkeypatch.chdir(clone)
    (checkpoint,) = Path("runs").glob("*/checkpoint.pt")
    text = (ROOT / "docs" / "deploy.md").read_text()
    block = next(part.split("```", 1)[0] for part in text.split("```python\n")[1:]
                 if "load_support_folder" in part)  # fmt: skip
    code = block.replace("runs/NAME/", f"runs/{checkpoint.parent.name}/")
    code = code.replace('"adapted"', '"docs-example"')  # beside the README's
    image = load_learner(checkpoint)[1].data.image
    files = sorted(Path("my_queries").iterdir())
    images = torch.stack([torch.from_numpy(image.decode(f)) for f in files]).float() / 255
    scope = {"images": images}
    exec(compile(code, "docs/deploy.md", "exec"), scope)
    names = scope["meta"]["class_names"]
    assert names == sorted(p.name for p in Path("my_support").iterdir())
    printed = capsys.readouterr().out
    assert str([names[i] for i in scope["prediction"].classes]) in printed
