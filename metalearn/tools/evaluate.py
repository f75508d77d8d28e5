"""Test a trained checkpoint on freshly drawn tasks: mean accuracy and its 95% interval.

What: loads a checkpoint of ``experiments/omniglot_maml.py`` or ``experiments/fewshot_maml.py``
(``runs/<run>/checkpoint.pt``), its best-validation weights by default, and tests them as
the experiment's test does (its test sampler, rebuilt by `metalearn.data.image_set_samplers`,
and its evaluation function, `metalearn.runs.evaluation.evaluate_tasks`) with any number of
tasks and inner steps. The data set, its folder and the image shape are the run's recorded ones (a
record without ``dataset`` is an Omniglot run); ``--data-root`` points at the data
elsewhere. The last line printed is ``test/acc: 0.xxxx ± 0.xxxx`` (mean and 95%
half-width over tasks); the result is logged to W&B as an ``eval`` job in the run's group,
named ``<run>-eval-<id>`` and kept in the trained run's W&B folder (``<out_dir>/wandb``),
its config naming the trained run's W&B id (``--no-track`` skips).

``--artifact NAME:ALIAS`` evaluates a model logged with ``--log-model`` instead of a
checkpoint file. Online it is fetched from W&B and the evaluation run uses it (W&B records
the lineage: this model, evaluated by that run). Offline it is found among the runs in
``--out-dir``; W&B refuses ``use_artifact`` offline, so the evaluation records the
artifact's name, alias and digest in its config instead.

Command (NAME: a run's folder name, as the run printed it):
    metalearn-evaluate --checkpoint runs/NAME/checkpoint.pt
    metalearn-evaluate --artifact NAME-model:best
    metalearn-evaluate --checkpoint runs/NAME/checkpoint.pt \\
        --tasks 2000 --steps 20 --shots 5 --which last
    metalearn-evaluate --checkpoint runs/NAME/checkpoint.pt --which ensemble  # --ensemble-top-k
    metalearn-evaluate --checkpoint runs/NAME/checkpoint.pt \\
        --protocol within-alphabet --tasks 1000   # Lake et al.'s 20-way protocol
    metalearn-evaluate --checkpoint runs/NAME/checkpoint.pt \\
        --transductive False --one-to-one   # each query alone; then the run assigned jointly
    metalearn-evaluate --data-root /data/cifar --checkpoint runs/NAME/checkpoint.pt

Ways: the network's head has one output per class it was trained on, so an N-way model is
tested N-way only. Fewer ways would leave outputs that no class of the task owns, and
their argmax would still count as answers: that measures a different problem, not the
smaller-way accuracy. Shots and queries may differ from training, up to the examples per
class of the data (20 for Omniglot). ``--split`` chooses Omniglot's class split only; the
other data sets have one published split. Bad input ends with a one-line error and exit code 2.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from metalearn.runs.cli import parse_dataclass, quiet_on_closed_stdout

if TYPE_CHECKING:  # imported where used: --help loads neither torch nor wandb
    from metalearn.runs.evaluation import TaskSource
    from metalearn.runs.recipe import DataRecipe, Recipe

PROG = "metalearn-evaluate"

PROJECT = "metalearn-omniglot"
"""The experiments' default W&B project, where an artifact named without one is looked for."""


