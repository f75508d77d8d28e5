"""EpisodicSampler on classes of uneven sizes, its equal-size path, and per-task augmentation.

References: the indices the sampler drew before classes of uneven sizes existed (frozen
below), direct indexing of the image bank, and binomial bounds on how often each example is
drawn.
"""

from __future__ import annotations

import math

import pytest
import torch

from metalearn.data import EpisodicSampler, ImageSet, PadCrop

# Drawn by the equal-size sampler of the previous release from
# torch.arange(12 * 20 * 4, dtype=torch.uint8).reshape(12, 20, 1, 2, 2),
# ways=5, shots=1, queries=3, sample_indices(Generator().manual_seed(0), tasks=2).
FROZEN = {
    (0,): (
        [[0, 3, 5, 1, 4], [7, 9, 6, 1, 11]],
        [
            [[2, 11, 0, 9], [13, 1, 11, 0], [3, 6, 16, 7], [19, 6, 3, 14], [15, 0, 18, 12]],
            [[8, 12, 17, 5], [10, 0, 8, 1], [19, 16, 1, 10], [2, 19, 4, 13], [19, 18, 15, 3]],
        ],
    ),
    (0, 1, 2, 3): (
        [[44, 15, 5, 0, 19], [27, 19, 7, 25, 3]],
        [
            [[1, 6, 16, 19], [0, 9, 13, 1], [14, 13, 6, 19], [11, 14, 4, 1], [11, 0, 3, 6]],
            [[1, 12, 3, 0], [15, 5, 2, 19], [11, 8, 18, 3], [16, 9, 11, 17], [3, 15, 2, 11]],
        ],
    ),
}


def _equal_images() -> torch.Tensor:
    return torch.arange(12 * 20 * 4, dtype=torch.uint8).reshape(12, 20, 1, 2, 2)


@pytest.mark.parametrize("rotations", list(FROZEN))
def test_equal_classes_draw_what_they_drew_before(rotations):
    images = _equal_images()
    classes, examples = FROZEN[rotations]
    for sampler in (
        EpisodicSampler(images, ways=5, shots=1, queries=3, rotations=rotations),
        # The same images as [N, ...] with equal counts take the same path.
        EpisodicSampler(
            images.flatten(0, 1), counts=[20] * 12, ways=5, shots=1, queries=3, rotations=rotations
        ),
    ):
        got = sampler.sample_indices(torch.Generator().manual_seed(0), tasks=2)
        assert got[0].tolist() == classes and got[1].tolist() == examples


def test_equal_counts_give_the_same_tasks_as_the_class_tensor():
    images = _equal_images()
    flat = ImageSet(images.flatten(0, 1), torch.full((12,), 20), tuple(map(str, range(12))))
    one = EpisodicSampler(images, ways=4, shots=2, queries=2).batch(
        3, torch.Generator().manual_seed(4)
    )
    two = flat.sampler(ways=4, shots=2, queries=2).batch(3, torch.Generator().manual_seed(4))
    for a, b in zip(one, two):
        assert torch.equal(a.support[0], b.support[0]) and torch.equal(a.query[0], b.query[0])


COUNTS = [3, 7, 5, 12, 4, 9]  # uneven; the smallest class holds 3 images


def _uneven(rows_per_class=COUNTS) -> tuple[torch.Tensor, torch.Tensor]:
    """Images whose every pixel is their row number (so a task names its rows)."""
    total = sum(rows_per_class)
    images = torch.arange(total, dtype=torch.float64)[:, None, None, None].expand(total, 1, 3, 3)
    return images.contiguous(), torch.tensor(rows_per_class)


@pytest.mark.parametrize(
    "counts, shots, queries",
    [(COUNTS, 1, 2), ([9, 15, 10, 30, 11], 2, 1)],  # 3*3 > 3: top-k keys; 3*3 <= 9: rejection
)
def test_uneven_classes_draw_distinct_examples_evenly(counts, shots, queries):
    images, counts = _uneven(counts)
    sampler = EpisodicSampler(images, counts=counts, ways=3, shots=shots, queries=queries)
    tasks = 3000
    classes, examples = sampler.sample_indices(torch.Generator().manual_seed(0), tasks=tasks)
    n = shots + queries
    assert classes.shape == (tasks, 3) and examples.shape == (tasks, 3, n)
    assert all(len(set(row)) == 3 for row in classes.tolist())
    assert all(len(set(row)) == n for row in examples.flatten(0, 1).tolist())
    highs = counts[classes]
    assert bool((examples < highs[..., None]).all()) and bool((examples >= 0).all())
    # Each example of class c is drawn w.p. n / counts[c] whenever c is; bound: 5 sigma.
    for c, m in enumerate(counts.tolist()):
        picked = examples[classes == c]  # [times c was drawn, n]
        hits = torch.bincount(picked.flatten(), minlength=m)[:m].double()
        p = n / m
        sigma = math.sqrt(len(picked) * p * (1 - p)) if p < 1 else 0.0
        assert (hits - len(picked) * p).abs().max() <= 5 * sigma + 1e-9, (c, hits)


