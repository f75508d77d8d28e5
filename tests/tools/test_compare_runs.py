"""metalearn-compare (`metalearn.tools.compare`) on offline runs written here with known
histories."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from metalearn.runs.records import read_offline_runs
from metalearn.tools import compare
from tests.conftest import ROOT
from tests.runs.test_run_records import damage, offline_run, wandb_file

T975 = {1: 12.7062, 2: 4.3027, 4: 2.7764, 9: 2.2622, 30: 2.0423}
"""Two-sided 95% critical values of Student's t, from a printed table."""


def run_json(capsys, *argv: str) -> dict:
    compare.main([*argv, "--format", "json"])
    return json.loads(capsys.readouterr().out)


def usage_error(capsys, *argv: str) -> str:
    try:
        code = compare.main(list(argv))
    except SystemExit as stop:  # the flags' parser stops the process itself
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    return err


def test_t_quantile_matches_the_printed_table():
    for dof, t in T975.items():
        assert compare.t_quantile(0.95, dof) == pytest.approx(t, abs=6e-5)


def test_each_metric_is_judged_in_its_own_direction(tmp_path, capsys):
    # a: slower, narrower intervals, higher loss; b: faster, wider intervals, lower loss.
    curves = {
        "a": {"perf/tasks_per_s": [10.0, 12.0], "val/acc_ci95": [0.03, 0.02],
              "perf/step_s": [0.5, 0.4], "train/loss": [0.9, 0.8], "train/skipped": [3.0, 1.0]},
        "b": {"perf/tasks_per_s": [20.0, 22.0], "val/acc_ci95": [0.05, 0.04],
              "perf/step_s": [0.2, 0.1], "train/loss": [0.7, 0.6], "train/skipped": [0.0, 2.0]},
    }  # fmt: skip
    for name, lr, out in (("a", 0.1, "x"), ("b", 0.4, "y")):
        rows = {s: {k: v[s] for k, v in curves[name].items()} for s in range(2)}
        offline_run(tmp_path, rows, name=name, config={"inner_lr": lr, "out_dir": out, "seed": 0})
    out = run_json(capsys, str(tmp_path), "--metrics", *curves["a"])
    best = {m["name"]: m["best_row"] for m in out["metrics"]}
    assert best == {"perf/tasks_per_s": "b", "val/acc_ci95": "a", "perf/step_s": "b",
                    "train/loss": "b", "train/skipped": None}  # fmt: skip
    a = out["rows"][0]["metrics"]
    assert a["perf/tasks_per_s"]["best"]["value"] == 12.0  # a run's best step: the max
    assert a["val/acc_ci95"]["best"]["value"] == 0.02  # ... and the narrowest interval
    assert a["train/skipped"] == {"final": {"value": 1.0, "ci95": None, "n": 1}, "best": None}
    assert "train/skipped: direction unknown, final value only" in out["notes"]
    # Only what was run differs in the table; where it was kept is named as left out.
    assert [r["config"] for r in out["rows"]] == [{"inner_lr": 0.1}, {"inner_lr": 0.4}]
    assert out["bookkeeping_left_out"] == ["out_dir"]