@dataclass
class Args:
    """Arguments of metalearn-evaluate (each is a --flag; see --help)."""

    checkpoint: str | None = None
    """The run's checkpoint, runs/<run_name>/checkpoint.pt (this or --artifact)."""
    artifact: str | None = None
    """A model artifact logged with --log-model, NAME[:ALIAS] (alias default best; NAME is
    <run_name>-model, or ENTITY/PROJECT/NAME online)."""
    out_dir: str = "runs"
    """Where the runs are: offline, --artifact is found in its wandb/ folder, and an
    evaluation of a checkpoint outside its run folder is logged there."""
    which: Literal["best", "last", "ensemble"] = "best"
    """best: the best-validation weights (what a run of --ensemble-top-k 1 tested); last: the
    latest; ensemble: the K best-validation weights a run of --ensemble-top-k K kept, their
    query logits averaged (what it tested)."""
    tasks: int = 600
    """Test tasks; the interval shrinks as 1/sqrt(tasks)."""
    steps: int | None = None
    """Inner steps on each support set (default: the run's eval_inner_steps)."""
    ways: int | None = None
    """Classes per task (default and only choice: the ways the model's head was trained on)."""
    shots: int | None = None
    """Support examples per class (default: the run's shots)."""
    query: int | None = None
    """Query examples per class (default: the run's eval_query)."""
    protocol: Literal["episodic", "within-alphabet"] | None = None
    """How tasks are drawn (default: the run's --eval-protocol). episodic: N-way K-shot
    from the split's test classes; within-alphabet (Omniglot's alphabet split): each task's
    classes from one evaluation alphabet, support and query by different drawers (Lake et
    al., 2015)."""
    split: Literal["maml", "alphabet"] | None = None
    """Omniglot runs only: the class split whose test classes are drawn (default: the run's)."""
    data_root: str | None = None
    """The run's data set's folder (default: the run's; Omniglot: else $METALEARN_DATA, else
    the cache dir)."""
    transductive: bool | None = None
    """How the query's batch norm is read, for learners that take --transductive (reptile,
    protomaml, the solved heads): True: the query set in one batch (transductive); False:
    each query on its own (inductive); default: the run's."""
    one_to_one: bool = False
    """Also score each task's queries assigned to the classes one-to-one (transductive: the
    Hungarian method on the same logits), printed as test/acc_one_to_one beside test/acc."""
    views: int = 1
    """Test-time augmentation: each task read as itself and views-1 copies augmented as the
    run's training images are (the data set's standard augmentation; support and query
    together), their query logits averaged; 1: none."""
    seed: int | None = None
    """Seeds the task sampling (default: the experiments' test seed, which draws the run's
    own test tasks)."""
    device: str = "cpu"
    """Torch device."""
    threads: int = 1
    """Torch CPU threads (0: torch's default)."""
    track: bool = True
    """Log to Weights & Biases as an eval job in the run's group (--no-track to skip)."""
    wandb_mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """auto: as the experiment: online when logged in and reachable, else offline."""
    wandb_project: str | None = None
    """W&B project (default: the run's; --artifact online: where NAME is looked for, default
    metalearn-omniglot, the experiments')."""


def test_data(args: Args, recipe: Recipe) -> tuple[DataRecipe, int]:
    """The data the evaluation draws from (the run's, with each flag given changed), and the
    inner steps; checked.

    Raises:
        ValueError: ways other than the head's, ``tasks < 1``, ``steps < 0``, ``--split``
            for a data set other than Omniglot, the within-alphabet protocol off
            Omniglot's alphabet split, or tasks the test split cannot give (its published
            sizes, `metalearn.data.check_task_sizes`), all before the data loads.
    """
    from metalearn.data import check_task_sizes

    data = recipe.data
    if args.split is not None and data.dataset != "omniglot":
        raise ValueError(f"--split {args.split}: {data.dataset} has one published split (--split "
                         "chooses Omniglot's class split); drop --split")  # fmt: skip
    ways = recipe.model.ways if args.ways is None else args.ways
    if ways != recipe.model.ways:
        raise ValueError(
            f"--ways {ways}: this model's head has {recipe.model.ways} outputs (trained "
            f"{recipe.model.ways}-way) and scores {recipe.model.ways}-way tasks only; drop "
            f"--ways or pass --ways {recipe.model.ways}"
        )
    given = {"shots": args.shots, "eval_query": args.query, "split": args.split,
             "eval_protocol": args.protocol, "root": args.data_root}  # fmt: skip
    chosen = dataclasses.replace(data, **{k: v for k, v in given.items() if v is not None})
    if chosen.eval_protocol == "within-alphabet" and (chosen.dataset, chosen.split) != (
        "omniglot",
        "alphabet",
    ):
        raise ValueError(
            f"--protocol within-alphabet draws tasks from one alphabet of Omniglot's alphabet "
            f"split; this is {drawn_from(chosen)}: pass --split alphabet (Omniglot runs) or "
            "--protocol episodic"
        )
    # The test split's tasks only, with evaluate's own flag names (--query, --shots, --ways).
    check_task_sizes(chosen.dataset, ways=chosen.ways, shots=chosen.shots,
                     query=chosen.eval_query, split=chosen.split,
                     eval_protocol=chosen.eval_protocol, splits=("test",))  # fmt: skip
    steps = recipe.training.eval_inner_steps if args.steps is None else args.steps
    if args.tasks < 1 or steps < 0:
        raise ValueError(f"--tasks must be >= 1 and --steps >= 0, got {args.tasks} and {steps}")
    return chosen, steps