@pytest.mark.parametrize("rotations", [(0,), (0, 1, 2, 3)])
def test_uneven_tasks_hold_the_drawn_rows_turned(rotations):
    counts = torch.tensor(COUNTS)
    total = int(counts.sum())
    images = torch.randn(total, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    offsets = torch.cumsum(counts, 0) - counts
    sampler = EpisodicSampler(
        images, counts=counts, ways=4, shots=1, queries=2, rotations=rotations
    )
    assert sampler.num_classes == 6 * len(rotations)
    classes, examples = sampler.sample_indices(torch.Generator().manual_seed(2), tasks=5)
    tasks = sampler.tasks_from_indices(classes, examples)
    for task, task_classes, task_examples in zip(tasks, classes, examples):
        for j, (c, row) in enumerate(zip(task_classes.tolist(), task_examples)):
            base, turn = divmod(c, len(rotations))
            ref = torch.rot90(images[offsets[base] + row], rotations[turn], dims=(-2, -1))
            assert torch.equal(task.support[0][j : j + 1], ref[:1])
            assert torch.equal(task.query[0][2 * j : 2 * j + 2], ref[1:])
        assert task.support[1].tolist() == [0, 1, 2, 3]
        assert task.query[1].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_uneven_draws_are_reproducible_per_seed():
    images, counts = _uneven()
    sampler = EpisodicSampler(images, counts=counts, ways=3, shots=1, queries=2)
    flat = lambda tasks: torch.cat([torch.cat([t.support[0], t.query[0]]) for t in tasks])  # noqa: E731
    one = flat(sampler.batch(6, torch.Generator().manual_seed(7)))
    two = flat(sampler.batch(6, torch.Generator().manual_seed(7)))
    other = flat(sampler.batch(6, torch.Generator().manual_seed(8)))
    assert torch.equal(one, two) and not torch.equal(one, other)


def test_uneven_errors_name_the_class_and_the_numbers():
    images, counts = _uneven()
    names = [f"n{i:02d}" for i in range(6)]
    with pytest.raises(ValueError, match=r"1 \+ 3 = 4 but class 0 \('n00'\) has only 3 examples"):
        EpisodicSampler(images, counts=counts, ways=2, shots=1, queries=3, class_names=names)
    with pytest.raises(ValueError, match=r"counts sum to 40 but images holds 41 examples"):
        EpisodicSampler(torch.cat([images, images[:1]]), counts=counts, ways=2, shots=1, queries=1)
    with pytest.raises(ValueError, match=r"with counts, images must be \[examples, channels"):
        EpisodicSampler(images[:, 0], counts=counts, ways=2, shots=1, queries=1)


def test_augmentation_is_per_task_seeded_and_off_by_default():
    images, counts = _uneven()
    images = images / 40  # in [0, 1)
    plain = EpisodicSampler(images, counts=counts, ways=3, shots=1, queries=2)
    augment = PadCrop(1)
    augmented = EpisodicSampler(images, counts=counts, ways=3, shots=1, queries=2, augment=augment)

    # Off: batch draws the indices and nothing else.
    g = torch.Generator().manual_seed(5)
    tasks = plain.batch(4, g)
    reference = torch.Generator().manual_seed(5)
    classes, examples = plain.sample_indices(reference, 4)
    assert torch.equal(g.get_state(), reference.get_state())
    for task, ref in zip(tasks, plain.tasks_from_indices(classes, examples)):
        assert torch.equal(task.support[0], ref.support[0])

    # On: the same indices, then one seed per task; each task augmented with its own seed.
    g = torch.Generator().manual_seed(5)
    out = augmented.batch(4, g)
    reference = torch.Generator().manual_seed(5)
    classes, examples = augmented.sample_indices(reference, 4)
    seeds = torch.randint(2**62, (4,), generator=reference)
    for task, ref, seed in zip(out, plain.tasks_from_indices(classes, examples), seeds.tolist()):
        x = torch.cat([ref.support[0], ref.query[0]])
        expected = augment(x, torch.Generator().manual_seed(seed))
        assert torch.equal(torch.cat([task.support[0], task.query[0]]), expected)
        assert task.support[0].shape == ref.support[0].shape
        assert torch.equal(task.support[1], ref.support[1])
        assert torch.equal(task.query[1], ref.query[1])
    changed = [not torch.equal(t.query[0], r.query[0]) for t, r in zip(out, tasks)]
    assert any(changed)
    # Evaluation paths (indices, then tasks_from_indices) never augment.
    evaluation = augmented.tasks_from_indices(classes, examples)
    assert torch.equal(
        evaluation[0].query[0], plain.tasks_from_indices(classes, examples)[0].query[0]
    )
