"""A trained Omniglot checkpoint, deployed, on Lake et al.'s within-alphabet tasks.

What: draws within-alphabet test tasks (`metalearn.data.within_alphabet`, one query per
class by default, as Lake et al.'s runs), and for each writes the task as a user would hold
it: a support folder of the original PNG drawings (one sub-folder per class) and a folder
of query drawings. The model is then adapted through `metalearn.deploy` exactly as a
deployed model is (`load_support_folder`, `adapt_to_support`, `adapted_model`) and the
queries are classified two ways:

* ``one at a time`` (``norm="support"``): batch norm frozen at the support set's
  statistics, each query image in its own call, as a deployed model sees them;
* ``all at once`` (``norm="transductive"``): the whole query set in one call, batch norm on
  its statistics, which is what the experiment's test measures.

It prints both accuracies with their 95% intervals over tasks, and the experiment's own
evaluation (`MetaLearner.evaluate`) of the same tasks from the cached tensors, which the
all-at-once number must equal: the files, decoding and deploy path change nothing.

Command:
    python scripts/transfer_check.py --checkpoint runs/NAME/checkpoint.pt --tasks 400
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor
from tqdm import tqdm

from metalearn.data import decode_image, load_omniglot, omniglot_splits
from metalearn.data.omniglot import SUBSETS, resolve_data_root
from metalearn.data.within_alphabet import within_alphabet_samplers
from metalearn.deploy import adapt_to_support, adapted_model, load_learner, load_support_folder
from metalearn.runs.cli import parse_dataclass
from metalearn.runs.evaluation import TEST_SEED, accuracy_interval


@dataclass
class Args:
    """Arguments of transfer_check.py (each is a --flag; see --help)."""

    checkpoint: str | None = None
    """An Omniglot run's checkpoint on the alphabet split, runs/<run_name>/checkpoint.pt."""
    which: Literal["best", "last"] = "best"
    """best (the best-validation weights) or last."""
    tasks: int = 400
    """Within-alphabet test tasks."""
    query: int = 1
    """Query drawings per class (Lake et al.: 1), each by a drawer other than the support's."""
    steps: int | None = None
    """Inner steps on each support folder (default: the run's eval_inner_steps)."""
    data_root: str | None = None
    """The Omniglot folder (default: the run's, else $METALEARN_DATA)."""
    seed: int = TEST_SEED
    """Seeds the task draw."""
    threads: int = 1
    """Torch CPU threads (0: torch's default)."""


def drawing_path(root: Path, character: str, background: bool, drawer: int) -> Path:
    """The PNG of ``character`` (``"<Alphabet>/characterNN"``) by drawer ``drawer`` (1-based)."""
    folder = root / SUBSETS[0 if background else 1] / character
    (path,) = folder.glob(f"*_{drawer:02d}.png")
    return path


def write_task(root: Path, files: Sequence[Sequence[Path]], shots: int, out: Path) -> list[Path]:
    """Copy a task's drawings into ``out/support/classNN/`` and ``out/query/``.

    Args:
        files: per class ``j``, its drawings: the first ``shots`` support, the rest queries.

    Returns:
        The query files, class-major (query ``i`` of class ``j`` at ``j * Q + i``).
    """
    queries = []
    (out / "query").mkdir(parents=True)
    for j, paths in enumerate(files):
        (out / "support" / f"class{j:02d}").mkdir(parents=True)
        for path in paths[:shots]:
            shutil.copy(path, out / "support" / f"class{j:02d}" / path.name)
        for path in paths[shots:]:
            queries.append(Path(shutil.copy(path, out / "query" / path.name)))
    return queries


def load_images(paths: Sequence[Path]) -> Tensor:
    """Query drawings ``[B, 1, 28, 28]``, decoded as the support folder is."""
    return torch.stack(
        [torch.from_numpy(decode_image(str(p), 28, "lanczos")) for p in paths]
    ).unsqueeze(1).float().div_(255)  # fmt: skip


def check(args: Args) -> dict[str, float]:
    """Run the check; returns the three accuracies and their half-widths."""
    if args.checkpoint is None:
        raise ValueError("--checkpoint is required: pass runs/<run_name>/checkpoint.pt")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    learner, run = load_learner(args.checkpoint, which=args.which)
    if run.get("dataset", "omniglot") != "omniglot" or run.get("split") != "alphabet":
        raise ValueError(f"{args.checkpoint} is not an Omniglot alphabet-split run; train "
                         "with --split alphabet (e.g. --preset cpu-20w1s)")  # fmt: skip
    steps = run["eval_inner_steps"] if args.steps is None else args.steps
    data_root = args.data_root or run.get("data_root")
    data = load_omniglot(data_root, progress=False)
    root = resolve_data_root(data_root)
    sampler = within_alphabet_samplers(data, ways=run["ways"], shots=run["shots"],
                                       queries=args.query)["test"]  # fmt: skip
    test = omniglot_splits(data, "alphabet")["test"].tolist()
    classes, drawers = sampler.sample_indices(torch.Generator().manual_seed(args.seed), args.tasks)
    alone, together, reference = [], [], []
    for t in tqdm(range(args.tasks), desc="transfer", unit="task"):
        chars = [test[c] for c in classes[t].tolist()]
        files = [[drawing_path(root, data.characters[c], bool(data.background[c]), d + 1)
                  for d in drawers[t, 0].tolist()] for c in chars]  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            query_files = write_task(root, files, run["shots"], Path(tmp))
            support = load_support_folder(Path(tmp) / "support", ways=run["ways"])
            queries, labels = (
                load_images(query_files),
                torch.arange(run["ways"]).repeat_interleave(args.query),
            )
        params = adapt_to_support(learner, support.x, support.y, steps=steps)
        frozen = adapted_model(learner, params, norm="support", support_x=support.x)
        batch = adapted_model(learner, params, norm="transductive")
        with torch.inference_mode():
            one = torch.cat([frozen(q[None]) for q in queries]).argmax(1)
            alone.append((one == labels).double().mean())
            together.append((batch(queries).argmax(1) == labels).double().mean())
        task = sampler.tasks_from_indices(classes[t : t + 1], drawers[t : t + 1])
        reference.append(learner.evaluate(task, steps=steps)[1][0].double())
    results = {}
    for name, accs in (
        ("one_at_a_time", alone),
        ("all_at_once", together),
        ("evaluate", reference),
    ):
        acc = torch.stack(accs)
        results[name], results[f"{name}_ci95"] = acc.mean().item(), accuracy_interval(acc)
    print(
        f"{args.checkpoint}: {args.tasks} within-alphabet {run['ways']}-way {run['shots']}-shot "
        f"tasks, {args.query} query per class, {steps} inner steps, seed {args.seed}"
    )
    for name in ("one_at_a_time", "all_at_once", "evaluate"):
        print(f"{name}: {results[name]:.4f} ± {results[name + '_ci95']:.4f}")
    return results


def cli(argv: Sequence[str] | None = None) -> int:
    """Parse, check, and turn a user error into one line on stderr and exit status 2."""
    args = parse_dataclass(Args, argv, description=__doc__.split("\n\n")[0])
    try:
        check(args)
    except (FileNotFoundError, ValueError) as err:
        print(f"transfer_check.py: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
