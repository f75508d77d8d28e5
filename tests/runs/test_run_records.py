"""Reading runs back: offline runs written here by wandb itself, read with wandb's reader."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from metalearn.runs.records import (
    STALE_AFTER_S,
    find_run_dirs,
    read_offline_run,
    read_offline_runs,
)


def offline_run(
    tmp_path: Path,
    rows: dict[int, dict[str, float]],
    *,
    config: dict[str, Any] | None = None,
    summary: dict[str, float] | None = None,
    run_id: str | None = None,
    **init: Any,
) -> Path:
    """A finished offline run under ``tmp_path/wandb`` with ``rows`` logged at their steps;
    ``run_id`` resumes (or starts) that run. Returns its run folder."""
    import wandb

    run = wandb.init(
        project=init.pop("project", "t"), mode="offline", dir=tmp_path, config=config or {},
        id=run_id, resume="allow" if run_id else None, **init,
    )  # fmt: skip
    for step, row in rows.items():
        run.log(row, step=step)
    run.summary.update(summary or {})
    run.finish()
    # finish() can return before wandb's service has written the run's file (seen here: 7
    # bytes right after it, the whole 15 KB 50 ms later); teardown waits for the service.
    wandb.teardown()
    return Path(run.dir).parent


def wandb_file(run_dir: Path) -> Path:
    (file,) = run_dir.glob("*.wandb")
    return file


def damage(run_dir: Path, how: str) -> Path:
    """Cut the run's file in half, overwrite bytes in its middle, or replace its header."""
    file = wandb_file(run_dir)
    data = file.read_bytes()
    half = len(data) // 2
    if how == "truncate":
        file.write_bytes(data[:half])
    elif how == "corrupt":
        file.write_bytes(data[:half] + b"\xff" * 64 + data[half + 64 :])
    else:
        file.write_bytes(b"not a W&B log" + data[13:])
    return file


def age(file: Path, seconds: float) -> None:
    """Set the file's modification time ``seconds`` into the past."""
    then = time.time() - seconds
    os.utime(file, (then, then))


def test_offline_run_round_trip(tmp_path):
    run_dir = offline_run(
        tmp_path, {s: {"train/loss": 1 / (s + 2), "val/acc": 0.5 + 0.1 * s} for s in range(4)},
        config={"inner_lr": 0.4, "algorithm": "maml"}, summary={"test/acc": 0.91},
        name="lr0.4", group="sweep", tags=["maml"],
    )  # fmt: skip
    record = read_offline_run(run_dir)
    assert (record.name, record.group, record.tags) == ("lr0.4", "sweep", ["maml"])
    assert record.config == {"inner_lr": 0.4, "algorithm": "maml"}
    assert record.state == "finished" and record.problems == []
    assert record.run_id and record.segments == [str(run_dir)]
    steps, losses = record.series("train/loss")
    assert steps == [0, 1, 2, 3]
    assert losses == pytest.approx([1 / 2, 1 / 3, 1 / 4, 1 / 5])
    assert record.summary["test/acc"] == pytest.approx(0.91)
    assert record.summary["val/acc"] == pytest.approx(0.8)  # the last logged value


def test_resumed_run_is_one_record(tmp_path):
    first = offline_run(
        tmp_path, {s: {"train/loss": 10.0 + s, "val/acc": 0.1 * s} for s in range(4)},
        config={"lr": 0.1, "out_dir": "a"}, summary={"note/first": 1.0}, run_id="res1",
        name="resumed", group="g", tags=["t1"],
    )  # fmt: skip
    # Resumed from a checkpoint at step 2: steps 2-3 run again, then 4-5 are new.
    second = offline_run(
        tmp_path, {s: {"train/loss": 20.0 + s} for s in range(2, 6)},
        config={"lr": 0.1, "out_dir": "b"}, run_id="res1",
    )  # fmt: skip
    other = offline_run(tmp_path, {0: {"train/loss": 1.0}}, name="other")
    runs = read_offline_runs([tmp_path / "wandb"])
    assert [r.name for r in runs] == ["resumed", "other"]  # in the order they started
    run = runs[0]
    assert run.segments == [str(first), str(second)] and run.path == str(second)
    steps, losses = run.series("train/loss")
    assert steps == [0, 1, 2, 3, 4, 5]
    assert losses == [10.0, 11.0, 22.0, 23.0, 24.0, 25.0]  # the later segment wins
    # A key the later segment did not log again at a step stays from the earlier one.
    assert run.series("val/acc") == ([0, 1, 2, 3], pytest.approx([0.0, 0.1, 0.2, 0.3]))
    assert run.config["out_dir"] == "b"  # the latest segment's config
    assert (run.group, run.tags, run.state) == ("g", ["t1"], "finished")
    assert run.summary["train/loss"] == 25.0 and run.summary["note/first"] == 1.0
    assert runs[1].segments == [str(other)]


