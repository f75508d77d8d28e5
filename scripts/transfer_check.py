"""A trained checkpoint, deployed on its own test tasks written as image files.

What: draws test tasks the way the run's test draws them (its recipe's data set, split and
protocol: Lake et al.'s within-alphabet tasks for a ``--preset cpu-20w1s`` run), and writes
each as a user would hold it: a support folder of image files (one sub-folder per class)
and a folder of query files, in the file convention of the run's data (Omniglot: dark ink
on white, which its decoding inverts). The model is then adapted through `metalearn.deploy`
exactly as a deployed model is (`load_support_folder` with the run's image format,
`adapt_to_support`, `adapted_model`) and the queries are classified three ways, one per
batch-norm reading of `metalearn.deploy.adapted_model`:

* ``one at a time`` (``norm="support"``): batch norm frozen at the support set's
  statistics, each query image in its own call, as a deployed model sees them;
* ``all at once`` (``norm="transductive"``): the whole query set in one call, batch norm on
  its statistics, which is what most learners' test measures;
* ``beside support`` (``norm="beside_support"``): each query image in its own call, batch
  norm on the support set plus that image, which is what Reptile's test measures by
  default (``transductive=False``).

It prints each accuracy with its 95% interval over tasks, and the experiment's own
evaluation (`MetaLearner.evaluate`) of the same tasks from the sampler's tensors. The
reading compared with it is the one the learner evaluates with
(`MetaLearner.evaluation_norm`, printed as ``evaluate_reads``); the other two are extra
rows. The files, their decoding and the deploy path must change nothing: the last line is
``deploy_matches_evaluate: true`` when every task's accuracy in that reading equals its
evaluation, else ``false`` and the exit code is 1.

Command:
    python scripts/transfer_check.py --checkpoint runs/NAME/checkpoint.pt --tasks 400
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from metalearn.data import ImageFormat, load_images
from metalearn.deploy import (
    adapt_to_support,
    adapted_model,
    learner_from,
    load_support_folder,
    read_run_checkpoint,
)
from metalearn.engine import Task
from metalearn.runs.cli import parse_dataclass
from metalearn.runs.evaluation import TEST_SEED, accuracy_interval
from metalearn.runs.recipe import build_samplers

READINGS = {"one_at_a_time": "support", "all_at_once": "transductive",
            "beside_support": "beside_support"}  # fmt: skip
"""Each printed row and the `adapted_model` reading it classifies the queries with."""


@dataclass
class Args:
    """Arguments of transfer_check.py (each is a --flag; see --help)."""

    checkpoint: str | None = None
    """A run's checkpoint (either experiment, any data set), runs/<run_name>/checkpoint.pt."""
    which: Literal["best", "last"] = "best"
    """best (the best-validation weights) or last."""
    tasks: int = 400
    """Test tasks, drawn by the run's protocol."""
    query: int = 1
    """Query images per class (Lake et al.: 1)."""
    steps: int | None = None
    """Inner steps on each support folder (default: the run's eval_inner_steps)."""
    data_root: str | None = None
    """The data set's folder (default: the run's; Omniglot: else $METALEARN_DATA)."""
    seed: int = TEST_SEED
    """Seeds the task draw."""
    threads: int = 1
    """Torch CPU threads (0: torch's default)."""


def write_images(images: Tensor, paths: Sequence[Path], image: ImageFormat) -> None:
    """Save images ``[B, ch, S, S]`` in [0, 1] as PNG files that ``image`` decodes back to
    them exactly (8-bit, lossless; inverted back to dark ink for an inverted format)."""
    from PIL import Image

    pixels = (images.detach().cpu() * 255).round().to(torch.uint8).numpy()
    for array, path in zip(pixels, paths):
        if image.invert:
            array = 255 - array
        mode = "L" if array.shape[0] == 1 else "RGB"
        picture = array[0] if mode == "L" else np.ascontiguousarray(array.transpose(1, 2, 0))
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(picture, mode).save(path)


def write_task(task: Task, ways: int, out: Path, image: ImageFormat) -> list[Path]:
    """``task`` as ``out/support/classNN/III.png`` and ``out/query/classNN-III.png`` files,
    named so that sorted names give the sampler's class-major order; returns the query
    files in that order."""
    (xs, ys), (xq, yq) = task.support, task.query

    def names(labels: Tensor, folder: Path, nested: bool) -> list[Path]:
        counts = [0] * ways
        paths = []
        for label in labels.tolist():
            stem = f"{counts[label]:03d}.png"
            counts[label] += 1
            paths.append(folder / f"class{label:02d}" / stem if nested
                         else folder / f"class{label:02d}-{stem}")  # fmt: skip
        return paths

    write_images(xs, names(ys, out / "support", nested=True), image)
    queries = names(yq, out / "query", nested=False)
    write_images(xq, queries, image)
    return queries


