"""The outer loop's optimizer and schedule (`metalearn.runs.outer_loop`): torch's own
schedulers and optimizers as the reference, the command line's refusals, records without
the settings, and a run resumed mid-schedule."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import wandb

from metalearn.algorithms import MAML, MAMLpp, Reptile
from metalearn.checkpoint import load_checkpoint
from metalearn.models import Conv4
from metalearn.runs.lifecycle import UserError
from metalearn.runs.outer_loop import build_outer_optimizer, clamp_meta_gradient, scheduled_lr
from metalearn.runs.recipe import Recipe
from metalearn.runs.records import read_offline_run
from metalearn.runs.run import load_samplers
from tests.conftest import HAS_OMNIGLOT, NO_OMNIGLOT, OMNIGLOT, ROOT
from tests.helpers.run_helpers import main_interrupted, make, om, recipe_of, seeded_learner


def training(**overrides) -> SimpleNamespace:
    """A `TrainingRecipe`'s outer-loop fields at their defaults, with ``overrides``."""
    fields = dict(outer_lr=1e-3, iterations=40, lr_schedule="constant", eta_min=0.0,
                  step_size=None, gamma=0.1, schedule_every=1, outer_optimizer=None,
                  outer_momentum=0.0, nesterov=False, weight_decay=0.0,
                  weight_decay_on="all")  # fmt: skip
    return SimpleNamespace(**{**fields, **overrides})


