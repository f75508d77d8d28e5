"""The published sizes each data set gives tasks, and the check of ways, shots and queries
made against them before any data loads.

Omniglot's numbers are checked against the real layout (conftest's `OMNIGLOT`): its files
counted by walking the folders, split by `omniglot_splits` and handed to the samplers the
experiments build, so the check refuses exactly what those samplers refuse.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from metalearn.data import (
    IMAGE_SET_NAMES,
    IMAGE_SPLITS,
    ImageSet,
    OmniglotImages,
    check_task_sizes,
    omniglot_samplers,
    omniglot_splits,
    published_sizes,
)
from metalearn.data.sizes import PUBLISHED_SIZES
from metalearn.data.within_alphabet import within_alphabet_samplers
from tests.conftest import HAS_OMNIGLOT, NO_OMNIGLOT, OMNIGLOT


def test_every_data_set_has_an_entry():
    assert set(PUBLISHED_SIZES) == set(IMAGE_SET_NAMES)
    assert published_sizes("folder") is None
    check_task_sizes("folder", ways=5000, shots=1000, query=1000)  # nothing published


@pytest.mark.parametrize(
    ("dataset", "classes", "examples"),
    [
        ("mini-imagenet", (64, 16, 20), 600),
        ("cifar-fs", (64, 16, 20), 600),
        ("fc100", (60, 20, 20), 600),
        ("tiered-imagenet", (351, 97, 160), 1300),
        ("cub", (100, 50, 50), 60),
    ],
)
def test_the_image_benchmarks_published_sizes(dataset, classes, examples):
    sizes = published_sizes(dataset)
    assert tuple(sizes.classes[s] for s in IMAGE_SPLITS) == classes
    assert sizes.examples == examples
    # The limits are inclusive: the largest task the sizes allow passes, one more is refused.
    check_task_sizes(dataset, ways=min(classes), shots=examples - 1, query=1, eval_query=1,
                     train_ways=classes[0])  # fmt: skip
    with pytest.raises(ValueError, match=rf"^--ways {min(classes) + 1}: "):
        check_task_sizes(dataset, ways=min(classes) + 1, shots=1, query=1)
    with pytest.raises(ValueError, match=rf"^--train-ways {classes[0] + 1}: "):
        check_task_sizes(dataset, ways=5, train_ways=classes[0] + 1, shots=1, query=1)


def test_messages_name_the_flag_and_the_limit():
    with pytest.raises(ValueError) as info:
        check_task_sizes("omniglot", ways=5, shots=19, query=5)
    assert str(info.value) == (
        "--shots 19 with --query 5 needs 24 examples per class; Omniglot has 20"
    )
    with pytest.raises(ValueError) as info:
        check_task_sizes("omniglot", ways=2000, shots=1, query=1)
    assert str(info.value) == (
        "--ways 2000: Omniglot's val split has 400 classes (100 characters x 4 rotations); "
        "lower --ways"
    )
    with pytest.raises(ValueError) as info:
        check_task_sizes("omniglot", ways=5, train_ways=5000, shots=1, query=1)
    assert str(info.value) == (
        "--train-ways 5000: Omniglot's train split has 4400 classes (1100 characters x 4 "
        "rotations); lower --train-ways"
    )
    with pytest.raises(ValueError) as info:  # the training tasks fit, the test tasks do not
        check_task_sizes("mini-imagenet", ways=5, shots=5, query=15, eval_query=596)
    assert str(info.value) == (
        "--shots 5 with --eval-query 596 needs 601 examples per class; mini-ImageNet has 600"
    )
    with pytest.raises(ValueError, match=r"needs 61 examples per class; CUB has at most 60$"):
        check_task_sizes("cub", ways=5, shots=1, query=60)
    # --train-ways equal to --ways is --ways, which the user typed.
    with pytest.raises(ValueError, match=r"^--ways 5000: Omniglot's train split"):
        check_task_sizes("omniglot", ways=5000, train_ways=5000, shots=1, query=1,
                         splits=("train",))  # fmt: skip
    # Only the splits asked for are checked: the test split alone has 1692 classes.
    check_task_sizes("omniglot", ways=1692, shots=1, query=1, splits=("test",))
    with pytest.raises(ValueError, match="split 'lake'"):
        check_task_sizes("omniglot", ways=5, shots=1, query=1, split="lake")
    with pytest.raises(ValueError, match="dataset 'imagenet'"):
        check_task_sizes("imagenet", ways=5, shots=1, query=1)


def _real_omniglot() -> OmniglotImages:
    """The real layout, walked here: one 1x1 image per drawing (the sizes are what matter)."""
    if not HAS_OMNIGLOT:
        pytest.skip(NO_OMNIGLOT)
    root = OMNIGLOT
    characters, alphabets, background, drawings = [], [], [], set()
    for subset in ("images_background", "images_evaluation"):
        for alphabet in sorted(p for p in (root / subset).iterdir() if p.is_dir()):
            for character in sorted(p for p in alphabet.iterdir() if p.is_dir()):
                characters.append(f"{alphabet.name}/{character.name}")
                alphabets.append(alphabet.name)
                background.append(subset == "images_background")
                drawings.add(len(list(character.glob("*.png"))))
    assert drawings == {20}
    images = torch.zeros(len(characters), 20, 1, 1, dtype=torch.uint8)
    drawers = torch.arange(1, 21).expand(len(characters), 20)
    return OmniglotImages(images, tuple(characters), tuple(alphabets), torch.tensor(background),
                          "walked", drawers)  # fmt: skip


def test_omniglots_sizes_are_the_real_layouts():
    data = _real_omniglot()
    assert len(data.characters) == 1623 and int(data.background.sum()) == 964
    assert published_sizes("omniglot").examples == 20
    for split, rotations in (("maml", 4), ("alphabet", 1)):
        index = omniglot_splits(data, split)
        sizes = published_sizes("omniglot", split)
        assert {s: rotations * len(i) for s, i in index.items()} == dict(sizes.classes)
    index = omniglot_splits(data, "alphabet")
    largest = {s: max(Counter(data.alphabets[c] for c in i.tolist()).values())
               for s, i in index.items()}  # fmt: skip
    assert largest == dict(published_sizes("omniglot", "alphabet", within_alphabet=True).classes)
    with pytest.raises(ValueError, match="needs --split alphabet"):
        published_sizes("omniglot", "maml", within_alphabet=True)


@pytest.mark.parametrize("split", ["maml", "alphabet"])
def test_the_check_refuses_what_the_samplers_refuse(split):
    data = _real_omniglot()
    limit = min(published_sizes("omniglot", split).classes[s] for s in ("val", "test"))
    for ways in (limit, limit + 1):
        try:
            omniglot_samplers(data, split, ways=ways, shots=19, queries=1)
            sampled = None
        except ValueError as err:
            sampled = err
        try:
            check_task_sizes("omniglot", ways=ways, shots=19, query=1, split=split)
            checked = None
        except ValueError as err:
            checked = err
        assert (sampled is None) == (checked is None) == (ways == limit), (ways, sampled)
    with pytest.raises(ValueError, match="shots"):  # the samplers' own refusal
        omniglot_samplers(data, split, ways=5, shots=19, queries=2)
    with pytest.raises(ValueError, match="^--shots 19 with --query 2 needs 21"):
        check_task_sizes("omniglot", ways=5, shots=19, query=2, split=split)


def test_within_alphabet_limits_are_the_samplers():
    data = _real_omniglot()
    largest = published_sizes("omniglot", "alphabet", within_alphabet=True).classes
    within_alphabet_samplers(data, ways=min(largest["val"], largest["test"]), shots=1, queries=1)
    with pytest.raises(ValueError, match="largest alphabet"):
        within_alphabet_samplers(data, ways=largest["val"] + 1, shots=1, queries=1)
    check_task_sizes("omniglot", ways=46, train_ways=55, shots=1, query=1, split="alphabet",
                     train_tasks="within-alphabet", eval_protocol="within-alphabet")  # fmt: skip
    with pytest.raises(ValueError, match=r"^--train-ways 56: .* 55 classes in its largest"):
        check_task_sizes("omniglot", ways=5, train_ways=56, shots=1, query=1, split="alphabet",
                         train_tasks="within-alphabet")  # fmt: skip
    with pytest.raises(ValueError, match=r"^--ways 47: Omniglot's val split has 46 classes"):
        check_task_sizes("omniglot", ways=47, shots=1, query=1, split="alphabet",
                         eval_protocol="within-alphabet")  # fmt: skip


def test_the_image_set_samplers_refuse_past_the_published_examples():
    """An `ImageSet` of the published 600 examples per class (mini-ImageNet's count): its
    sampler takes shots + queries = 600 and refuses 601, as the check does."""
    images = torch.zeros(5 * 600, 1, 1, 1, dtype=torch.uint8)
    image_set = ImageSet(images, torch.full((5,), 600), tuple("abcde"), "mini-imagenet", "test")
    image_set.sampler(ways=5, shots=5, queries=595)
    check_task_sizes("mini-imagenet", ways=5, shots=5, query=595)
    with pytest.raises(ValueError, match="= 601 but each class has only 600"):
        image_set.sampler(ways=5, shots=5, queries=596)
    with pytest.raises(ValueError, match="needs 601 examples per class"):
        check_task_sizes("mini-imagenet", ways=5, shots=5, query=596)


def test_train_shots_are_checked_on_the_training_split_only():
    # MetaOptNet's mini-ImageNet run: 15 training shots + 6 queries, 5 test shots + 15.
    check_task_sizes("mini-imagenet", ways=5, shots=5, train_shots=15, query=6, eval_query=15)
    # Omniglot's 20 drawings: 15 training shots and 6 queries need 21, named by its flag.
    with pytest.raises(ValueError) as info:
        check_task_sizes("omniglot", ways=5, shots=1, train_shots=15, query=6, eval_query=15)
    assert str(info.value) == (
        "--train-shots 15 with --query 6 needs 21 examples per class; Omniglot has 20"
    )
    # The test tasks keep --shots: 1 shot + 19 evaluation queries fits though 15 + 19 would not.
    check_task_sizes("omniglot", ways=5, shots=1, train_shots=14, query=6, eval_query=19)
    with pytest.raises(ValueError, match=r"^--shots 2 with --eval-query 19 needs 21 "):
        check_task_sizes("omniglot", ways=5, shots=2, train_shots=1, query=6, eval_query=19)
    # --train-shots equal to --shots is --shots, which the user typed.
    with pytest.raises(ValueError, match=r"^--shots 16 with --query 6 needs 22 "):
        check_task_sizes("omniglot", ways=5, shots=16, train_shots=16, query=6,
                         splits=("train",))  # fmt: skip