def test_seeds_grouped_as_mean_and_t_interval(tmp_path, capsys):
    finals = [0.80, 0.83, 0.87]
    for seed, acc in enumerate(finals):
        rows = {0: {"val/acc": 0.5}, 10: {"val/acc": acc, "val/acc_ci95": 0.01}}
        offline_run(tmp_path, rows, config={"algorithm": "maml", "seed": seed},
                    summary={"test/acc": acc + 0.05, "test/acc_ci95": 0.004})  # fmt: skip
    offline_run(tmp_path, {0: {"val/acc": 0.4}, 10: {"val/acc": 0.6}},
                config={"algorithm": "fomaml", "seed": 0}, summary={"test/acc": 0.62})  # fmt: skip
    out = run_json(capsys, str(tmp_path), "--group-by", "algorithm")
    maml, fomaml = out["rows"]
    mean = sum(finals) / 3
    s = math.sqrt(sum((v - mean) ** 2 for v in finals) / 2)
    half = T975[2] * s / math.sqrt(3)
    final = maml["metrics"]["val/acc"]["final"]
    assert final["n"] == 3 and maml["n"] == 3 and maml["state"] == "3 finished"
    assert final["value"] == pytest.approx(mean, rel=1e-12)
    assert final["ci95"] == pytest.approx(half, rel=1e-4)  # the table's t has 5 digits
    test = maml["metrics"]["test/acc"]["final"]  # across seeds, not a run's own interval
    assert test["value"] == pytest.approx(mean + 0.05) and test["ci95"] == pytest.approx(half, 1e-4)
    assert fomaml["n"] == 1 and fomaml["metrics"]["test/acc"]["final"]["ci95"] is None
    assert [r["label"] for r in out["rows"]] == ["algorithm=maml", "algorithm=fomaml"]
    assert out["varied_within_groups"] == ["seed"]
    assert maml["config"] == {"algorithm": "maml"}
    assert any("Student t" in n for n in out["notes"])


def test_test_metric_shown_with_its_logged_interval(tmp_path, capsys):
    offline_run(tmp_path, {0: {"train/loss": 1.0}, 1: {"train/loss": 0.5}}, name="r",
                summary={"test/acc": 0.9581, "test/acc_ci95": 0.0037})  # fmt: skip
    text = compare.run([str(tmp_path)])
    header, _, row = text.splitlines()[:3]
    cells = dict(zip(header.strip("|").split("|"), row.strip("|").split("|")))
    cells = {k.strip(): v.strip() for k, v in cells.items()}
    assert cells["test/acc ↑"] == "0.9581 ± 0.0037"
    assert cells["train/loss ↓"] == "0.5" and cells["train/loss ↓ best"] == "0.5"
    assert "val/acc ↑" not in cells  # a default metric nobody logged is not a column


def test_resumed_and_damaged_runs(tmp_path, capsys):
    offline_run(tmp_path, {s: {"train/loss": 1.0} for s in range(3)}, name="res", run_id="r1")
    offline_run(tmp_path, {s: {"train/loss": 0.5} for s in range(2, 5)}, run_id="r1")
    pad = {s: {"train/loss": 2.0, "pad": "x" * 200} for s in range(20)}
    bad = damage(offline_run(tmp_path, pad, name="bad"), "corrupt")
    junk = damage(offline_run(tmp_path, pad, name="junk"), "header")
    out = json.loads(compare.run([str(tmp_path), "--format", "json"]))
    err = capsys.readouterr().err
    assert [(r["label"], r["state"]) for r in out["rows"]] == [("res", "finished"),
                                                               ("bad", "corrupt")]  # fmt: skip
    assert len(out["rows"][0]["runs"]) == 1  # two segments, one run
    assert out["rows"][0]["metrics"]["train/loss"]["final"]["value"] == 0.5
    assert f"warning: {bad}" in err and f"warning: {junk}" in err and "skipped" in err


def test_formats_parse(tmp_path, capsys):
    for lr in (0.1, 0.4):
        offline_run(tmp_path, {0: {"val/acc": 0.5}, 5: {"val/acc": 0.5 + lr}},
                    name=f"lr{lr}", config={"inner_lr": lr})  # fmt: skip
    rows = list(csv.DictReader(io.StringIO(compare.run([str(tmp_path), "--format", "csv"]))))
    assert [(r["label"], float(r["inner_lr"])) for r in rows] == [("lr0.1", 0.1), ("lr0.4", 0.4)]
    assert float(rows[1]["val/acc final"]) == pytest.approx(0.9) and rows[1]["n"] == "1"
    c = compare.compare(read_offline_runs([tmp_path]), ["val/acc"], [])
    out = json.loads(compare.to_json(c))
    assert out["metrics"][0] == {"name": "val/acc", "direction": "up", "best_row": "lr0.4"}
    table = compare.to_markdown(c).split("\n\n")[0].splitlines()
    assert len(table) == 4 and len({line.count("|") for line in table}) == 1
    assert "**0.9**" in table[3]  # the best final value, in bold