def check(args: Args) -> dict[str, float | bool | str]:
    """Run the check; returns the four accuracies (`READINGS` and ``evaluate``), their
    half-widths, the row compared with the evaluation (``evaluate_reads``) and whether
    its accuracy equals the evaluation task by task (``deploy_matches_evaluate``)."""
    if args.checkpoint is None:
        raise ValueError("--checkpoint is required: pass runs/<run_name>/checkpoint.pt")
    if args.tasks < 1 or args.query < 1:
        raise ValueError(f"--tasks and --query must be >= 1, got {args.tasks} and {args.query}")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    learner, recipe = learner_from(read_run_checkpoint(args.checkpoint), args.which,
                                   source=args.checkpoint)  # fmt: skip
    data = dataclasses.replace(recipe.data, eval_query=args.query,
                               root=args.data_root or recipe.data.root)  # fmt: skip
    steps = recipe.training.eval_inner_steps if args.steps is None else args.steps
    sampler = build_samplers(data, splits=("test",))["test"]
    classes, examples = sampler.sample_indices(torch.Generator().manual_seed(args.seed), args.tasks)
    rows: dict[str, list[Tensor]] = {name: [] for name in (*READINGS, "evaluate")}
    for t in tqdm(range(args.tasks), desc="transfer", unit="task"):
        task = sampler.tasks_from_indices(classes[t : t + 1], examples[t : t + 1])[0]
        with tempfile.TemporaryDirectory() as tmp:
            query_files = write_task(task, data.ways, Path(tmp), data.image)
            support = load_support_folder(Path(tmp) / "support", image=data.image, ways=data.ways)
            queries = load_images(query_files, data.image)
        labels = task.query[1]
        params = adapt_to_support(learner, support.x, support.y, steps=steps)
        for name, norm in READINGS.items():
            net = adapted_model(learner, params, norm=norm, support_x=support.x)
            with torch.inference_mode():  # the whole set in one call, or each image alone
                logits = (net(queries) if norm == "transductive"
                          else torch.cat([net(q[None]) for q in queries]))  # fmt: skip
            rows[name].append((logits.argmax(1) == labels).double().mean())
        rows["evaluate"].append(learner.evaluate([task], steps=steps)[1][0].double())
    results: dict[str, float | bool | str] = {}
    for name, accs in rows.items():
        acc = torch.stack(accs)
        results[name], results[f"{name}_ci95"] = acc.mean().item(), accuracy_interval(acc)
    compared = next(name for name, norm in READINGS.items() if norm == learner.evaluation_norm)
    # Compared as numbers of right answers per task: evaluate's accuracy is a float32 mean.
    answers = len(labels)
    right = [(torch.stack(rows[name]) * answers).round() for name in (compared, "evaluate")]
    results["evaluate_reads"] = compared
    results["deploy_matches_evaluate"] = bool(torch.equal(*right))
    print(
        f"{args.checkpoint}: {args.tasks} {data.eval_protocol} {data.ways}-way {data.shots}-shot "
        f"test tasks of {data.dataset}, {args.query} query per class, {steps} inner steps, "
        f"seed {args.seed}"
    )
    for name in rows:
        print(f"{name}: {results[name]:.4f} ± {results[name + '_ci95']:.4f}")
    print(f"evaluate_reads: {compared} (norm={learner.evaluation_norm!r})")
    print(f"deploy_matches_evaluate: {str(results['deploy_matches_evaluate']).lower()}")
    return results


def cli(argv: Sequence[str] | None = None) -> int:
    """Parse, check, and turn a user error into one line on stderr and exit status 2; exit
    1 when the deployed accuracy differs from the evaluation."""
    args = parse_dataclass(Args, argv, description=__doc__.split("\n\n")[0])
    try:
        results = check(args)
    except (FileNotFoundError, ValueError) as err:
        print(f"transfer_check.py: error: {err}", file=sys.stderr)
        return 2
    return 0 if results["deploy_matches_evaluate"] else 1


if __name__ == "__main__":
    sys.exit(cli())
