"""Lake et al.'s within-alphabet one-shot protocol: tasks from one alphabet, two drawers.

Lake, Salakhutdinov and Tenenbaum (Science, 2015) test N-way (20-way) one-shot
classification on Omniglot's evaluation alphabets: each task's classes are characters of
**one** alphabet, and the support and test images are drawn by **different people**.
Both make the task harder than MAML's episodic Omniglot tasks, whose classes come from
any alphabets (characters of one alphabet look alike) and whose support and query
drawings may come from the same person.

`WithinAlphabetSampler` draws such tasks. A task draws, in this order:

1. an alphabet, uniformly among those with at least N characters;
2. N distinct characters of it, in random order (label ``j`` is the ``j``-th);
3. ``K + Q`` distinct drawers, shared by all N classes: the first ``K`` drew the support
   images, the other ``Q`` the queries. Support and query drawers never overlap, and the
   support set of a task is, as in Lake's runs, the work of the same ``K`` people.

Omniglot names every drawing ``<character id>_<drawer>.png`` with drawers ``01..20``
(`OmniglotImages.drawers`), so drawing ``m`` of every character is drawer ``m + 1``;
`within_alphabet_samplers` checks that before it builds a sampler. Tasks are built by
`EpisodicSampler.tasks_from_indices`, so augmentation, dtypes and devices behave exactly
as in the episodic sampler, and `metalearn.runs.evaluation.evaluate_tasks` takes either.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from metalearn.data.omniglot import OmniglotImages, omniglot_splits
from metalearn.data.sampler import Augmentation, EpisodicSampler, _distinct, check_generator

__all__ = ["PROTOCOLS", "WithinAlphabetSampler", "within_alphabet_samplers"]

PROTOCOLS = ("episodic", "within-alphabet")
"""How Omniglot tasks are drawn: MAML's episodic tasks, or Lake et al.'s (this module)."""


class WithinAlphabetSampler(EpisodicSampler):
    """N-way K-shot tasks whose classes share an alphabet and whose drawers are disjoint.

    Args:
        images: ``[C, M, ch, H, W]``: the ``M`` drawings of each of ``C`` characters, drawing
            ``m`` by the same drawer for every character (uint8 or floating, as in
            `EpisodicSampler`).
        alphabets: the alphabet of each character, ``C`` names.
        ways, shots, queries: N, K, Q (``K + Q <= M``: the drawers of a task are distinct).
        dtype, augment: as in `EpisodicSampler`.

    Raises:
        ValueError: no alphabet has ``ways`` characters, ``shots + queries`` above ``M``,
            or ``alphabets`` of the wrong length; each message names the numbers.
    """

    def __init__(
        self,
        images: Tensor,
        alphabets: Sequence[str],
        *,
        ways: int,
        shots: int,
        queries: int,
        dtype: torch.dtype | None = None,
        augment: Augmentation | None = None,
    ) -> None:
        super().__init__(images, ways=ways, shots=shots, queries=queries, dtype=dtype,
                         augment=augment)  # fmt: skip
        if len(alphabets) != images.shape[0]:
            raise ValueError(
                f"{len(alphabets)} alphabet names for {images.shape[0]} characters; "
                "pass one alphabet per character"
            )
        names = sorted(set(alphabets))
        members = [[c for c, a in enumerate(alphabets) if a == name] for name in names]
        self.alphabets = tuple(n for n, m in zip(names, members) if len(m) >= ways)
        if not self.alphabets:
            largest = max(len(m) for m in members)
            raise ValueError(
                f"ways={ways}, but the largest alphabet here has {largest} characters; "
                f"within-alphabet tasks need an alphabet of at least {ways}: lower --ways"
            )
        kept = [m for m in members if len(m) >= ways]
        width = max(len(m) for m in kept)
        # [A, P]: alphabet a's characters, padded with -1 (never drawn: see sample_indices).
        self._pool = torch.full((len(kept), width), -1, dtype=torch.long)
        for a, m in enumerate(kept):
            self._pool[a, : len(m)] = torch.tensor(m)

    def sample_indices(self, generator: torch.Generator, tasks: int = 1) -> tuple[Tensor, Tensor]:
        """Draw the alphabets, classes and drawers of ``tasks`` tasks at once.

        Returns:
            ``classes`` long ``[T, N]`` (distinct characters of one alphabet per task) and
            ``examples`` long ``[T, N, K + Q]`` (the task's drawers, the same for each of
            its classes; the first ``K`` drew the support set).
        """
        check_generator(generator)
        if tasks < 1:
            raise ValueError(f"tasks must be >= 1, got {tasks}")
        draw = dict(generator=generator, device=generator.device)
        pool = self._pool.to(generator.device)
        alphabet = torch.randint(len(pool), (tasks,), **draw)
        rows = pool[alphabet]  # [T, P]
        # N distinct characters: the top N of uniform keys, padding keyed below any draw.
        keys = torch.rand(tasks, pool.shape[1], dtype=torch.float64, **draw)
        keys = keys.masked_fill(rows < 0, -1.0)
        classes = rows.gather(1, keys.topk(self.ways, dim=1).indices)
        drawers = _distinct(generator, (tasks,), self.shots + self.queries, self.examples)
        return classes, drawers[:, None, :].expand(tasks, self.ways, -1).contiguous()

    def __repr__(self) -> str:
        return (
            f"WithinAlphabetSampler({self.ways}-way {self.shots}-shot, {self.queries} queries, "
            f"{len(self.alphabets)} alphabets of >= {self.ways} characters, "
            f"{self.num_classes} characters, augment={self.augment})"
        )


def within_alphabet_samplers(
    data: OmniglotImages,
    split: str = "alphabet",
    *,
    ways: int,
    shots: int,
    queries: int,
    seed: int = 1,
    augment: Augmentation | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    trainval: bool = False,
) -> dict[str, WithinAlphabetSampler]:
    """One `WithinAlphabetSampler` per non-empty set of Omniglot's alphabet split.

    Train on the background alphabets (less the validation ones), validate on the
    held-out background alphabets, test on the evaluation alphabets, as
    `metalearn.data.omniglot_splits` splits them (``seed`` picks the validation alphabets).

    Args:
        data: from `metalearn.data.load_omniglot`.
        split: must be ``"alphabet"``: MAML's split mixes alphabets and rotations.
        ways, shots, queries: N, K, Q of every task.
        augment: for the ``"train"`` sampler only (e.g. `SmallAffine`).
        dtype, device: of the task images.
        trainval: train on the training and validation alphabets together, no ``"val"``
            sampler (`metalearn.data.omniglot_splits`).

    Raises:
        ValueError: another split, drawings not named by drawer, or a bad N, K, Q.
    """
    if split != "alphabet":
        raise ValueError(
            f"the within-alphabet protocol needs --split alphabet (got {split!r}): MAML's "
            "split mixes alphabets and makes classes by rotation"
        )
    check_drawers(data)
    samplers = {}
    for name, index in omniglot_splits(data, split, seed=seed, trainval=trainval).items():
        if len(index):
            samplers[name] = WithinAlphabetSampler(
                data.images[index].unsqueeze(2).to(device),
                [data.alphabets[i] for i in index.tolist()],
                ways=ways, shots=shots, queries=queries, dtype=dtype,
                augment=augment if name == "train" else None,
            )  # fmt: skip
    return samplers


def check_drawers(data: OmniglotImages) -> None:
    """Raise unless drawing ``m`` of every character is drawer ``m + 1`` (file names)."""
    drawers = data.drawers
    expected = torch.arange(1, data.images.shape[1] + 1)
    if drawers is None or not bool((drawers == expected).all()):
        raise ValueError(
            "the within-alphabet protocol needs each character's drawings named "
            "<id>_01.png .. <id>_20.png (one per drawer, as in the official zips); these "
            "are not: re-extract the official Omniglot zips"
        )
