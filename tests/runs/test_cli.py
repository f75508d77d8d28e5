"""parse_dataclass: typed flat flags from a nested argument dataclass (tyro), presets, resume
defaults, one-line errors; flatten / unflatten between the groups and the flat names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import pytest

from metalearn.runs.cli import flat_fields, flatten, parse_dataclass, replace_flat, unflatten


@dataclass
class Data:
    """Where the data comes from."""

    root: str | None = None
    """Where data lives."""
    augment: bool = False
    """Distort the training images."""


@dataclass
class Learner:
    """How the model learns."""

    inner_lr: float = 0.4
    """Inner learning rate."""
    steps: int = 3
    """How many steps."""


@dataclass
class Args:
    """Example arguments."""

    preset: Literal["small", "big"] = "small"
    """Named configuration."""
    data: Data = field(default_factory=Data)
    """Data options."""
    learner: Learner = field(default_factory=Learner)
    """Learner options."""
    track: bool = True
    """Log to W&B."""


PRESETS = {"small": {}, "big": {"steps": 100, "inner_lr": 0.1}}


def parse(argv, **kwargs):
    return parse_dataclass(Args, argv, presets=PRESETS, **kwargs)


def test_types_defaults_and_flat_flags_into_groups():
    args = parse(["--steps", "7", "--root", "/d", "--no-track", "--augment"])
    assert args == Args(data=Data("/d", True), learner=Learner(0.4, 7), track=False)
    assert parse([]) == Args()
    assert parse(["--root", "none"]).data.root is None
    assert parse(["--root", "None"]).data.root is None


def test_preset_applies_and_explicit_flags_win():
    args = parse(["--preset", "big", "--inner-lr", "0.2"])
    assert (args.preset, args.learner.steps, args.learner.inner_lr) == ("big", 100, 0.2)
    assert parse(["--preset=big"]).learner.steps == 100


def test_booleans_take_the_forms_a_sweep_agent_passes():
    assert parse(["--augment=True"]).data.augment is True
    assert parse(["--augment=False"]).data.augment is False
    assert parse(["--track=false"]).track is False
    assert parse(["--no-augment"]).data.augment is False


def test_underscore_and_equals_forms_as_wandb_agent_passes_them():
    args = parse(["--inner_lr=0.3", "--root=/d", "--steps", "4"])
    assert (args.learner.inner_lr, args.data.root, args.learner.steps) == (0.3, "/d", 4)


def test_bad_values_are_one_line_and_exit_2(capsys):
    for argv, expected in (
        (["--preset", "huge"], "huge"),
        (["--steps", "many"], "--steps"),
        (["--augment=maybe"], "augment"),
    ):
        with pytest.raises(SystemExit) as stop:
            parse(argv)
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "error:" in err and expected in err, err


def test_a_typo_names_the_closest_flags_in_one_line(capsys):
    with pytest.raises(SystemExit) as stop:
        parse(["--iner-lr", "0.3"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--iner-lr; did you mean --inner-lr" in err


def test_help_is_grouped_lists_each_flag_once_and_shows_the_presets_values(capsys):
    with pytest.raises(SystemExit) as stop:
        parse(["--preset", "big", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "How many steps. (default: 100)" in out and "(default: 0.1)" in out
    assert "data options" in out.lower() and "learner options" in out.lower()
    assert out.count("--inner-lr") == 1 and out.count("--no-track") == 1


def test_base_replaces_the_defaults_and_ignores_presets():
    saved = Args(preset="big", data=Data("/saved"), learner=Learner(0.1, 100), track=False)
    assert parse([], base=saved) == saved
    assert parse(["--steps", "5"], base=saved).learner.steps == 5
    assert parse(["--steps", "5"], base=saved).data.root == "/saved"


def test_flat_names_round_trip_through_the_groups():
    args = Args(data=Data("/d", True), learner=Learner(0.2, 9), track=False)
    flat = flatten(args)
    assert flat == {"preset": "small", "root": "/d", "augment": True, "inner_lr": 0.2,
                    "steps": 9, "track": False}  # fmt: skip
    assert unflatten(Args, flat) == args
    assert unflatten(Args, {"steps": 2}) == Args(learner=Learner(steps=2))
    assert replace_flat(args, root="/e").data == Data("/e", True)
    assert flat_fields(Args)["inner_lr"] == ("learner", "inner_lr")
    with pytest.raises(ValueError, match="did you mean inner_lr"):
        unflatten(Args, {"inner_lrr": 1.0})


def test_a_leaf_name_used_twice_is_refused():
    @dataclass
    class Twice:
        a: Data = field(default_factory=Data)
        b: Data = field(default_factory=Data)

    with pytest.raises(TypeError, match="appears twice"):
        flat_fields(Twice)