def task_source(data: DataRecipe, device: str) -> TaskSource:
    """The test sampler of ``data``, built as the run built its own (`build_samplers`)."""
    from metalearn.runs.recipe import build_samplers

    return build_samplers(data, device=device, splits=("test",))["test"]


def drawn_from(data: DataRecipe) -> str:
    """Whose test classes are drawn, in words: the data set, its split, its folder."""
    split = f" ({data.split} split)" if data.dataset == "omniglot" else ""
    return f"{data.dataset}{split} at {data.root or 'its default folder'}"


def model_source(args: Args) -> tuple[Path, dict[str, Any], Any]:
    """The checkpoint file to evaluate, what the evaluation records of where it came from,
    and the online artifact (None unless fetched from W&B).

    Raises:
        ValueError: neither or both of --checkpoint and --artifact.
        FileNotFoundError: an offline artifact no run in --out-dir logged.
    """
    from metalearn.runs.records import find_offline_artifact
    from metalearn.runs.tracking import decide_mode

    if (args.checkpoint is None) == (args.artifact is None):
        raise ValueError("pass --checkpoint runs/<run_name>/checkpoint.pt or --artifact "
                         "<run_name>-model:best (one of the two)")  # fmt: skip
    if args.checkpoint is not None:
        return Path(args.checkpoint), {}, None
    name, _, alias = args.artifact.partition(":")
    alias = alias or "best"
    if decide_mode(args.wandb_mode) == "online":
        return _fetch(name if "/" in name else f"{args.wandb_project or PROJECT}/{name}", alias,
                      Path(args.out_dir))  # fmt: skip
    found = find_offline_artifact(Path(args.out_dir) / "wandb", name, alias)
    files = list(found.files.values())
    if len(files) != 1:
        raise FileNotFoundError(f"artifact {name}:{alias} in {found.run_dir} holds "
                                f"{len(files)} files, not one checkpoint")  # fmt: skip
    record = {"artifact": f"{name}:{alias}", "artifact_digest": found.digest}
    return files[0], record, None


def _fetch(name: str, alias: str, out_dir: Path) -> tuple[Path, dict[str, Any], Any]:
    """Download model artifact ``[ENTITY/]PROJECT/NAME:ALIAS`` from W&B into ``out_dir``.

    Raises:
        FileNotFoundError: W&B has no such artifact, or could not be asked (one line).
    """
    import wandb

    try:
        artifact = wandb.Api().artifact(f"{name}:{alias}", type="model")
        root = Path(artifact.download(root=str(out_dir / "artifacts" / artifact.name)))
    except (wandb.errors.Error, ValueError) as err:
        raise FileNotFoundError(f"artifact {name}:{alias}: {' '.join(str(err).split())}") from None
    found = {"artifact": f"{name}:{alias}", "artifact_digest": artifact.digest}
    return root / artifact.metadata.get("file", "checkpoint.pt"), found, artifact


