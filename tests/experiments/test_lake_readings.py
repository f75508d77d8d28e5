"""Lake et al.'s within-alphabet test read two ways, end to end: each query classified on its
own (the inductive accuracy, ``test/acc``) and the run's queries assigned to the classes
one-to-one (``test/acc_one_to_one``, transductive), both against a reference written out
here from the checkpoint's best weights: prototypes of the support features, each query
embedded alone beside the support set, and the best of every permutation; and
metalearn-evaluate's ``--transductive`` and ``--one-to-one`` on the same checkpoint."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from metalearn.checkpoint import load_checkpoint
from metalearn.data.augment import SmallAffine
from metalearn.runs.evaluation import TEST_SEED, evaluate_tasks
from metalearn.runs.recipe import build_learner, read_recipe
from metalearn.runs.run import load_samplers
from metalearn.tools import evaluate as evaluate_tool
from tests.conftest import OMNIGLOT, needs_omniglot
from tests.helpers.run_helpers import checkpoint_of, make, om

WAYS = 5
TINY = dict(
    algorithm="protonet", split="alphabet", eval_protocol="within-alphabet", ways=WAYS,
    train_ways=WAYS, shots=1, query=1, eval_query=1, transductive=False, iterations=2,
    meta_batch=2, hidden=8, val_every=1, val_tasks=2, test_tasks=6, checkpoint_every=1,
    data_root=str(OMNIGLOT), track=False, device="cpu", run_name="lake",
)  # fmt: skip


def reference_scores(
    model: torch.nn.Module, support: tuple, query: torch.Tensor, *, alone: bool = True
) -> torch.Tensor:
    """``[Q, C]``: minus the squared distance of each query, embedded alone beside the
    support set (batch norm at the support rows' statistics), to each class's prototype;
    not ``alone``: the query set embedded in its own batch (the transductive reading)."""
    xs, ys = support
    with torch.no_grad():
        # Conv4's features: its output with an identity head
        eye = {"head.weight": torch.eye(model.head.weight.shape[1]),
               "head.bias": torch.zeros(model.head.weight.shape[1])}  # fmt: skip
        params = {**dict(model.named_parameters()), **eye}

        def embed(x: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(model, params, (x,), {"norm_rows": len(xs)})

        fs = embed(xs)
        protos = torch.stack([fs[ys == c].mean(0) for c in range(int(ys.max()) + 1)])
        if alone:
            fq = torch.stack([embed(torch.cat([xs, q[None]]))[-1] for q in query])
        else:
            fq = torch.func.functional_call(model, params, (query,))
    return -((fq[:, None, :] - protos[None]) ** 2).sum(-1)


@pytest.mark.slow
@needs_omniglot
def test_the_inductive_and_one_to_one_readings_equal_the_written_out_reference(
    tmp_path: Path, capsys
):
    results = om.main(make(om, **{**TINY, "out_dir": str(tmp_path)}))
    saved = load_checkpoint(tmp_path / "lake" / "checkpoint.pt")
    recipe = read_recipe(saved)
    learner = build_learner(recipe)
    learner.load_state_dict(saved["best_learner"])
    assert learner.evaluation_norm == "support"
    sampler = load_samplers(recipe, "cpu")["test"]
    classes, examples = sampler.sample_indices(torch.Generator().manual_seed(TEST_SEED), 6)
    inductive, joint, transductive = [], [], []
    for task in sampler.tasks_from_indices(classes, examples):
        scores = reference_scores(learner.model, task.support, task.query[0])
        labels = task.query[1]
        inductive.append((scores.argmax(1) == labels).double().mean())
        batch = reference_scores(learner.model, task.support, task.query[0], alone=False)
        transductive.append((batch.argmax(1) == labels).double().mean())
        best = max(itertools.permutations(range(WAYS)),
                   key=lambda p: float(scores[torch.arange(WAYS), list(p)].sum()))  # fmt: skip
        joint.append((torch.tensor(best) == labels).double().mean())
    # the gathered accuracies are float32 (one query more or less right moves them by 1/30)
    assert results["test/acc"] == pytest.approx(float(torch.stack(inductive).mean()), abs=1e-6)
    assert results["test/acc_one_to_one"] == pytest.approx(
        float(torch.stack(joint).mean()), abs=1e-6
    )
    # metalearn-evaluate reads the checkpoint either way, on the run's own test tasks
    command = ["--checkpoint", str(tmp_path / "lake" / "checkpoint.pt"), "--tasks", "6",
               "--no-track", "--one-to-one"]  # fmt: skip
    assert evaluate_tool.main(command) == 0
    printed = capsys.readouterr().out
    assert f"test/acc_one_to_one (transductive): {results['test/acc_one_to_one']:.4f}" in printed
    assert f"test/acc: {results['test/acc']:.4f}" in printed
    assert evaluate_tool.main([*command, "--transductive", "True"]) == 0
    want = float(torch.stack(transductive).mean())
    assert f"test/acc: {want:.4f}" in capsys.readouterr().out
    # --views: the run's training augmentation (Omniglot's SmallAffine) on copies of each task
    assert evaluate_tool.main([*command[:-1], "--views", "3"]) == 0
    gen = torch.Generator().manual_seed(TEST_SEED)
    acc, _ = evaluate_tasks(learner, sampler, 6, 0, gen, progress=False, views=3,
                            augment=SmallAffine())  # fmt: skip
    assert f"test/acc: {acc:.4f}" in capsys.readouterr().out


def test_views_out_of_range_are_one_line(capsys):
    assert evaluate_tool.main(["--checkpoint", "x.pt", "--views", "0"]) == 2
    assert capsys.readouterr().err.strip() == (
        "metalearn-evaluate: error: --views 0: must be 1 (no test-time augmentation) to 64"
    )


def test_transductive_is_refused_for_a_learner_that_reads_queries_one_way(tmp_path, capsys):
    args = make(om, **{**TINY, "algorithm": "maml", "transductive": None, "train_ways": None,
                       "out_dir": str(tmp_path)})  # fmt: skip
    path = checkpoint_of(tmp_path, om, args)
    assert evaluate_tool.main(["--checkpoint", str(path), "--transductive", "False"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"metalearn-evaluate: error: --transductive: {path}'s learner (maml) reads "
                   "its queries one way only; drop --transductive")  # fmt: skip
