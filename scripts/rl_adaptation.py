"""Return on held-out tasks after 0 to K policy-gradient steps, for saved meta-RL policies
and a random start: the MAML paper's Figure 4 (Finn et al., 2017) as a table and a plot.

Each policy is a checkpoint of ``experiments/rl_maml.py`` (a MAML run, a ``--pretrain``
run), named ``LABEL=PATH``; ``--random`` adds the same architecture at its random
initialisation (the first checkpoint's seed: that run's initial policy). Every policy is
adapted with the first checkpoint's inner step (its ``--inner-lr``; the 2nd and later steps
at ``--eval-later-lr-factor`` times it) on the same held-out tasks and episode seeds
(``rl_maml.evaluate``), so the rows differ in the starting policy only.

    python scripts/rl_adaptation.py --checkpoints maml=runs/A/checkpoint.pt \\
        pretrained=runs/B/checkpoint.pt --random --plot docs/figures/rl_2dnav_figure4.png

``--paper`` evaluates as maml_rl's test script for the figure (cbfinn/maml_rl at 9c8e2eb,
``maml_examples/test_maml_point.py``): 40 goals, a budget of 4,000 steps a goal and step
(VPG's ``batch_size=4000``, run as 40 episodes side by side), the first step at the run's
inner lr and the later ones at half of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from benchtools import markdown_table, parse_args_as, run_header, usage_error

from metalearn.checkpoint import load_checkpoint
from metalearn.runs.cli import flatten, unflatten
from metalearn.runs.lifecycle import UserError
from metalearn.tools.experiments import PREFIX, experiment_file, load_file

ROOT = Path(__file__).resolve().parents[1]
rl_maml = load_file(experiment_file("rl_maml", ROOT), PREFIX + "rl_maml")
SHARED = ("env", "horizon", "hidden")
"""What every checkpoint must share with the first (the tasks and the architecture)."""


@dataclass
class Args:
    """The policies compared and how they are adapted."""

    checkpoints: tuple[str, ...] = ()
    """Policies as LABEL=PATH, each an experiments/rl_maml.py checkpoint."""
    random: bool = False
    """Add the random start (label "random")."""
    eval_tasks: int | None = None
    """Held-out tasks (default: the first checkpoint's --eval-tasks)."""
    eval_inner_steps: int = 3
    """Adaptation steps (the paper's Figure 4: 0 to 3)."""
    eval_later_lr_factor: float | None = None
    """The later steps' rate over the first's (default: the first checkpoint's)."""
    fast_batch: int | None = None
    """Episodes per task and step (default: the first checkpoint's --fast-batch)."""
    fast_batch_steps: int | None = None
    """Steps per task and step instead (a step budget, `metalearn.rl.budget`)."""
    paper: bool = False
    """maml_rl's test protocol (module docstring): 40 goals, 4,000 steps, later steps at 0.5."""
    plot: str | None = None
    """Write the curves to this PNG."""
    threads: int = 1
    """Torch CPU threads."""


def parse_args(argv: Sequence[str] | None = None) -> Args:
    args = parse_args_as(Args, argv, __doc__)
    if not args.checkpoints and not args.random:
        usage_error("nothing to evaluate: pass --checkpoints LABEL=PATH ... and/or --random")
    for item in args.checkpoints:
        label, _, path = item.partition("=")
        if not label or not path:
            usage_error(f"--checkpoints: each is LABEL=PATH, e.g. maml=runs/A/checkpoint.pt; "
                        f"got {item!r}")  # fmt: skip
    labels = [item.partition("=")[0] for item in args.checkpoints] + ["random"] * args.random
    if len(set(labels)) < len(labels):
        usage_error(f"--checkpoints: the labels {labels} repeat one; give each policy its own")
    if args.paper and (args.fast_batch, args.fast_batch_steps) != (None, None):
        usage_error(
            "--paper sets maml_rl's 4,000 steps a goal; drop --fast-batch/--fast-batch-steps"
        )
    if args.fast_batch is not None and args.fast_batch_steps is not None:
        usage_error("--fast-batch (episodes) and --fast-batch-steps (steps): pass one")
    if args.threads < 1:
        usage_error(f"--threads {args.threads}: must be at least 1")
    return args


def saved_run(path: str) -> tuple[Any, dict]:
    """The resolved ``rl_maml.Args`` and the policy's state of the checkpoint at ``path``."""
    try:
        saved = load_checkpoint(path)
    except FileNotFoundError:
        usage_error(f"--checkpoints: no checkpoint at {path}")
    except Exception as err:  # truncated, empty, or not a checkpoint at all
        usage_error(f"--checkpoints: {path} cannot be read as a checkpoint ({type(err).__name__})")
    if not isinstance(saved, dict) or saved.get("experiment") != "rl_maml":
        usage_error(f"--checkpoints: {path} is not a checkpoint of experiments/rl_maml.py")
    known = flatten(rl_maml.Args())
    flat = {k: v for k, v in saved["args"].items() if k in known}
    if flat.get("pretrain"):  # a policy pretrained by TRPO (before --pretrain took Adam's
        # step) recorded the outer step's settings; evaluation reads none of them
        flat.update(dict.fromkeys(k for names in rl_maml.OUTER_DEFAULTS.values() for k in names))
    args = unflatten(rl_maml.Args, flat)
    return rl_maml.resolve(args), saved["policy"]


PAPER_TEST = {"eval_tasks": 40, "fast_batch_steps": 4000, "eval_later_lr_factor": 0.5}
"""``test_maml_point.py``: ``test_num_goals = 40``, VPG's ``batch_size=4000``, and the
optimiser's ``init_learning_rate`` the step size, ``learning_rate`` half of it."""


def evaluation_args(base: Any, args: Args) -> Any:
    """The first run's arguments with the command line's evaluation settings (``--paper``:
    `PAPER_TEST` where the line leaves them open), on the CPU."""
    names = ("eval_tasks", "eval_inner_steps", "eval_later_lr_factor", "fast_batch",
             "fast_batch_steps")  # fmt: skip
    given = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.paper:
        given = {**PAPER_TEST, **given}
    if "fast_batch" in given or "fast_batch_steps" in given:  # one of the two counts
        given = {"fast_batch": None, "fast_batch_steps": None, **given}
    training = replace(base.training, **given)
    a = replace(base, training=training, system=replace(base.system, device="cpu"))
    try:
        rl_maml.check_args(a)
    except UserError as err:
        usage_error(str(err))
    return a


def adaptation_curve(a: Any, state: dict | None) -> list[tuple[float, float]]:
    """``(mean return, 95% half-width)`` over the held-out tasks after 0..K steps, starting
    from ``state`` (None: the seed's random initialisation)."""
    policy, objective, sample = rl_maml.build(a)
    if state is not None:
        policy.load_state_dict(state)
    results = rl_maml.evaluate(a.training, sample, objective, policy)
    return [
        (results[f"test/return_step{k}"], results[f"test/return_step{k}_ci95"])
        for k in range(a.training.eval_inner_steps + 1)
    ]


def plot(curves: dict[str, list[tuple[float, float]]], path: str, title: str) -> None:
    """Return against gradient steps, one line per policy, 95% intervals as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.2, 3.2), dpi=100)
    for label, curve in curves.items():
        means, widths = zip(*curve)
        ax.errorbar(range(len(curve)), means, yerr=widths, marker="o", capsize=3, label=label)
    ax.set_xlabel("number of gradient steps")
    ax.set_ylabel("average return")
    ax.set_xticks(range(max(len(c) for c in curves.values())))
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict[str, list[tuple[float, float]]]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    runs = {}
    for item in args.checkpoints:
        label, _, path = item.partition("=")
        runs[label] = saved_run(path)
    base = next(iter(runs.values()))[0] if runs else rl_maml.resolve(rl_maml.Args())
    for label, (other, _) in runs.items():
        first, theirs = flatten(base), flatten(other)
        if differ := [k for k in SHARED if first[k] != theirs[k]]:
            usage_error(f"--checkpoints: {label} differs from the first in {', '.join(differ)}")
    a = evaluation_args(base, args)
    starts = {label: state for label, (_, state) in runs.items()}
    if args.random:
        starts["random"] = None
    curves = {label: adaptation_curve(a, state) for label, state in starts.items()}
    steps = range(a.training.eval_inner_steps + 1)
    print(run_header())
    t = a.training
    batch = (f"{t.fast_batch} episodes" if t.fast_batch_steps is None
             else f"{t.fast_batch_steps} steps")  # fmt: skip
    print(f"{a.env.env}: {t.eval_tasks} held-out tasks x {batch} a step, inner "
          f"lr {t.inner_lr}, later steps x {t.eval_later_lr_factor}, seed {t.seed}")  # fmt: skip
    rows = [[label] + [f"{m:.1f} ± {w:.1f}" for m, w in curve] for label, curve in curves.items()]
    print(markdown_table(["policy", *(f"{k} steps" for k in steps)], rows))
    if args.plot:
        plot(curves, args.plot, f"{a.env.env}, {t.eval_tasks} held-out tasks (95% CI)")
        print(f"plot: {args.plot}")
    return curves


if __name__ == "__main__":
    main()