def torch_lrs(t: SimpleNamespace) -> list[float]:
    """The lr of each meta-step under torch's scheduler, stepped every ``schedule_every``."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=t.outer_lr)
    total = t.iterations // t.schedule_every
    sched = {
        "cosine": lambda: torch.optim.lr_scheduler.CosineAnnealingLR(opt, total, t.eta_min),
        "step": lambda: torch.optim.lr_scheduler.StepLR(opt, t.step_size, t.gamma),
        "linear": lambda: torch.optim.lr_scheduler.LinearLR(
            opt, 1.0, t.eta_min / t.outer_lr, total_iters=total
        ),
    }[t.lr_schedule]()
    lrs = []
    for step in range(t.iterations):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        if (step + 1) % t.schedule_every == 0:
            sched.step()
    return lrs


@pytest.mark.parametrize("every", [1, 5, 7])
@pytest.mark.parametrize(
    "schedule",
    [dict(lr_schedule="cosine", eta_min=1e-5), dict(lr_schedule="cosine"),
     dict(lr_schedule="step", step_size=2, gamma=0.5), dict(lr_schedule="step", step_size=1),
     dict(lr_schedule="linear", eta_min=2e-4), dict(lr_schedule="linear")],
)  # fmt: skip
def test_every_steps_lr_equals_torchs_scheduler(schedule, every):
    t = training(**schedule, schedule_every=every)
    if t.lr_schedule == "step" and t.step_size > t.iterations // every:
        pytest.skip("a schedule longer than the run is refused")
    ours = [scheduled_lr(t, step) for step in range(t.iterations)]
    # torch's cosine is a recurrence: it meets the closed form to float64 rounding.
    assert ours == pytest.approx(torch_lrs(t), rel=1e-12, abs=1e-18)
    assert len(set(ours)) > 1  # the schedule moves


@pytest.mark.parametrize("every", [1, 3])
def test_piecewise_equals_torchs_lambdalr(every):
    """--lr-schedule piecewise is LambdaLR of the step function its milestones and factors
    give, stepped every ``schedule_every`` meta-steps."""
    t = training(lr_schedule="piecewise", lr_milestones=(2, 5, 9), schedule_every=every,
                 lr_factors=(1.0, 0.06, 0.012, 0.0024), iterations=36)  # fmt: skip
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=t.outer_lr)

    def factor(k: int) -> float:
        return 1.0 if k < 2 else 0.06 if k < 5 else 0.012 if k < 9 else 0.0024

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    expected = []
    for step in range(t.iterations):
        expected.append(opt.param_groups[0]["lr"])
        opt.step()
        if (step + 1) % every == 0:
            sched.step()
    ours = [scheduled_lr(t, s) for s in range(t.iterations)]
    assert ours == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--lr-schedule", "piecewise", "--lr-milestones", "2", "4", "--lr-factors", "1", "0.5"],
      "--lr-factors has 2 values for 2 --lr-milestones"),
     (["--lr-schedule", "piecewise", "--lr-milestones", "4", "2", "--lr-factors", "1", "0.5",
       "0.1"], "--lr-milestones 4 2: must increase within [1, 10]"),
     (["--lr-schedule", "piecewise", "--lr-milestones", "2", "--lr-factors", "1", "-0.5"],
      "--lr-factors 1.0 -0.5: must be positive"),
     (["--lr-milestones", "2", "--lr-factors", "1", "0.5"],
      "--lr-milestones and --lr-factors are settings of --lr-schedule piecewise")],
)  # fmt: skip
def test_bad_piecewise_settings_are_one_line(flags, message):
    args = om.parse_args(["--iterations", "10", "--no-track", *flags])
    with pytest.raises(UserError, match=re.escape(message)) as err:
        om.resolve_args(args)
    assert "\n" not in str(err.value)


def test_constant_is_the_outer_lr_itself():
    assert {scheduled_lr(training(outer_lr=0.3), s) for s in range(40)} == {0.3}


def _conv4() -> Conv4:
    torch.manual_seed(0)
    return Conv4(in_channels=1, ways=5, hidden=4)


def test_the_defaults_are_the_learners_own_optimizers():
    for learner in (MAML(_conv4()), Reptile(_conv4())):
        ours = build_outer_optimizer(learner, training(outer_lr=0.5))
        own = learner.outer_optimizer(0.5)
        assert type(ours) is type(own)
        assert ours.state_dict() == own.state_dict()


def test_sgd_nesterov_with_weight_decay_steps_as_its_update():
    """One step of the built SGD against the update written out (torch's SGD, Nesterov):
    g' = g + wd p; b = g' (first step); p - lr (g' + mu b)."""
    learner = MAML(_conv4())
    opt = build_outer_optimizer(learner, training(outer_optimizer="sgd", outer_momentum=0.9,
                                                  nesterov=True, weight_decay=5e-4,
                                                  outer_lr=0.1))  # fmt: skip
    before = {k: p.detach().clone() for k, p in learner.named_parameters()}
    for p in learner.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    for k, p in learner.named_parameters():
        g = 1.0 + 5e-4 * before[k]
        torch.testing.assert_close(p.detach(), before[k] - 0.1 * (g + 0.9 * g))


def test_weight_decay_on_the_weights_is_tensorflows_l2_regularizer_on_the_kernels():
    """``--weight-decay-on weights`` against meta-dataset's regularizer written out: the
    penalty ``l2 ||w||^2`` of a Keras L2 on each convolution kernel and the head's weight
    matrix (``functional_backbones.weight_variable``) added to the meta-loss, Adam on the
    sum; torch's weight decay ``2 l2`` on those tensors alone is the same three steps, and
    the biases and batch-norm weights move as undecayed Adam moves them. Decaying every
    parameter (``all``) is another run."""
    torch.manual_seed(0)
    learner = MAML(Conv4(in_channels=1, ways=5, hidden=4, pool="max").double())
    kernels = [f"model.features.{i}.conv.weight" for i in range(4)] + ["model.head.weight"]
    start = {k: p.detach().clone() for k, p in learner.named_parameters()}
    grads = [{k: torch.randn_like(p) for k, p in start.items()} for _ in range(3)]
    l2, lr = 1e-4, 1e-3

    def stepped(weight_decay_on: str | None) -> dict:
        with torch.no_grad():
            for k, p in learner.named_parameters():
                p.copy_(start[k])
        if weight_decay_on is None:  # the reference: Adam on the meta-loss plus the penalty
            opt = torch.optim.Adam(learner.parameters(), lr=lr)
        else:
            t = training(outer_lr=lr, weight_decay=2 * l2, weight_decay_on=weight_decay_on)
            opt = build_outer_optimizer(learner, t)
        for g in grads:
            opt.zero_grad()
            named = dict(learner.named_parameters())
            if weight_decay_on is None:
                penalty = sum(l2 * (named[k] ** 2).sum() for k in kernels)
                penalty.backward()
            for k, p in named.items():
                p.grad = g[k] if p.grad is None else p.grad + g[k]
            opt.step()
        return {k: p.detach().clone() for k, p in learner.named_parameters()}

    reference, weights, every = stepped(None), stepped("weights"), stepped("all")
    for k in start:
        torch.testing.assert_close(weights[k], reference[k], rtol=0, atol=1e-15, msg=k)
    assert max(float((every[k] - reference[k]).abs().max()) for k in start if k not in kernels) > 0


def test_a_record_without_an_outer_setting_is_refused():
    """A record of this format holds every field: one without an outer setting was edited,
    and is refused naming it (no default is read in for it)."""
    args = make(om, algorithm="maml", data_root=str(OMNIGLOT), track=False, device="cpu")
    record = recipe_of(om, args).to_dict()
    del record["training"]["weight_decay_on"]
    with pytest.raises(ValueError, match=r"^the recipe's training.weight_decay_on is missing; "):
        Recipe.from_dict(record)
    # The Python API's None: the learner's own optimizer (MAML: Adam; Reptile: plain SGD)
    open_optimizer = replace(recipe_of(om, args).training, outer_optimizer=None)
    assert type(build_outer_optimizer(MAML(_conv4()), open_optimizer)) is torch.optim.Adam


# --------------------------------------------------------------------------- the command line

TINY = dict(
    algorithm="maml", iterations=4, meta_batch=2, query=1, eval_query=2, hidden=8, val_every=4,
    val_tasks=2, test_tasks=2, eval_inner_steps=1, checkpoint_every=1, track=False,
    device="cpu",
)  # fmt: skip


def test_label_smoothing_is_metaoptnets_own_training_loss():
    """--label-smoothing sets MetaOptNet's own argument (no second smoothing on top): the
    training loss changes with it, evaluation's does not."""
    if not HAS_OMNIGLOT:
        pytest.skip(NO_OMNIGLOT)
    losses = {}
    for smoothing in (None, 0.0, 0.3):
        args = make(om, **{**TINY, "algorithm": "metaoptnet", "label_smoothing": smoothing,
                           "data_root": str(OMNIGLOT)})  # fmt: skip
        recipe = recipe_of(om, args)
        learner = seeded_learner(recipe)
        assert learner.label_smoothing == recipe.learner.arguments["label_smoothing"]
        tasks = load_samplers(recipe, "cpu")["train"].batch(2, torch.Generator().manual_seed(0))
        train = learner.backward(tasks).loss
        evaluated = learner.evaluate(tasks)[0].mean().item()
        losses[smoothing] = (learner.label_smoothing, train, evaluated)
    assert losses[None][0] == 0.1 and losses[0.3][0] == 0.3  # none: the learner's default
    assert losses[0.0][1] == pytest.approx(losses[0.0][2], rel=1e-5)  # plain: train = eval
    # smoothed training loss (its formula: test_svm_head.test_label_smoothing_is_metaoptnets)
    assert losses[0.3][1] != pytest.approx(losses[0.0][1], rel=1e-4)
    assert losses[0.3][2] == pytest.approx(losses[0.0][2], rel=1e-6)  # evaluation plain


def _flags(**values) -> list[str]:
    out = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        out += (
            [flag if value else "--no-" + flag[2:]]
            if isinstance(value, bool)
            else [flag, str(value)]
        )
    return out


@pytest.mark.parametrize(
    ("bad", "message"),
    [({"weight_decay": -1e-4}, "--weight-decay -0.0001: must be >= 0"),
     ({"weight_decay_on": "weights"}, "--weight-decay-on weights says what --weight-decay"),
     ({"outer_optimizer": "sgd", "outer_momentum": 1.0}, "--outer-momentum 1.0: must be in"),
     ({"outer_optimizer": "sgd", "outer_momentum": -0.1}, "--outer-momentum -0.1: must be in"),
     ({"outer_momentum": 0.9}, "--outer-momentum and --nesterov set SGD's momentum"),
     ({"outer_optimizer": "sgd", "nesterov": True}, "--nesterov needs momentum"),
     ({"lr_schedule": "step", "step_size": 5}, "--step-size 5: --lr-schedule step needs"),
     ({"lr_schedule": "step"}, "--step-size None: --lr-schedule step needs"),
     ({"schedule_every": 5}, "--schedule-every 5: must be in"),
     ({"lr_schedule": "cosine", "eta_min": 0.01}, "--eta-min 0.01 is above --outer-lr 0.001"),
     ({"lr_schedule": "constant", "eta_min": 1e-5}, "--eta-min is the minimum of"),
     ({"algorithm": "metaoptnet", "label_smoothing": 1.0}, "--label-smoothing 1.0: must be in"),
     ({"algorithm": "metaoptnet", "label_smoothing": -0.1}, "--label-smoothing -0.1: must be"),
     ({"label_smoothing": 0.1}, "--label-smoothing is a setting of metaoptnet; drop it")],
)  # fmt: skip
@pytest.mark.slow
def test_bad_outer_settings_exit_2_with_one_line_before_data_loads(tmp_path, bad, message):
    # An empty --data-root: a refusal after data loading would say Omniglot is not there.
    empty = tmp_path / "empty"
    empty.mkdir()
    flags = _flags(**{**TINY, "out_dir": tmp_path / "runs", "data_root": empty, **bad})
    cmd = [sys.executable, str(ROOT / "experiments" / "omniglot_maml.py"), *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), done.stderr
    assert not (tmp_path / "runs").exists() and list(empty.iterdir()) == []


# --------------------------------------------------------------------------- resuming

OUTER = dict(outer_optimizer="sgd", outer_momentum=0.9, nesterov=True, weight_decay=5e-4,
             outer_lr=0.05, lr_schedule="cosine", eta_min=1e-3)  # fmt: skip


def _tiny(tmp_path: Path, **overrides):
    if not HAS_OMNIGLOT:
        pytest.skip(NO_OMNIGLOT)
    return make(om, **{**TINY, **OUTER, "data_root": str(OMNIGLOT), "out_dir": str(tmp_path),
                       **overrides})  # fmt: skip


@pytest.mark.slow
def test_a_run_resumed_mid_schedule_is_the_uninterrupted_run(tmp_path, monkeypatch):
    om.main(_tiny(tmp_path, run_name="straight"))
    main_interrupted(monkeypatch, _tiny(tmp_path, run_name="split"), at_step=3)
    assert load_checkpoint(tmp_path / "split" / "checkpoint.pt")["iteration"] == 2
    om.main(_tiny(tmp_path, run_name="split", resume=True))
    straight = load_checkpoint(tmp_path / "straight" / "checkpoint.pt")
    split = load_checkpoint(tmp_path / "split" / "checkpoint.pt")
    for key in straight["learner"]:
        assert torch.equal(straight["learner"][key], split["learner"][key]), key
    lrs = [row["train/outer_lr"] for row in split["history"] if "train/outer_lr" in row]
    assert lrs == [row["train/outer_lr"] for row in straight["history"] if "train/loss" in row]
    assert lrs == pytest.approx(torch_lrs(training(**{**OUTER, "iterations": 4})), rel=1e-12)
    assert split["recipe"]["training"]["lr_schedule"] == "cosine"


@pytest.mark.slow
def test_an_annealed_run_is_not_extended_on_resume(tmp_path):
    om.main(_tiny(tmp_path, run_name="c", iterations=2, val_every=2))
    with pytest.raises(UserError, match="--lr-schedule cosine anneals over the run's 2 steps"):
        om.main(_tiny(tmp_path, run_name="c", iterations=4, val_every=2, resume=True))


@pytest.mark.slow
def test_the_outer_settings_are_in_the_wandb_config(tmp_path):
    if not HAS_OMNIGLOT:
        pytest.skip(NO_OMNIGLOT)
    step = dict(outer_optimizer="adam", weight_decay=1e-4, lr_schedule="step", step_size=1,
                gamma=0.5, schedule_every=2)  # fmt: skip
    om.main(make(om, **{**TINY, **step, "data_root": str(OMNIGLOT), "out_dir": str(tmp_path),
                        "run_name": "w", "track": True, "wandb_mode": "offline"}))  # fmt: skip
    wandb.teardown()
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    record = read_offline_run(run_dir)
    for name, value in step.items():
        assert record.config[name] == value, name
    assert record.config["outer_momentum"] == 0.0 and record.config["eta_min"] == 0.0
    assert record.series("train/outer_lr")[1] == [1e-3, 1e-3, 5e-4, 5e-4]


# --------------------------------------------------------------------------- --grad-clamp


def test_grad_clamp_is_torchs_clip_grad_value_of_the_network_only():
    """MAML++'s meta_update clamps its classifier's gradients (the network and its per-step
    batch-norm copies) to [-10, 10], not its LSLR rates: torch's clip_grad_value_ of those."""
    learner = MAMLpp(_conv4(), inner_steps=2)
    g = torch.Generator().manual_seed(0)
    for p in learner.parameters():
        p.grad = 30 * torch.randn(p.shape, generator=g)
    grads = {k: p.grad.clone() for k, p in learner.named_parameters()}
    clamp_meta_gradient(learner, 10.0)
    network = {k for k, _ in learner.named_parameters() if k.startswith(("model.", "bn."))}
    assert any(k.startswith("lrs.") for k in grads) and any(k.startswith("bn.") for k in network)
    for name, p in learner.named_parameters():
        torchs = torch.zeros_like(p, requires_grad=True)
        torchs.grad = grads[name].clone()
        if name in network:
            torch.nn.utils.clip_grad_value_([torchs], 10.0)
        assert torch.equal(p.grad, torchs.grad), name  # the rates' gradients unchanged
    assert max(float(grads[k].abs().max()) for k in network) > 10  # the clamp bound something


def test_grad_clamp_equals_clip_grad_value_and_none_is_no_clamp():
    learner = MAML(_conv4())
    g = torch.Generator().manual_seed(1)
    for p in learner.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    copies = [p.detach().clone().requires_grad_() for p in learner.parameters()]
    for c, p in zip(copies, learner.parameters(), strict=True):
        c.grad = p.grad.clone()
    clamp_meta_gradient(learner, None)
    assert all(torch.equal(c.grad, p.grad) for c, p in zip(copies, learner.parameters()))
    clamp_meta_gradient(learner, 0.5)
    torch.nn.utils.clip_grad_value_(copies, 0.5)
    assert all(torch.equal(c.grad, p.grad) for c, p in zip(copies, learner.parameters()))


@pytest.mark.parametrize("bound", ["0", "-1", "nan", "inf"])
def test_a_grad_clamp_that_bounds_nothing_sensible_is_refused(bound):
    with pytest.raises(UserError, match="--grad-clamp .*positive finite"):
        om.resolve_args(om.parse_args(["--grad-clamp", bound, "--no-track"]))
