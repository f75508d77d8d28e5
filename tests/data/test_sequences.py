"""`metalearn.data.sequences.MarkovSequenceTasks`: seeded tasks of the promised shapes whose
sequences follow their class's chain."""

from __future__ import annotations

import pytest
import torch

from metalearn.data.sequences import MarkovSequenceTasks


def test_tasks_are_seeded_and_shaped():
    data = MarkovSequenceTasks(ways=4, shots=2, queries=3, vocab=6, length=9)
    a = data.batch(2, torch.Generator().manual_seed(0))
    b = data.batch(2, torch.Generator().manual_seed(0))
    c = data.batch(2, torch.Generator().manual_seed(1))
    assert all(torch.equal(x.support[0], y.support[0]) for x, y in zip(a, b))
    assert not torch.equal(a[0].support[0], c[0].support[0])
    task = a[0]
    assert task.support[0].shape == (8, 9) and task.query[0].shape == (12, 9)
    assert task.support[0].dtype == torch.long and int(task.support[0].max()) < 6
    assert task.support[1].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


def test_sequences_follow_their_chain():
    """Empirical transition frequencies of many sequences approach the class's matrix."""
    data = MarkovSequenceTasks(ways=2, vocab=4, length=200)
    gen = torch.Generator().manual_seed(0)
    chains = data.chains(gen)
    labels = torch.tensor([1] * 50)
    seq = data.sequences(chains, labels, gen)
    counts = torch.zeros(4, 4, dtype=torch.float64)
    ones = torch.ones(seq[:, 1:].numel(), dtype=torch.float64)
    counts.index_put_((seq[:, :-1].reshape(-1), seq[:, 1:].reshape(-1)), ones, accumulate=True)
    frequencies = counts / counts.sum(1, keepdim=True)
    assert (frequencies - chains[1]).abs().max() < 0.05
    assert (frequencies - chains[0]).abs().max() > 0.1  # the other class's chain differs


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [("ways", 0, "ways=0"), ("vocab", 1, "at least 2 tokens"), ("sharpness", -1.0, "sharpness")],
)
def test_bad_settings_are_refused(field, value, match):
    with pytest.raises(ValueError, match=match):
        MarkovSequenceTasks(**{field: value})
