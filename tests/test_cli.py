"""parse_dataclass: typed flags from an argument dataclass, presets, help from docstrings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import pytest

from metalearn.runs.cli import field_docs, parse_dataclass


@dataclass
class Args:
    """Example arguments."""

    preset: Literal["small", "big"] = "small"
    """Named configuration."""
    steps: int = 3
    """How many steps."""
    lr: float = 0.5
    """Learning rate."""
    root: str | None = None
    """Where data lives."""
    track: bool = True
    """Log to W&B."""


PRESETS = {"small": {}, "big": {"steps": 100, "lr": 0.1}}


def test_types_defaults_and_flags():
    args = parse_dataclass(Args, ["--steps", "7", "--root", "/d", "--no-track"], presets=PRESETS)
    assert args == Args(steps=7, lr=0.5, root="/d", track=False)
    assert parse_dataclass(Args, [], presets=PRESETS) == Args()
    assert parse_dataclass(Args, ["--root", "none"], presets=PRESETS).root is None


def test_preset_applies_and_explicit_flags_win():
    args = parse_dataclass(Args, ["--preset", "big", "--lr", "0.2"], presets=PRESETS)
    assert (args.preset, args.steps, args.lr) == ("big", 100, 0.2)


def test_bad_values_are_rejected(capsys):
    with pytest.raises(SystemExit):
        parse_dataclass(Args, ["--preset", "huge"], presets=PRESETS)
    with pytest.raises(SystemExit):
        parse_dataclass(Args, ["--steps", "many"], presets=PRESETS)
    assert "invalid int value" in capsys.readouterr().err


def test_help_comes_from_field_docstrings(capsys):
    assert field_docs(Args)["lr"] == "Learning rate."
    with pytest.raises(SystemExit):
        parse_dataclass(Args, ["--help"], presets=PRESETS)
    out = capsys.readouterr().out
    assert "How many steps. (default: 3)" in out and "--no-track" in out


def test_underscore_and_equals_forms_as_wandb_agent_passes_them():
    args = parse_dataclass(Args, ["--lr=0.3", "--root=/d", "--steps", "4"], presets=PRESETS)
    assert (args.lr, args.root, args.steps) == (0.3, "/d", 4)


@dataclass
class Snake:
    """Arguments with multi-word names."""

    inner_lr: float = 0.4
    """Inner learning rate."""
    outer_lr: float = 0.001
    """Outer learning rate."""


def test_both_spellings_of_a_multi_word_flag():
    assert parse_dataclass(Snake, ["--inner_lr=0.3"]).inner_lr == 0.3
    assert parse_dataclass(Snake, ["--inner-lr", "0.2", "--outer_lr", "0.5"]) == Snake(0.2, 0.5)


def test_a_typo_names_the_closest_flags(capsys):
    with pytest.raises(SystemExit):
        parse_dataclass(Snake, ["--iner-lr", "0.3"])
    err = capsys.readouterr().err
    assert "--iner-lr: did you mean --inner-lr" in err and "--inner_lr" not in err.split(":")[-1]


def test_help_shows_the_chosen_presets_values(capsys):
    with pytest.raises(SystemExit):
        parse_dataclass(Args, ["--preset", "big", "--help"], presets=PRESETS)
    out = capsys.readouterr().out
    assert "How many steps. (default: 100)" in out and "Learning rate. (default: 0.1)" in out


def test_base_replaces_the_defaults_and_ignores_presets():
    saved = Args(preset="big", steps=100, lr=0.1, root="/saved", track=False)
    assert parse_dataclass(Args, [], presets=PRESETS, base=saved) == saved
    assert parse_dataclass(Args, ["--steps", "5"], presets=PRESETS, base=saved).steps == 5
