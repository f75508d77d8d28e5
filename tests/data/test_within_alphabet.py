"""The within-alphabet protocol: one alphabet per task, disjoint drawers, the real layout.

Each image of the synthetic set carries its character and drawer in two pixels, so a
drawn task is checked by reading its images back, independently of the sampler's indices.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from metalearn.data import load_omniglot, omniglot_samplers
from metalearn.data.augment import SmallAffine
from metalearn.data.within_alphabet import WithinAlphabetSampler, within_alphabet_samplers
from tests.conftest import HAS_OMNIGLOT, NO_OMNIGLOT, OMNIGLOT, ROOT, experiment

# Alphabet sizes: "small" has too few characters for 4-way tasks and is never drawn.
ALPHABETS = ["a"] * 6 + ["b"] * 4 + ["small"] * 3 + ["c"] * 5
DRAWERS = 10


def tagged_images() -> torch.Tensor:
    """``[C, M, 1, 4, 4]``: pixel (0, 0) is the character, pixel (0, 1) the drawer."""
    images = torch.zeros(len(ALPHABETS), DRAWERS, 1, 4, 4)
    images[:, :, 0, 0, 0] = torch.arange(len(ALPHABETS), dtype=torch.float)[:, None]
    images[:, :, 0, 0, 1] = torch.arange(DRAWERS, dtype=torch.float)[None, :]
    return images


def test_tasks_keep_to_one_alphabet_and_split_drawers():
    shots, queries, ways = 2, 3, 4
    sampler = WithinAlphabetSampler(tagged_images(), ALPHABETS, ways=ways, shots=shots,
                                    queries=queries)  # fmt: skip
    seen = set()
    for task in sampler.batch(300, torch.Generator().manual_seed(0)):
        (xs, ys), (xq, yq) = task.support, task.query
        chars_s, drawers_s = xs[:, 0, 0, 0].long(), xs[:, 0, 0, 1].long()
        chars_q, drawers_q = xq[:, 0, 0, 0].long(), xq[:, 0, 0, 1].long()
        alphabets = {ALPHABETS[c] for c in chars_s.tolist() + chars_q.tolist()}
        assert len(alphabets) == 1 and "small" not in alphabets
        seen |= alphabets
        for label in range(ways):  # one character per label, in support and query alike
            assert len(set(chars_s[ys == label].tolist() + chars_q[yq == label].tolist())) == 1
        assert len(set(chars_s.tolist())) == ways
        # The task's support drawers are the same K people for every class; queries by others.
        assert len(set(drawers_s.tolist())) == shots
        assert len(set(drawers_q.tolist())) == queries
        assert not set(drawers_s.tolist()) & set(drawers_q.tolist())
    assert seen == {"a", "b", "c"}


def test_alphabets_are_drawn_uniformly():
    sampler = WithinAlphabetSampler(tagged_images(), ALPHABETS, ways=4, shots=1, queries=1)
    classes, _ = sampler.sample_indices(torch.Generator().manual_seed(1), 3000)
    alphabet = [ALPHABETS[c] for c in classes[:, 0].tolist()]
    counts = [alphabet.count(a) for a in "abc"]
    # 1000 expected each; the binomial sd is 26, so 150 is about 6 sd.
    assert all(abs(c - 1000) < 150 for c in counts), counts


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="largest alphabet here has 6 characters"):
        WithinAlphabetSampler(tagged_images(), ALPHABETS, ways=7, shots=1, queries=1)
    with pytest.raises(ValueError, match="one alphabet per character"):
        WithinAlphabetSampler(tagged_images(), ALPHABETS[:-1], ways=2, shots=1, queries=1)


@pytest.fixture(scope="module")
def omniglot():
    if not HAS_OMNIGLOT:
        pytest.skip(NO_OMNIGLOT)
    return load_omniglot(OMNIGLOT, progress=False)


def test_omniglot_file_names_give_the_drawers(omniglot):
    assert omniglot.drawers.shape == (1623, 20)
    assert bool((omniglot.drawers == torch.arange(1, 21)).all())


def test_omniglot_within_alphabet_split(omniglot):
    samplers = within_alphabet_samplers(omniglot, ways=20, shots=1, queries=5,
                                        augment=SmallAffine())  # fmt: skip
    test, train = samplers["test"], samplers["train"]
    assert len(test.alphabets) == 20 and test.num_classes == 659  # all evaluation alphabets
    assert train.augment is not None and samplers["val"].augment is None
    classes, examples = test.sample_indices(torch.Generator().manual_seed(0), 50)
    evaluation = [i for i, b in enumerate(omniglot.background.tolist()) if not b]
    names = [omniglot.alphabets[evaluation[c]] for c in classes.flatten().tolist()]
    per_task = [set(names[i * 20 : (i + 1) * 20]) for i in range(50)]
    assert all(len(s) == 1 for s in per_task)
    assert bool((examples[:, :, :1] != examples[:, :, 1:]).all())  # drawers disjoint


def test_maml_split_and_unnamed_drawers_are_refused(omniglot):
    with pytest.raises(ValueError, match="needs --split alphabet"):
        within_alphabet_samplers(omniglot, "maml", ways=5, shots=1, queries=1)
    unnamed = type(omniglot)(**{**omniglot.__dict__, "drawers": None})
    with pytest.raises(ValueError, match="named <id>_01.png"):
        within_alphabet_samplers(unnamed, ways=5, shots=1, queries=1)


def test_episodic_augment_reaches_training_only(omniglot):
    samplers = omniglot_samplers(omniglot, "alphabet", ways=5, shots=1, queries=1,
                                 augment=SmallAffine())  # fmt: skip
    assert samplers["train"].augment is not None
    assert samplers["val"].augment is None and samplers["test"].augment is None


def test_experiment_refuses_the_protocol_on_mamls_split():
    out = subprocess.run(
        [sys.executable, str(ROOT / "experiments/omniglot_maml.py"), "--eval-protocol",
         "within-alphabet", "--no-track"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert "--eval-protocol within-alphabet draws each task from one alphabet" in out.stderr
    assert "add --split alphabet" in out.stderr


@pytest.mark.parametrize("kind", ["episodic", "within-alphabet"])
def test_the_experiments_training_tasks_are_augmented_as_batch_augments(kind):
    from metalearn.data import EpisodicSampler
    from metalearn.runs.outer_loop import my_tasks as _my_tasks

    images = torch.rand(
        len(ALPHABETS), DRAWERS, 1, 8, 8, generator=torch.Generator().manual_seed(0)
    )
    common = dict(ways=3, shots=1, queries=2, augment=SmallAffine())
    sampler = (EpisodicSampler(images, **common) if kind == "episodic"
               else WithinAlphabetSampler(images, ALPHABETS, **common))  # fmt: skip
    trained = _my_tasks(sampler, 4, torch.Generator().manual_seed(3))
    batch = sampler.batch(4, torch.Generator().manual_seed(3))
    plain = sampler.tasks_from_indices(*sampler.sample_indices(torch.Generator().manual_seed(3), 4))
    for t, b, p in zip(trained, batch, plain):
        assert torch.equal(t.support[0], b.support[0]) and torch.equal(t.query[0], b.query[0])
        assert not torch.equal(t.support[0], p.support[0])  # the distortion was applied
        assert torch.equal(t.support[1], p.support[1])  # to the same tasks


def test_the_presets_parse_to_their_recipes():
    om = experiment("omniglot_maml")

    from metalearn.runs.cli import flatten

    lake = flatten(om.parse_args(["--preset", "cpu-20w1s", "--no-track"]))
    assert (lake["algorithm"], lake["ways"], lake["shots"], lake["split"]) == (
        "protonet", 20, 1, "alphabet",
    )  # fmt: skip
    assert (lake["eval_protocol"], lake["train_tasks"], lake["augment"]) == (
        "within-alphabet", "episodic", True,
    )  # fmt: skip
    assert lake["train_ways"] == 60
    assert lake["transductive"] is False  # each query classified on its own, as Lake et al.
    assert (lake["meta_batch"], lake["query"], lake["iterations"]) == (8, 3, 3000)
    default = flatten(om.parse_args(["--no-track"]))
    assert (default["algorithm"], default["ways"], default["split"]) == ("protomaml", 5, "maml")
    assert om.parse_args(["--algorithm", "maml", "--no-track"]).learner.algorithm == "maml"
