"""Few-shot classification of token sequences, each class a random Markov chain.

A task draws ``ways`` classes afresh: class ``c`` is a first-order Markov chain over a
vocabulary of ``V`` tokens, its transition matrix ``P_c = softmax(s * G_c)`` row by row
(``G_c`` standard normal ``[V, V]``, ``s`` the ``sharpness``: 0 makes every class the
uniform chain, larger values make each class's transitions more distinct). A sequence of
class ``c`` starts at a uniform token and takes ``length - 1`` steps of ``P_c``. The support
set holds ``shots`` sequences per class, the query ``queries``; labels are ``0 .. ways-1``.

Every class is new (an unbounded pool), so meta-training and meta-testing differ only in the
generator's seed: a learner must learn to read transition statistics from a few sequences,
not to remember classes. Everything is drawn from the caller's ``torch.Generator``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from metalearn.data.sampler import check_generator
from metalearn.task import Task

__all__ = ["MarkovSequenceTasks"]


@dataclass(frozen=True)
class MarkovSequenceTasks:
    """A distribution over N-way K-shot tasks of Markov-chain token sequences.

    Attributes:
        ways: classes per task ``N``.
        shots: support sequences per class ``K``.
        queries: query sequences per class.
        vocab: tokens ``V`` (the inputs are ``long`` indices in ``[0, V)``).
        length: tokens per sequence ``L``.
        sharpness: ``s``, the scale of the transition logits (see the module's docstring).
    """

    ways: int = 5
    shots: int = 1
    queries: int = 5
    vocab: int = 8
    length: int = 16
    sharpness: float = 2.0

    def __post_init__(self) -> None:
        for name in ("ways", "shots", "queries", "length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be at least 1")
        if self.vocab < 2:
            raise ValueError(f"vocab={self.vocab}: a Markov chain needs at least 2 tokens")
        if not self.sharpness >= 0:  # also refuses NaN
            raise ValueError(f"sharpness={self.sharpness}: must be a finite number >= 0")

    def chains(self, generator: torch.Generator) -> Tensor:
        """The ``ways`` classes' transition matrices, ``[N, V, V]`` (rows sum to 1)."""
        check_generator(generator)
        shape = (self.ways, self.vocab, self.vocab)
        logits = torch.randn(shape, generator=generator, dtype=torch.float64)
        return torch.softmax(self.sharpness * logits, dim=-1)

    def sequences(self, chains: Tensor, labels: Tensor, generator: torch.Generator) -> Tensor:
        """One sequence per label, ``[M, L]`` long, sequence ``i`` drawn from ``chains[labels[i]]``.

        Args:
            chains: transition matrices ``[N, V, V]``.
            labels: class of each sequence ``[M]``.
            generator: the source of randomness.
        """
        tokens = torch.randint(self.vocab, (labels.numel(),), generator=generator)
        out = [tokens]
        for _ in range(self.length - 1):
            tokens = torch.multinomial(chains[labels, tokens], 1, generator=generator)[:, 0]
            out.append(tokens)
        return torch.stack(out, dim=1)

    def sample(self, generator: torch.Generator) -> Task:
        """One task: support ``x [N K, L]`` long, ``y [N K]``; query ``[N Q, L]``, ``[N Q]``."""
        chains = self.chains(generator)
        sets = []
        for per_class in (self.shots, self.queries):
            y = torch.arange(self.ways).repeat_interleave(per_class)
            sets.append((self.sequences(chains, y, generator), y))
        return Task(support=sets[0], query=sets[1])

    def batch(self, tasks: int, generator: torch.Generator) -> list[Task]:
        """``tasks`` tasks, the same as that many `sample` calls with this generator."""
        if tasks < 1:
            raise ValueError(f"tasks must be >= 1, got {tasks}")
        return [self.sample(generator) for _ in range(tasks)]