def evaluate(args: Args) -> dict[str, float]:
    """Load, draw, test, log; returns ``{"test/acc": ..., "test/acc_ci95": ...}``."""
    import torch

    from metalearn.data.benchmarks import set_augmentation
    from metalearn.deploy import learner_from, read_run_checkpoint
    from metalearn.runs.evaluation import MAX_VIEWS, TEST_SEED, evaluate_tasks
    from metalearn.runs.tracking import check_mode

    if not 1 <= args.views <= MAX_VIEWS:
        raise ValueError(f"--views {args.views}: must be 1 (no test-time augmentation) to "
                         f"{MAX_VIEWS}")  # fmt: skip
    args = dataclasses.replace(args, seed=TEST_SEED if args.seed is None else args.seed)
    seed = args.seed
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.track:
        check_mode(args.wandb_mode)  # online needs a key: refused before anything loads
    path, origin, artifact = model_source(args)
    saved = read_run_checkpoint(path)
    require_finite(saved, args.which, path)
    if args.transductive is not None:
        saved = with_transductive(saved, args.transductive, path)
    which = "best" if args.which == "ensemble" else args.which
    learner, recipe = learner_from(saved, which, args.device, source=str(path))
    ensemble = kept_ensemble(saved, path) if args.which == "ensemble" else None
    data, steps = test_data(args, recipe)
    source = task_source(data, args.device)
    augment = set_augmentation(data.dataset) if args.views > 1 else None
    print(
        f"{args.artifact or path} ({args.which} weights): {data.ways}-way {data.shots}-shot, "
        f"{data.eval_query} queries, {steps} inner steps, {args.tasks} tasks of the "
        f"test classes of {drawn_from(data)}, seed {seed}, {data.eval_protocol} protocol"
        + (f", {args.views} views (test-time augmentation)" if args.views > 1 else "")
    )
    wandb_run = None
    if args.track:
        wandb_run = _start_run(args, path, saved, recipe, data, steps, origin)
        if wandb_run is not None and artifact is not None:
            wandb_run.use_artifact(artifact)  # the lineage: this model, evaluated by this run
    try:
        generator = torch.Generator().manual_seed(seed)
        acc, half = evaluate_tasks(learner, source, args.tasks, steps, generator, desc="test",
                                   ensemble=ensemble, views=args.views,
                                   augment=augment)  # fmt: skip
        results = {"test/acc": acc, "test/acc_ci95": half}
        if args.one_to_one:  # the same tasks, read jointly
            generator = torch.Generator().manual_seed(seed)
            one, one_half = evaluate_tasks(learner, source, args.tasks, steps, generator,
                                           desc="one-to-one", ensemble=ensemble,
                                           one_to_one=data.eval_query, views=args.views,
                                           augment=augment)  # fmt: skip
            results.update({"test/acc_one_to_one": one, "test/acc_one_to_one_ci95": one_half})
        if wandb_run is not None:
            wandb_run.summary.update(results)
    finally:
        if wandb_run is not None:
            wandb_run.finish()
    if args.one_to_one:
        print(f"test/acc_one_to_one (transductive): {one:.4f} ± {one_half:.4f}")
    print(f"test/acc: {acc:.4f} ± {half:.4f}")
    return results


def with_transductive(saved: Mapping[str, Any], transductive: bool, path: Path) -> dict:
    """``saved`` whose recipe builds its learner with ``transductive`` (--transductive).

    Raises:
        ValueError: the run's learner takes no ``transductive``.
    """
    learner = saved.get("recipe", {}).get("learner", {})
    arguments = learner.get("arguments", {})
    if "transductive" not in arguments:
        raise ValueError(f"--transductive: {path}'s learner ({learner.get('algorithm')}) reads "
                         "its queries one way only; drop --transductive")  # fmt: skip
    changed = {**learner, "arguments": {**arguments, "transductive": transductive}}
    return {**saved, "recipe": {**saved["recipe"], "learner": changed}}


