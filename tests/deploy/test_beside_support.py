"""The third batch-norm reading, ``norm="beside_support"``: each image classified as the
last row of a batch of the support set and that image, as Reptile's default evaluation
scores queries. The deployed network equals the learner's own `evaluate` task for task
and a per-query loop written out here; its package and its exported program equal it;
packages record the reading their learner evaluates with and default to it where it
classifies each image alone."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from typing import get_args, get_type_hints

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from metalearn.algorithms import Reptile
from metalearn.data import load_images
from metalearn.deploy import (
    NORMS,
    BesideSupport,
    FrozenBatchNorm,
    GroupBatchNorm,
    adapt_to_support,
    adapted_model,
    default_norm,
    export_program,
    load_learner,
    load_package,
    load_program,
    load_support_folder,
    predict,
)
from metalearn.models import MetaBatchNorm
from metalearn.runs.run import load_samplers
from metalearn.tools import export as export_tool
from metalearn.tools import predict as predict_tool
from tests.conftest import NO_OMNIGLOT
from tests.deploy.test_deploy import CHARACTERS, _args, experiment_checkpoint, make_support_folder

needs_data = pytest.mark.skipif(not CHARACTERS.is_dir(), reason=NO_OMNIGLOT)


def test_group_batch_norm_normalises_each_group_as_its_own_batch() -> None:
    """Reference: torch's own batch norm (training mode: the batch's statistics, biased
    variance) on each group of 4 examples separately, in float64."""
    torch.manual_seed(0)
    x = torch.randn(3 * 4, 5, 6, 7, dtype=torch.float64) * 3 + 1
    weight, bias = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    got = GroupBatchNorm(4, weight, bias, 1e-5)(x)
    want = torch.cat([F.batch_norm(g, None, None, weight, bias, training=True, eps=1e-5)
                      for g in x.split(4)])  # fmt: skip
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.fixture(scope="module")
def reptile(tmp_path_factory):
    """A Reptile learner of the experiment's defaults (each query scored beside the support
    set), from an experiment checkpoint, and three of its test tasks."""
    if not CHARACTERS.is_dir():
        pytest.skip(NO_OMNIGLOT)
    tmp = tmp_path_factory.mktemp("reptile")
    checkpoint = experiment_checkpoint(tmp, _args(algorithm="reptile", eval_inner_steps=3))
    learner, recipe = load_learner(checkpoint)
    tasks = load_samplers(recipe, "cpu")["test"].batch(3, torch.Generator().manual_seed(7))
    return learner, recipe, tasks, checkpoint, tmp


def test_the_readings_a_learner_evaluates_with_and_deploys_by_default(reptile) -> None:
    learner, *_ = reptile
    assert isinstance(learner, Reptile) and learner.transductive is False
    assert learner.evaluation_norm == default_norm(learner) == "beside_support"
    one_batch = Reptile(learner.model, transductive=True)
    assert one_batch.evaluation_norm == "transductive" and default_norm(one_batch) == "support"
    maml, _ = load_learner(experiment_checkpoint(reptile[4] / "maml", _args(algorithm="maml")))
    assert maml.evaluation_norm == "transductive" and default_norm(maml) == "support"
    assert default_norm(learner.model) == "support"  # a bare network has no evaluation
    # One list of readings: the library's, metalearn-export's choices.
    assert NORMS == ("support", "transductive", "beside_support")
    choices = get_args(get_type_hints(export_tool.Args)["norm"])[0]  # Literal[...] | None
    assert get_args(choices) == NORMS


def test_beside_support_equals_reptiles_evaluate_task_for_task(reptile) -> None:
    """In float64: the deployed network (the learner's default reading) against the
    learner's own evaluation and against a loop written out here, one forward of the
    support set plus each query through the network's own transductive batch norm."""
    learner, recipe, tasks, *_ = reptile
    learner = copy.deepcopy(learner).double()
    tasks = [replace(t, support=(t.support[0].double(), t.support[1]),
                     query=(t.query[0].double(), t.query[1])) for t in tasks]  # fmt: skip
    steps = recipe.training.eval_inner_steps
    losses, accs = learner.evaluate(tasks, steps=steps)
    for task, loss, acc in zip(tasks, losses, accs):
        (xs, ys), (xq, yq) = task.support, task.query
        params = adapt_to_support(learner, xs, ys, steps=steps)
        net = adapted_model(learner, params, support_x=xs)  # the default reading
        assert isinstance(net, BesideSupport)
        with torch.no_grad():
            logits = net(xq)
            loop = torch.stack([functional_call(learner.model, params,
                                                torch.cat([xs, q[None]]))[-1]
                                for q in xq])  # fmt: skip
        torch.testing.assert_close(logits, loop, rtol=0, atol=1e-12)
        torch.testing.assert_close(F.cross_entropy(logits, yq), loss, rtol=1e-12, atol=0)
        # evaluate's accuracy is a float32 mean: compared as numbers of right answers
        assert int((logits.argmax(1) == yq).sum()) == round(float(acc) * len(yq))


def test_each_image_is_classified_alone_and_the_program_equals_it(reptile) -> None:
    learner, recipe, tasks, _, tmp = reptile
    (xs, ys), (xq, _) = tasks[0].support, tasks[0].query
    params = adapt_to_support(learner, xs, ys, steps=recipe.training.eval_inner_steps)
    net = adapted_model(learner, params, norm="beside_support", support_x=xs)
    frozen = adapted_model(learner, params, norm="support", support_x=xs)
    assert sum(isinstance(m, GroupBatchNorm) for m in net.modules()) == 4
    assert not any(isinstance(m, (MetaBatchNorm, FrozenBatchNorm)) for m in net.modules())
    with torch.inference_mode():
        whole = net(xq)
        torch.testing.assert_close(net(xq[:1])[0], whole[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(net(xq[3:5]), whole[3:5], rtol=0, atol=1e-5)
        assert (frozen(xq) - whole).abs().max() > 1e-3  # another reading, other logits
    path = export_program(net, xs, tmp / "beside.pt2", metadata={"norm": "beside_support"})
    program, meta = load_program(path, trust=True)
    assert meta == {"norm": "beside_support"}
    for x in (xq, xq[:1], xq[:7]):
        with torch.inference_mode():
            torch.testing.assert_close(program.module()(x), net(x), rtol=0, atol=1e-5)
    prediction = predict(path, xq, trust=True)
    with torch.inference_mode():
        torch.testing.assert_close(prediction.probabilities, torch.softmax(whole, -1),
                                   rtol=0, atol=1e-6)  # fmt: skip


def test_bad_readings_are_refused_in_one_line(reptile, capsys) -> None:
    learner, _, tasks, checkpoint, tmp = reptile
    (xs, ys), _ = tasks[0].support, tasks[0].query
    params = adapt_to_support(learner, xs, ys, steps=0)
    with pytest.raises(ValueError, match="norm='frozen'; choose one of 'support', 'trans"):
        adapted_model(learner, params, norm="frozen", support_x=xs)
    with pytest.raises(ValueError, match="norm='beside_support' needs support_x"):
        adapted_model(learner, params, norm="beside_support")
    plain = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, 5))
    weights = dict(plain.named_parameters())
    with pytest.raises(ValueError, match="'beside_support' found no MetaBatchNorm"):
        adapted_model(plain, weights, norm="beside_support", support_x=xs)
    support = make_support_folder(tmp / "bad", shots=1)
    with pytest.raises(SystemExit) as stop:
        export_tool.main(["--checkpoint", str(checkpoint), "--support", str(support),
                          "--norm", "beside"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1, err
    assert "--norm" in err[0] and "beside_support" in err[0]
    assert not (checkpoint.parent / "adapted").exists()


def _query_folder(tmp: Path) -> Path:
    """Five Omniglot PNGs (other drawers than the support folder's) in one folder."""
    queries = tmp / "queries"
    queries.mkdir()
    for c, folder in enumerate(sorted(make_support_folder(tmp, shots=1, offset=4).iterdir())):
        (png,) = folder.iterdir()
        png.rename(queries / f"q{c}.png")
    return queries


@needs_data
def test_a_reptile_package_reads_beside_support_by_default_end_to_end(reptile, capsys) -> None:
    """metalearn-export without --norm on the Reptile checkpoint writes the learner's own
    reading and records it; metalearn-predict's probabilities are the in-process network's
    on the decoded images, classified in calls of --batch images."""
    learner, recipe, _, checkpoint, tmp = reptile
    folder = tmp / "e2e"
    support = make_support_folder(folder, shots=2)
    out = folder / "reptile"
    assert export_tool.main(["--checkpoint", str(checkpoint), "--support", str(support),
                             "--out", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "batch norm: beside_support (the learner's evaluate reads beside_support)" in printed
    meta = load_package(out).document
    assert (meta["norm"], meta["evaluation_norm"]) == ("beside_support", "beside_support")
    queries = _query_folder(folder)
    argv = ["--model", str(out), "--images", str(queries), "--batch", "2"]
    assert predict_tool.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["predictions"]
    loaded = load_support_folder(support, image=recipe.data.image, ways=recipe.model.ways)
    steps = recipe.training.eval_inner_steps
    params = adapt_to_support(learner, loaded.x, loaded.y, steps=steps)
    net = adapted_model(learner, params, norm="beside_support", support_x=loaded.x)
    images = load_images(sorted(queries.iterdir()), recipe.data.image)
    with torch.inference_mode():
        want = torch.softmax(net(images), -1).double()
    got = torch.tensor([list(r["probabilities"].values()) for r in rows], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
