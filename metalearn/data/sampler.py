"""Episodic N-way K-shot sampling from images resident in memory.

A task draws ``ways`` distinct classes, then ``shots + queries`` distinct drawings of each
without replacement, so support and query never share a drawing (Vinyals et al., 2016;
Finn et al., 2017). Class labels 0..N-1 follow the random order of the drawn classes.

Rotations by multiples of 90 degrees make new classes (Santoro et al., 2016; Finn et al.,
2017): with ``rotations=(0, 1, 2, 3)`` a split of ``C`` characters has ``4 C`` classes,
class ``c * 4 + r`` being character ``c`` turned ``r`` quarter turns. Two rotations of one
character may therefore meet in one task. (MAML's TensorFlow code instead draws distinct
characters and then a random rotation for each, so they never do; the class pool is the
same.)

All randomness comes from the ``torch.Generator`` passed in: the same seed gives the same
tasks. The rotated copies are made once, so a meta-batch of ``T`` tasks costs a few
batched draws and one row gather in all; uint8 images (Omniglot's cache) are kept
as they are and scaled to [0, 1] after the gather, at a quarter of the memory and traffic
of resident floats (``scripts/bench_sampler.py`` measures it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from metalearn.task import Task

__all__ = ["EpisodicSampler", "check_generator"]


def check_generator(generator: object) -> torch.Generator:
    """Return ``generator`` if it is a ``torch.Generator``, else raise a ValueError."""
    if not isinstance(generator, torch.Generator):
        raise ValueError(
            f"expected a torch.Generator, got {type(generator).__name__}; pass e.g. "
            "torch.Generator().manual_seed(0) so that sampling is reproducible"
        )
    return generator


class EpisodicSampler:
    """N-way K-shot tasks with Q queries per class, as `metalearn.outer.Task` objects.

    Args:
        images: ``[C, M, ch, H, W]``: ``M`` examples of each of ``C`` base classes, uint8
            (divided by 255 after sampling, e.g. ``OmniglotImages.images[i].unsqueeze(2)``)
            or floating (used as given). Kept on its device; tasks come out there.
        ways: classes per task ``N``.
        shots: support examples per class ``K``.
        queries: query examples per class ``Q``.
        rotations: quarter turns that make new classes, e.g. ``(0, 1, 2, 3)``; ``(0,)``
            for none. Needs square images; the rotated copies are stored (R x memory).
        dtype: of the task images (None: ``images.dtype`` if floating, else float32).

    Raises:
        ValueError: ``ways`` above the number of classes, ``shots + queries`` above the
            examples per class, bad rotations or shapes; each message names the numbers.
    """

    def __init__(
        self,
        images: Tensor,
        *,
        ways: int,
        shots: int,
        queries: int,
        rotations: Sequence[int] = (0,),
        dtype: torch.dtype | None = None,
    ) -> None:
        rotations = tuple(int(r) for r in rotations)
        _check_arguments(images, ways, shots, queries, rotations)
        self.ways, self.shots, self.queries, self.rotations = ways, shots, queries, rotations
        self.examples = images.shape[1]
        self.image_shape = tuple(images.shape[2:])
        if dtype is None:
            dtype = images.dtype if images.is_floating_point() else torch.float32
        self.dtype = dtype
        self._divisor = None if images.is_floating_point() else torch.iinfo(images.dtype).max
        # [C, R, M, ch, H, W] -> rows: class c * R + r, example m is row (c * R + r) * M + m.
        turned = [torch.rot90(images, r, dims=(-2, -1)) for r in rotations]
        bank = torch.stack(turned, dim=1) if len(turned) > 1 else turned[0]
        self._rows = bank.reshape(-1, *self.image_shape)

    @property
    def num_classes(self) -> int:
        """Base classes times rotations."""
        return self._rows.shape[0] // self.examples

    def sample_indices(self, generator: torch.Generator, tasks: int = 1) -> tuple[Tensor, Tensor]:
        """Draw the classes and examples of ``tasks`` tasks at once.

        Returns:
            ``classes`` long ``[T, N]`` (distinct within a task, in ``[0, num_classes)``;
            class ``c`` is base class ``c // R`` turned ``rotations[c % R]``; label ``j`` is
            ``classes[:, j]``) and ``examples`` long ``[T, N, K + Q]`` (distinct within a
            class; the first ``K`` are the support set).
        """
        check_generator(generator)
        if tasks < 1:
            raise ValueError(f"tasks must be >= 1, got {tasks}")
        classes = _distinct(generator, (tasks,), self.ways, self.num_classes)
        examples = _distinct(
            generator, (tasks, self.ways), self.shots + self.queries, self.examples
        )
        return classes, examples

    def tasks_from_indices(self, classes: Tensor, examples: Tensor) -> list[Task]:
        """Build the tasks of `sample_indices`' output (class-major within each set).

        The tasks' images are slices of one batch tensor and their label tensors are shared:
        treat tasks as read-only (nothing in the engine writes to them).
        """
        device = self._rows.device
        rows = classes.to(device)[..., None] * self.examples + examples.to(device)  # [T, N, K+Q]
        tasks, ways, _ = rows.shape
        k = self.shots
        # Support rows of every task, then query rows: both sets are then views, no copies.
        order = torch.cat([rows[..., :k].flatten(1), rows[..., k:].flatten(1)], dim=1)
        x = self._rows.index_select(0, order.flatten()).to(self.dtype)
        if self._divisor is not None:
            x = x.div_(self._divisor)
        x = x.view(tasks, -1, *self.image_shape)
        labels = torch.arange(ways, device=device).repeat_interleave(self.shots + self.queries)
        labels = labels.view(ways, -1)
        support_y, query_y = labels[:, :k].flatten(), labels[:, k:].flatten()
        return [
            Task(support=(x[t, : ways * k], support_y), query=(x[t, ways * k :], query_y))
            for t in range(tasks)
        ]

    def batch(self, tasks: int, generator: torch.Generator) -> list[Task]:
        """``tasks`` tasks: support ``([N*K, ch, H, W], [N*K])``, query ``([N*Q, ...], [N*Q])``."""
        return self.tasks_from_indices(*self.sample_indices(generator, tasks))

    def sample(self, generator: torch.Generator) -> Task:
        """One task (``batch(1, generator)[0]``)."""
        return self.batch(1, generator)[0]

    def __repr__(self) -> str:
        return (
            f"EpisodicSampler({self.ways}-way {self.shots}-shot, {self.queries} queries, "
            f"{self.num_classes} classes, rotations={self.rotations})"
        )


def _distinct(generator: torch.Generator, batch: tuple[int, ...], n: int, high: int) -> Tensor:
    """``[*batch, n]`` draws from ``range(high)``, distinct along the last dimension.

    Each row is uniform over ordered n-tuples of distinct values (a random subset in random
    order). When ``n * n <= high`` a row of i.i.d. draws repeats a value with probability
    below 1/2, so rows are drawn i.i.d. and redrawn until distinct (rejection sampling:
    exact, and cheap when ``n`` is far below ``high``, as 5 of 4400 classes). Otherwise
    the top ``n`` of ``high`` i.i.d. uniform keys (float64, so ties are practically
    impossible) are taken.
    """
    draw = dict(generator=generator, device=generator.device)
    if n * n > high:
        keys = torch.rand(*batch, high, dtype=torch.float64, **draw)
        return keys.topk(n, dim=-1).indices
    rows = torch.randint(high, (*batch, n), **draw)
    while (repeats := _repeats(rows)).any():
        rows[repeats] = torch.randint(high, (int(repeats.sum()), n), **draw)
    return rows


def _repeats(rows: Tensor) -> Tensor:
    """Bool ``[*batch]``: does the row hold a value twice?"""
    ordered = rows.sort(dim=-1).values
    return (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1)


def _check_arguments(
    images: Tensor, ways: int, shots: int, queries: int, rotations: tuple[int, ...]
) -> None:
    if images.dim() != 5:
        raise ValueError(
            f"images must be [classes, examples, channels, H, W], got shape "
            f"{tuple(images.shape)}; for [C, M, H, W] use images.unsqueeze(2)"
        )
    if not rotations or len(set(rotations)) != len(rotations) or not set(rotations) <= {0, 1, 2, 3}:
        raise ValueError(f"rotations={rotations}: give distinct quarter turns from 0, 1, 2, 3")
    height, width = images.shape[-2:]
    if rotations != (0,) and height != width:
        raise ValueError(f"rotations need square images, got {height}x{width}; use rotations=(0,)")
    for name, value in (("ways", ways), ("shots", shots), ("queries", queries)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    num_classes = images.shape[0] * len(rotations)
    if ways > num_classes:
        raise ValueError(
            f"ways={ways} but only {num_classes} classes are available ({images.shape[0]} "
            f"characters x {len(rotations)} rotations); lower ways or add rotations"
        )
    if shots + queries > images.shape[1]:
        raise ValueError(
            f"shots + queries = {shots} + {queries} = {shots + queries} but each class has "
            f"only {images.shape[1]} examples; lower shots or queries"
        )