def require_finite(saved: Mapping[str, Any], which: str, path: Path) -> None:
    """Refuse weights that hold NaN or infinity (a run that diverged after it kept them):
    every task would score NaN, or stop on a non-finite loss.

    Raises:
        ValueError: a floating tensor of the chosen weights is not finite (named).
    """
    import torch

    if which == "ensemble":
        states = [entry.get("learner") for entry in saved.get("top") or []]
    else:
        states = [saved.get("best_learner" if which == "best" else "learner")]
    for state in states:
        bad = [
            name
            for name, v in (state or {}).items()
            if torch.is_tensor(v) and v.is_floating_point() and not v.isfinite().all()
        ]
        if bad:
            more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
            other = "--which last" if which != "last" else "another checkpoint"
            raise ValueError(f"{path}: the {which} weights hold NaN or infinite values ({bad[0]}"
                             f"{more}): the run diverged; evaluate {other}, or train again with "
                             "a lower --inner-lr or --outer-lr")  # fmt: skip


def kept_ensemble(saved: Mapping[str, Any], path: Path) -> list[Any]:
    """The best-validation weights a run of ``--ensemble-top-k K`` kept, best first.

    Raises:
        ValueError: the run kept none (``--ensemble-top-k 1``, or no validation yet).
    """
    top = saved.get("top") or []
    if not top:
        raise ValueError(f"{path} kept no ensemble (its run had --ensemble-top-k 1, or no "
                         "validation yet); pass --which best")  # fmt: skip
    return [entry["learner"] for entry in top]


def _start_run(
    args: Args,
    path: Path,
    saved: Mapping[str, Any],
    recipe: Recipe,
    data: DataRecipe,
    steps: int,
    origin: Mapping[str, Any],
) -> Any:
    """An ``eval`` W&B run named ``<run>-eval-<id>`` in the trained run's group and its W&B
    folder (`runs_folder`); its config names the trained run (name and W&B id)."""
    from metalearn.runs.experiment import new_run_identity
    from metalearn.runs.tracking import init_run, run_group

    run_args = saved["args"]
    checkpoint = path.resolve()
    trained = str(run_args.get("run_name") or checkpoint.parent.name)
    project = args.wandb_project or run_args.get("wandb_project", f"metalearn-{recipe.experiment}")
    chosen = {"dataset": data.dataset, "ways": data.ways, "shots": data.shots,
              "query": data.eval_query, "split": data.split, "protocol": data.eval_protocol,
              "steps": steps, "data_root": data.root}  # fmt: skip
    config = {**asdict(args), **chosen, **origin, "checkpoint": str(checkpoint),
              "wandb_project": project, "run": trained,
              "training_run_id": saved.get("wandb_id"), "recipe": recipe.to_dict()}  # fmt: skip
    group = run_group(recipe.learner.algorithm, data.ways, recipe.data.shots,
                      run_args.get("wandb_group"))  # fmt: skip
    name, run_id = new_run_identity(f"{trained}-eval", environ={})
    return init_run(
        config, project=project, mode=args.wandb_mode, name=name, run_id=run_id,
        group=group, tags=["eval", recipe.learner.algorithm, data.dataset,
                           f"{data.ways}w{data.shots}s"],
        dir=runs_folder(checkpoint, trained, args.out_dir), job_type="eval",
    )  # fmt: skip


def runs_folder(checkpoint: Path, run_name: str, out_dir: str) -> Path:
    """The folder of the trained run's W&B runs: the one its run folder sits in, when the
    checkpoint is still ``<out_dir>/<run_name>/checkpoint.pt``; else ``out_dir``."""
    return checkpoint.parent.parent if checkpoint.parent.name == run_name else Path(out_dir)


@quiet_on_closed_stdout
def main(argv: Sequence[str] | None = None) -> int:
    """``metalearn-evaluate``: parse, evaluate, and turn a user error into one line on stderr
    and exit status 2 (a reader that leaves: quietly, exit status 141)."""
    from metalearn.runs.lifecycle import UserError

    args = parse_dataclass(Args, argv, description=__doc__.split("\n\n")[0])
    try:
        evaluate(args)
    except (FileNotFoundError, ValueError, ImportError, UserError) as err:  # h5py absent
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
