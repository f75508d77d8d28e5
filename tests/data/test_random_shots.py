"""Random shots (`EpisodicSampler(min_shots=...)`): each task's support size drawn after its
indices, the rest of its examples its queries, checked against the tasks written out by hand
from `sample_indices` and the same generator."""

from __future__ import annotations

import pytest
import torch

from metalearn.data import EpisodicSampler
from metalearn.runs.outer_loop import my_tasks


def _images(classes: int = 7, examples: int = 6) -> torch.Tensor:
    """``[C, M, 1, 2, 2]``: every image distinct (its value names class and example)."""
    values = torch.arange(classes * examples * 4, dtype=torch.float32)
    return values.view(classes, examples, 1, 2, 2)


def _written_out(images: torch.Tensor, seed: int, tasks: int, *, ways: int, n: int, low: int,
                 top: int) -> list:  # fmt: skip
    """The tasks drawn by hand: indices as `sample_indices` draws them, then one support size
    per task from the same generator; support = each class's first K examples, class-major."""
    sampler = EpisodicSampler(images, ways=ways, shots=top, queries=n - top)
    gen = torch.Generator().manual_seed(seed)
    classes, examples = sampler.sample_indices(gen, tasks)
    shots = torch.randint(low, top + 1, (tasks,), generator=gen)
    out = []
    for t in range(tasks):
        k = int(shots[t])
        rows = [[images[c, e] for e in examples[t, j]] for j, c in enumerate(classes[t])]
        support = torch.stack([r for row in rows for r in row[:k]])
        query = torch.stack([r for row in rows for r in row[k:]])
        labels = torch.arange(ways)
        out.append((support, labels.repeat_interleave(k), query, labels.repeat_interleave(n - k)))
    return out


def test_random_shots_equal_the_tasks_written_out():
    images = _images()
    sampler = EpisodicSampler(images, ways=3, shots=4, queries=1, min_shots=1)
    tasks = sampler.batch(12, torch.Generator().manual_seed(3))
    want = _written_out(images, 3, 12, ways=3, n=5, low=1, top=4)
    assert len({len(t.support[1]) for t in tasks}) > 1  # the sizes do vary
    for task, (xs, ys, xq, yq) in zip(tasks, want):
        torch.testing.assert_close(task.support[0], xs, rtol=0, atol=0)
        torch.testing.assert_close(task.query[0], xq, rtol=0, atol=0)
        assert torch.equal(task.support[1], ys) and torch.equal(task.query[1], yq)


def test_without_min_shots_the_draws_are_unchanged():
    images = _images()
    fixed = EpisodicSampler(images, ways=3, shots=2, queries=2)
    random = EpisodicSampler(images, ways=3, shots=2, queries=2, min_shots=2)  # K always 2
    a = fixed.batch(5, torch.Generator().manual_seed(0))
    b = random.batch(5, torch.Generator().manual_seed(0))
    for s, r in zip(a, b):
        assert torch.equal(s.support[0], r.support[0]) and torch.equal(s.query[0], r.query[0])
    gen = torch.Generator().manual_seed(0)
    fixed.batch(5, gen)
    assert fixed.draw(torch.Generator().manual_seed(0), 5)[3] is None
    assert torch.equal(gen.get_state(), _advanced(fixed, 5))


def _advanced(sampler: EpisodicSampler, tasks: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    sampler.sample_indices(gen, tasks)
    return gen.get_state()


def test_a_single_process_share_is_the_whole_batch():
    sampler = EpisodicSampler(_images(), ways=3, shots=4, queries=1, min_shots=1)
    mine = my_tasks(sampler, 6, torch.Generator().manual_seed(1))
    whole = sampler.batch(6, torch.Generator().manual_seed(1))
    for a, b in zip(mine, whole):
        assert torch.equal(a.support[0], b.support[0]) and torch.equal(a.query[1], b.query[1])


@pytest.mark.parametrize("low", [0, 5])
def test_min_shots_outside_one_to_shots_is_refused(low):
    with pytest.raises(ValueError, match=rf"min_shots={low} must be in \[1, shots=4\]"):
        EpisodicSampler(_images(), ways=3, shots=4, queries=1, min_shots=low)