def test_plot_labels_bands_and_points(tmp_path):
    finals = [0.7, 0.8, 0.9]
    for seed, acc in enumerate(finals):
        offline_run(tmp_path, {0: {"val/acc": 0.5 + 0.01 * seed}, 1: {"val/acc": acc}},
                    config={"seed": seed, "algorithm": "maml"},
                    summary={"test/acc": acc})  # fmt: skip
    png = tmp_path / "plots" / "cmp.png"
    compare.run([str(tmp_path), "--group-by", "algorithm", "--plot", str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = read_offline_runs([tmp_path])
    c = compare.compare(runs, ["val/acc", "test/acc"], ["algorithm"])
    val, test = compare.figure(c).axes
    assert val.get_ylabel() == "val/acc (higher is better)" and val.get_xlabel() == "step"
    (band,) = val.collections
    ys = band.get_paths()[0].vertices[:, 1]
    for values in ([0.5, 0.51, 0.52], finals):  # at each step: mean ± t CI of the 3 seeds
        mean = sum(values) / 3
        half = T975[2] * math.sqrt(sum((v - mean) ** 2 for v in values) / 2) / math.sqrt(3)
        top = min(mean + half, 1.0)  # an accuracy's band stops at 1 (0.8 + 0.25 here)
        assert min(abs(ys - (mean - half))) < 1e-4 and min(abs(ys - top)) < 1e-4
    assert ys.max() == 1.0
    assert test.get_ylabel() == "test/acc (higher is better)"
    (bars,) = test.containers  # one group: a point with its interval as an error bar
    segment = bars.lines[2][0].get_segments()[0][:, 1]
    mean = sum(finals) / 3
    half = T975[2] * math.sqrt(sum((v - mean) ** 2 for v in finals) / 2) / math.sqrt(3)
    assert mean + half > 1 and segment == pytest.approx([mean - half, 1.0], rel=1e-4)


def test_the_legend_is_beside_the_panels_not_on_the_data(tmp_path):
    for seed, acc in enumerate([0.6, 0.7]):
        offline_run(tmp_path, {0: {"val/acc": 0.5}, 1: {"val/acc": acc}},
                    config={"seed": seed, "inner_lr": 0.1 * (seed + 1)},
                    summary={"test/acc": acc})  # fmt: skip
    c = compare.compare(read_offline_runs([tmp_path]), ["val/acc", "test/acc"], [])
    fig = compare.figure(c)
    fig.canvas.draw()  # lay out: the constrained layout places the legend
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [f"{r.label} (n=1)" for r in c.rows]
    box = legend.get_window_extent()
    assert all(not box.overlaps(ax.get_window_extent()) for ax in fig.axes)
    assert all(ax.get_legend() is None for ax in fig.axes)


def test_curvature_is_drawn_and_has_no_best(tmp_path, capsys):
    # Measured every 2 steps, beside a training loss logged every step (--curvature-every 2).
    rows = {s: {"train/loss": 1.0 - 0.1 * s} for s in range(5)}
    for s, (eig, seconds) in zip((2, 4), ((3.0, 0.5), (5.0, 0.7))):
        rows[s] |= {"curv/meta_top_eig": eig, "curv/two_over_inner_lr": 5.0,
                    "perf/curvature_s": seconds}  # fmt: skip
    offline_run(tmp_path, rows, name="curv", config={"seed": 0})
    metrics = ["curv/meta_top_eig", "curv/two_over_inner_lr", "perf/curvature_s"]
    out = run_json(capsys, str(tmp_path), "--metrics", *metrics)
    assert [m["direction"] for m in out["metrics"]] == [None, None, "down"]
    eig = out["rows"][0]["metrics"]["curv/meta_top_eig"]
    assert eig == {"final": {"value": 5.0, "ci95": None, "n": 1}, "best": None}
    assert "curv/meta_top_eig: direction unknown, final value only" in out["notes"]
    c = compare.compare(read_offline_runs([tmp_path]), metrics[:1], [])
    (ax,) = compare.figure(c).axes
    (line,) = ax.get_lines()  # a curve through the measured steps only
    assert list(line.get_xdata()) == [2, 4] and list(line.get_ydata()) == [3.0, 5.0]
    assert ax.get_ylabel() == "curv/meta_top_eig"


def test_missing_matplotlib_is_named_before_any_work(tmp_path):
    script = (
        "import runpy, sys; sys.modules['matplotlib'] = None; "
        f"sys.argv = ['metalearn-compare', {str(tmp_path / 'nope')!r}, '--plot', 'x.png']; "
        "runpy.run_module('metalearn.tools.compare', run_name='__main__', alter_sys=True)"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == (
        "metalearn-compare: error: --plot needs matplotlib: pip install 'metalearn[plots]'"
    )


def test_user_errors_are_one_line(tmp_path, capsys, monkeypatch):
    missing = tmp_path / "runs" / "wandb"
    assert f"no such run folder: {missing}" in usage_error(capsys, str(missing))
    # ENTITY/PROJECT is read online only when asked, even if it looks like a typo'd folder.
    assert "add --online" in usage_error(capsys, "my-entity/my-project")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    err = usage_error(capsys, "my-entity/my-project", "--online")
    assert "my-entity/my-project" in err and "wandb login" in err
    assert "add --online" in usage_error(capsys, str(tmp_path), "--filter", "config.seed=0")
    assert "no W&B runs under" in usage_error(capsys, str(tmp_path))
    assert ".png" in usage_error(capsys, str(tmp_path), "--plot", str(tmp_path / "p.txt"))
    offline_run(tmp_path, {0: {"mystery": 1.0}}, config={"seed": 0})
    assert "--group-by algo: no run has" in usage_error(capsys, str(tmp_path), "--group-by", "algo")
    assert "(logged: mystery)" in usage_error(capsys, str(tmp_path))


def _trained_and_evaluated(tmp_path: Path) -> dict[str, Path]:
    """Two training runs, an evaluation of the first (a better number, other shots), a run
    recorded before job types (train) and an old evaluation tagged eval."""
    dirs = {}
    for name, algorithm, acc in (("a", "maml", 0.90), ("b", "fomaml", 0.80)):
        dirs[name] = offline_run(tmp_path, {0: {"val/acc": acc - 0.1}, 1: {"val/acc": acc}},
                                 name=name, job_type="train", config={"algorithm": algorithm},
                                 summary={"test/acc": acc})  # fmt: skip
    a_id = read_offline_runs([dirs["a"]])[0].run_id
    dirs["eval"] = offline_run(
        tmp_path, {}, name="a-eval-x1", job_type="eval", tags=["eval"],
        config={"run": "a", "training_run_id": a_id, "shots": 5, "steps": 10, "tasks": 600,
                "which": "best", "recipe": {"learner": {"algorithm": "maml"}}},
        summary={"test/acc": 0.99},
    )  # fmt: skip
    dirs["old"] = offline_run(tmp_path, {0: {"val/acc": 0.5}}, name="old",
                              config={"algorithm": "maml"}, summary={"test/acc": 0.7})  # fmt: skip
    dirs["old-eval"] = offline_run(tmp_path, {}, name="old-eval", tags=["eval"],
                                   config={"run": "old"}, summary={"test/acc": 0.95})  # fmt: skip
    return dirs


def test_training_runs_are_ranked_alone_and_evaluations_shown_beside_them(tmp_path, capsys):
    _trained_and_evaluated(tmp_path)
    out = run_json(capsys, str(tmp_path), "--metrics", "test/acc")
    assert [r["label"] for r in out["rows"]] == ["a", "b", "old"]
    assert out["metrics"][0]["best_row"] == "a"  # not the evaluation's 0.99
    out = run_json(capsys, str(tmp_path), "--metrics", "test/acc", "--group-by", "algorithm")
    assert [r["label"] for r in out["rows"]] == ["algorithm=maml", "algorithm=fomaml"]
    out = run_json(capsys, str(tmp_path), "--metrics", "test/acc", "--evals")
    labels = [r["label"] for r in out["rows"]]
    assert labels == ["a", "↳ a-eval-x1 (eval: 5 shots, 10 steps, 600 tasks, best weights)",
                      "b", "old", "↳ old-eval (eval)"]  # fmt: skip
    assert [r["evaluates"] for r in out["rows"]] == [None, "a", None, None, "old"]
    assert out["rows"][1]["metrics"]["test/acc"]["final"]["value"] == 0.99
    assert out["metrics"][0]["best_row"] == "a"
    text = compare.run([str(tmp_path), "--metrics", "test/acc", "--evals"])
    capsys.readouterr()
    assert "**0.9**" in text and "**0.99**" not in text
    for fmt in ("markdown", "csv"):  # evaluations beside groups of runs with a history
        text = compare.run([str(tmp_path), "--group-by", "algorithm", "--evals", "--format", fmt])
        assert "a-eval-x1" in text and "old-eval" in text
    out = run_json(capsys, str(tmp_path), "--metrics", "test/acc", "--job-type", "eval")
    assert [r["label"] for r in out["rows"]] == ["a-eval-x1", "old-eval"]
    err = usage_error(capsys, str(tmp_path), "--job-type", "sweep")
    assert "no sweep runs in" in err and "job types there: eval, train" in err


def test_a_nested_config_is_dotted_keys_that_add_to_the_flat_ones(tmp_path, capsys):
    config = {"inner_lr": 0.1, "seed": 0, "recipe": {
        "experiment": "omniglot_maml", "version": 1,
        "learner": {"algorithm": "maml", "arguments": {"inner_lr": 0.1, "first_order": False}},
        "data": {"image": {"size": 28, "channels": 1}}}}  # fmt: skip
    assert compare.flatten_config(config) == {
        "inner_lr": 0.1, "seed": 0, "recipe.experiment": "omniglot_maml", "recipe.version": 1,
        "learner.algorithm": "maml", "learner.first_order": False, "data.image.size": 28,
        "data.image.channels": 1}  # fmt: skip
    for lr, first_order in ((0.1, False), (0.4, True)):
        recipe = {**config["recipe"], "learner": {"algorithm": "maml", "arguments": {
            "inner_lr": lr, "first_order": first_order}}}  # fmt: skip
        offline_run(tmp_path, {0: {"val/acc": lr}}, name=f"lr{lr}",
                    config={"inner_lr": lr, "recipe": recipe})  # fmt: skip
    out = run_json(capsys, str(tmp_path), "--metrics", "val/acc")
    assert [r["config"] for r in out["rows"]] == [
        {"inner_lr": 0.1, "learner.first_order": False},
        {"inner_lr": 0.4, "learner.first_order": True}]  # fmt: skip
    out = run_json(capsys, str(tmp_path), "--metrics", "val/acc", "--group-by",
                   "learner.first_order")  # fmt: skip
    assert [r["label"] for r in out["rows"]] == ["learner.first_order=False",
                                                 "learner.first_order=True"]  # fmt: skip


def test_a_resumed_runs_time_is_summed_over_its_segments(tmp_path, capsys):
    offline_run(tmp_path, {0: {"train/loss": 1.0}}, name="r", run_id="r1")  # killed: no total
    offline_run(tmp_path, {1: {"train/loss": 0.5}}, run_id="r1",
                summary={"perf/total_minutes": 3.0})  # fmt: skip
    offline_run(tmp_path, {0: {"train/loss": 0.4}, 1: {"train/loss": 0.3}}, name="straight",
                summary={"perf/total_minutes": 4.0})  # fmt: skip
    (resumed,) = [r for r in read_offline_runs([tmp_path]) if r.run_id == "r1"]
    first_segment = resumed.segment_summaries[0]
    assert "perf/total_minutes" not in first_segment
    out = run_json(capsys, str(tmp_path), "--metrics", "perf/total_minutes")
    minutes = {r["label"]: r["metrics"]["perf/total_minutes"]["final"]["value"]
               for r in out["rows"]}  # fmt: skip
    assert minutes["r"] == pytest.approx(3.0 + first_segment["_runtime"] / 60, rel=1e-12)
    assert minutes["straight"] == 4.0 and out["metrics"][0]["best_row"] == "r"
    assert "perf/total_minutes: a resumed run's is the sum over its segments" in out["notes"]


def test_help_lists_each_flag_once_and_a_bad_flag_is_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        compare.main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    for name in ("--metrics", "--group-by", "--job-type", "--evals", "--format", "--plot",
                 "--online", "--filter"):  # fmt: skip
        assert len(re.findall(rf"(?<![\w-]){name}(?=[ ,])", out)) == 1, name
    assert "did you mean --group-by" in usage_error(capsys, "x", "--group_bye", "seed")
    assert "give the runs to compare" in usage_error(capsys)


def test_a_run_folder_with_two_wandb_files_is_ranked_once_with_a_warning(tmp_path):
    runs = {name: offline_run(tmp_path, {0: {"val/acc": acc}, 1: {"val/acc": acc + 0.1}},
                              name=name, config={"inner_lr": lr})
            for name, acc, lr in (("a", 0.5, 0.1), ("b", 0.6, 0.4))}  # fmt: skip
    original = wandb_file(runs["a"])
    copy = original.with_name("run-copy.wandb")  # e.g. a file copied into the folder by hand
    copy.write_bytes(original.read_bytes())
    written = original.stat().st_mtime
    os.utime(copy, (written - 60, written - 60))  # the copy is the older file
    done = subprocess.run(
        [sys.executable, "-m", "metalearn.tools.compare", str(tmp_path),
         "--metrics", "val/acc", "--format", "json"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert [r["label"] for r in out["rows"]] == ["a", "b"]  # each run once
    finals = {r["label"]: r["metrics"]["val/acc"]["final"]["value"] for r in out["rows"]}
    assert finals == {"a": pytest.approx(0.6), "b": pytest.approx(0.7)}
    assert out["metrics"][0]["best_row"] == "b"
    warning = [line for line in done.stderr.splitlines() if "2 .wandb files" in line]
    assert len(warning) == 1 and str(runs["a"]) in warning[0], done.stderr
    assert f"reading {original.name}, the last written (not run-copy.wandb)" in warning[0]


def test_one_project_by_default_and_the_group_and_tag_filters(tmp_path, capsys):
    for name, project, group, tags in (
        ("o1", "omni", "g1", ["maml"]),
        ("o2", "omni", "g2", []),
        ("o3", "omni", "g1", []),
        ("s1", "sine", "g1", ["maml"]),
    ):
        offline_run(tmp_path, {0: {"val/acc": 0.5}}, name=name, project=project, group=group,
                    tags=tags, config={"lr": len(name)})  # fmt: skip
    out = run_json(capsys, str(tmp_path))
    assert [r["label"] for r in out["rows"]] == ["o1", "o2", "o3"]  # the project with most runs
    assert compare.main([str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert "comparing project omni (3 runs); also here: sine (1); pass --project" in err
    out = run_json(capsys, str(tmp_path), "--project", "sine")
    assert [r["label"] for r in out["rows"]] == ["s1"]
    out = run_json(capsys, str(tmp_path), "--group", "g1")
    assert [r["label"] for r in out["rows"]] == ["o1", "o3"]
    out = run_json(capsys, str(tmp_path), "--group", "g1", "--group", "g2", "--tag", "maml")
    assert [r["label"] for r in out["rows"]] == ["o1"]
    assert (
        "--project mnist: no run of that project here (projects: omni (3 runs), sine (1 "
        "runs))" in usage_error(capsys, str(tmp_path), "--project", "mnist")
    )
    assert "no run in group g2 with tags maml (groups: g1, g2; tags: maml)" in usage_error(
        capsys, str(tmp_path), "--group", "g2", "--tag", "maml"
    )


def test_a_plot_over_an_existing_file_needs_overwrite_and_is_written_whole(tmp_path, capsys):
    offline_run(tmp_path, {0: {"val/acc": 0.5}, 1: {"val/acc": 0.7}}, config={"seed": 0})
    png = tmp_path / "cmp.png"
    png.write_bytes(b"an earlier plot")
    err = usage_error(capsys, str(tmp_path), "--plot", str(png))
    assert err.strip() == (f"metalearn-compare: error: --plot {png} exists; pass --overwrite "
                           "to replace it, or another name")  # fmt: skip
    assert png.read_bytes() == b"an earlier plot"
    assert compare.main([str(tmp_path), "--plot", str(png), "--overwrite"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(tmp_path.glob(".*")) == []  # no temporary file left beside it
    capsys.readouterr()
    (tmp_path / "folder.png").mkdir()
    err = usage_error(capsys, str(tmp_path), "--plot", str(tmp_path / "folder.png"), "--overwrite")
    assert f"--plot {tmp_path / 'folder.png'} is a folder; give a file name" in err


def test_a_metric_no_run_logged_is_refused_naming_those_logged(tmp_path, capsys):
    offline_run(tmp_path, {0: {"val/acc": 0.5, "train/loss": 1.0}}, config={"seed": 0},
                summary={"test/acc": 0.6})  # fmt: skip
    err = usage_error(capsys, str(tmp_path), "--metrics", "val/acc", "val/accuracy")
    assert err.strip() == ("metalearn-compare: error: --metrics val/accuracy: no run logged it; "
                           "the runs logged test/acc, train/loss, val/acc")  # fmt: skip
    assert "no run logged them" in usage_error(capsys, str(tmp_path), "--metrics", "a", "b")


def test_a_fifo_named_as_a_runs_file_is_refused_not_waited_on(tmp_path, capsys):
    """wandb's reader (a wandb-core child) would wait for a writer for ever: the command runs
    in a child with a timeout, so a hang fails the test instead of stalling it."""
    run_dir = tmp_path / "wandb" / "offline-run-20260101_000000-abcd1234"
    run_dir.mkdir(parents=True)
    fifo = run_dir / "run-abcd1234.wandb"
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for source in (tmp_path, fifo):
        done = subprocess.run([sys.executable, "-m", "metalearn.tools.compare", str(source)],
                              capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
        assert done.returncode == 2 and done.stdout == ""
        assert done.stderr.strip() == (f"metalearn-compare: error: W&B run file {fifo} is a FIFO "
                                       "(named pipe); give a regular file")  # fmt: skip


def test_a_reader_that_leaves_ends_the_comparison_quietly(tmp_path):
    """``metalearn-compare ... | head -1``: status 141, nothing on stderr."""
    from tests.tools.test_tools import closed_stdout

    offline_run(tmp_path, {0: {"val/acc": 0.5}, 1: {"val/acc": 0.7}}, config={"seed": 0})
    done = closed_stdout([sys.executable, "-m", "metalearn.tools.compare", str(tmp_path)])
    assert (done.returncode, done.stderr) == (141, "")
