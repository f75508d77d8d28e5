"""Run plumbing: resume merging, checkpoints, seeding, and building exactly what is recorded."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from metalearn.algorithms import FOMAML, IMAML, Reptile
from metalearn.algorithms.build import build_learner, learner_config, resolve_learner_args
from metalearn.checkpoint import load_checkpoint, save_checkpoint
from metalearn.runs.lifecycle import RunState, UserError, merge_resumed_args
from metalearn.runs.seeding import seed_everything

ARGS = {"algorithm": "maml", "ways": 5, "hidden": 8, "vectorize": "auto", "inner_lr": None,
        "inner_steps": None, "cg_damping": None}  # fmt: skip


def test_merge_keeps_the_saved_run_and_names_both_values():
    saved = {"algorithm": "fomaml", "iterations": 10, "seed": 0}
    merged = merge_resumed_args(saved, {"algorithm": None, "iterations": 20, "seed": 0},
                                changeable={"iterations"})  # fmt: skip
    assert merged == {"algorithm": "fomaml", "iterations": 20, "seed": 0}
    with pytest.raises(UserError, match="--seed 7 differs from the resumed run's 0"):
        merge_resumed_args(saved, {"seed": 7}, changeable={"iterations"})


def test_run_state_round_trips_through_a_checkpoint(tmp_path):
    state = RunState("r", iteration=3, best_val=0.5, history=[{"step": 1, "train/loss": 1.0}])
    save_checkpoint(tmp_path / "c.pt", {"args": {}, **state.to_dict()})
    assert RunState.from_dict(load_checkpoint(tmp_path / "c.pt")) == state


def test_a_killed_writers_temporary_file_is_removed_by_the_next_save(tmp_path):
    orphan = tmp_path / ".checkpoint.pt.abc123.tmp"  # what save_checkpoint's mkstemp names
    orphan.write_bytes(b"half a checkpoint")
    other = tmp_path / ".other.pt.abc123.tmp"  # another target's: not ours to remove
    other.write_bytes(b"x")
    save_checkpoint(tmp_path / "checkpoint.pt", {"w": torch.ones(2)})
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.pt.abc123.tmp", "checkpoint.pt"]
    assert torch.equal(load_checkpoint(tmp_path / "checkpoint.pt")["w"], torch.ones(2))


def test_seed_everything_repeats_python_numpy_and_torch():
    def draws():
        return random.random(), np.random.rand(), torch.rand(1).item()  # noqa: NPY002

    seed_everything(3)
    first = draws()
    seed_everything(3)
    assert draws() == first
    seed_everything(4)
    assert draws() != first
    with pytest.raises(ValueError, match="seed=-1 is out of range"):
        seed_everything(-1)


@pytest.mark.parametrize(
    ("algorithm", "cls", "lr", "steps", "damping"),
    [("fomaml", FOMAML, 0.4, 1, None), ("imaml", IMAML, 0.1, 5, 10.0),
     ("reptile", Reptile, 0.4, 5, None)],
)  # fmt: skip
def test_open_values_come_from_one_table_and_are_built_as_resolved(
    algorithm, cls, lr, steps, damping
):
    resolved = resolve_learner_args({**ARGS, "algorithm": algorithm})
    assert (resolved["inner_lr"], resolved["inner_steps"], resolved["cg_damping"]) == (
        lr,
        steps,
        damping,
    )
    learner = build_learner(resolved)
    assert type(learner) is cls and (learner.inner_lr, learner.inner_steps) == (lr, steps)
    assert learner_config(resolved)["class"] == cls.__name__
    # Given values win, and are built exactly (no hidden floor or cap).
    given = resolve_learner_args(
        {**ARGS, "algorithm": algorithm, "inner_lr": 0.3, "inner_steps": 2}
    )
    assert (build_learner(given).inner_lr, build_learner(given).inner_steps) == (0.3, 2)


def test_build_learner_refuses_missing_or_open_keys():
    with pytest.raises(ValueError, match=r"lack \['hidden'\]"):
        build_learner({k: v for k, v in resolve_learner_args(ARGS).items() if k != "hidden"})
    with pytest.raises(ValueError, match="are None; pass the args through"):
        build_learner(ARGS)
    with pytest.raises(ValueError, match="cg_damping=1.0 is an iMAML setting"):
        resolve_learner_args({**ARGS, "cg_damping": 1.0})
    with pytest.raises(ValueError, match="unknown algorithm 'mamI'"):
        resolve_learner_args({**ARGS, "algorithm": "mamI"})
