"""Reptile's inner mini-batches, written out for the tests that check them."""

from __future__ import annotations

import torch


def mini_batches(
    n: int, batch: int, count: int, gen: torch.Generator | None = None
) -> list[list[int]]:
    """``openai/supervised-reptile``'s ``_mini_batches`` without replacement: shuffle the
    ``n`` examples, deal them out one by one into batches of ``batch`` (a batch may take the
    end of one shuffle and the start of the next), reshuffle when a shuffle runs out, stop
    after ``count`` batches. A shuffle is ``torch.randperm`` on ``gen`` (torch's global
    generator when None)."""
    batches, current = [], []
    while True:
        for i in torch.randperm(n, generator=gen).tolist():
            current.append(i)
            if len(current) < batch:
                continue
            batches.append(current)
            current = []
            if len(batches) == count:
                return batches