def test_damaged_files_are_named_and_never_stop_the_rest(tmp_path):
    good = offline_run(tmp_path, {s: {"train/loss": float(s)} for s in range(3)}, name="good")
    rows = {s: {"train/loss": float(s), "pad": "x" * 200} for s in range(20)}
    cut = offline_run(tmp_path, rows, name="cut")
    bad = offline_run(tmp_path, rows, name="bad")
    junk = offline_run(tmp_path, rows, name="junk")
    cut_file, bad_file = damage(cut, "truncate"), damage(bad, "corrupt")
    junk_file = damage(junk, "header")
    age(cut_file, 2 * STALE_AFTER_S)
    runs = {r.path: r for r in read_offline_runs([tmp_path])}
    assert len(runs) == 4
    assert runs[str(good)].state == "finished" and runs[str(good)].problems == []
    assert runs[str(good)].series("train/loss")[1] == [0.0, 1.0, 2.0]
    truncated = runs[str(cut)]
    assert truncated.state == "truncated" and truncated.run_id
    (problem,) = truncated.problems
    assert str(cut_file) in problem and "killed or interrupted" in problem
    assert len(truncated.series("train/loss")[1]) < 20  # what was written before the cut
    corrupt = runs[str(bad)]
    assert corrupt.state == "corrupt" and str(bad_file) in corrupt.problems[0]
    unreadable = runs[str(junk)]
    assert unreadable.state == "corrupt" and unreadable.run_id == "" and not unreadable.history
    assert str(junk_file) in unreadable.problems[0] and "unreadable" in unreadable.problems[0]


def test_unfinished_file_written_recently_is_a_running_run(tmp_path):
    # A live run flushes every 15 s, so a file without an exit record is running only while
    # it is fresh; the same bytes left alone for longer are a run that was stopped.
    cut = offline_run(tmp_path, {s: {"x": float(s), "pad": "x" * 200} for s in range(20)})
    file = damage(cut, "truncate")
    age(file, STALE_AFTER_S / 10)
    assert read_offline_run(cut).state == "running"
    age(file, STALE_AFTER_S * 1.5)
    assert read_offline_run(cut).state == "truncated"


def test_missing_or_empty_folders_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no such run folder: {tmp_path / 'nope'}"):
        find_run_dirs(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no W&B runs under"):
        find_run_dirs(tmp_path)
    with pytest.raises(FileNotFoundError, match="no W&B run at"):
        read_offline_run(tmp_path / "nope")


def test_each_run_folder_is_read_by_one_wandb_process(tmp_path, monkeypatch):
    from metalearn.runs import records

    for name in ("a", "b", "c"):
        offline_run(tmp_path, {0: {"val/acc": 0.5}, 1: {"val/acc": 0.6}}, name=name,
                    config={"lr": 0.1}, summary={"test/acc": 0.9}, project="p",
                    tags=["x"])  # fmt: skip
    calls: list[list[str]] = []
    real = records._leet

    def counted(cmd: list[str]) -> tuple[int, str, str]:
        calls.append(cmd)
        return real(cmd)

    monkeypatch.setattr(records, "_leet", counted)
    runs = read_offline_runs([tmp_path])
    assert len(calls) == 3 and sorted(r.name for r in runs) == ["a", "b", "c"]
    for r in runs:  # what the one read gives: identity, config, summary, history, state
        assert (r.project, r.tags, r.state, r.config) == ("p", ["x"], "finished", {"lr": 0.1})
        assert r.summary["test/acc"] == 0.9 and r.summary["val/acc"] == 0.6
        assert [h["val/acc"] for h in r.history] == [0.5, 0.6]


def test_records_that_are_not_json_name_their_file(tmp_path):
    """What ``wandb leet inspect --json`` printed is read line by line as JSON objects; a line
    that is none (another wandb's output) is one line naming the run's file, not a
    JSONDecodeError."""
    from metalearn.runs.records import RunReadError, _records

    file = tmp_path / "run-x.wandb"
    good = '{"type": "run", "run": {"run_id": "x"}}'
    assert _records(f"{good}\n", file) == [{"type": "run", "run": {"run_id": "x"}}]
    for bad in ("Reading run-x.wandb...", "[1, 2]"):
        with pytest.raises(RunReadError) as err:
            _records(f"{good}\n{bad}\n", file)
        assert str(err.value) == (f"wandb leet inspect printed line 2 of {file}'s records as "
                                  f"{bad!r}, not a JSON object; reading offline runs needs "
                                  "wandb >= 0.31 (pip install -U wandb)")  # fmt: skip
