"""Episodic N-way K-shot sampling from images resident in memory.

A task draws ``ways`` distinct classes, then ``shots + queries`` distinct examples of each
without replacement, so support and query never share an example (Vinyals et al., 2016;
Finn et al., 2017). Class labels 0..N-1 follow the random order of the drawn classes.

Classes may hold equal numbers of examples (``images [C, M, ch, H, W]``, Omniglot) or
uneven ones (``images [N, ch, H, W]`` with ``counts [C]``, the natural-image benchmarks).
Equal counts, in either form, take the equal-size path, whose draws are those of earlier
versions, so a seed means the same Omniglot tasks as before.

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

Augmentation (``augment``, off by default) applies to the tasks `batch` and `sample` make:
each task draws one seed from the generator after its indices, and its images are
augmented with a generator of that seed, so a task's augmentation depends on neither the
other tasks nor how a meta-batch is split. `tasks_from_indices` alone (evaluation,
distributed ranks) never augments unless given the seeds.

Random shots (``min_shots``, off by default) draw each task's support size ``K_t``
uniformly from ``[min_shots, shots]`` after its indices (and seed): the task keeps its
``shots + queries`` examples a class, the first ``K_t`` as support, the rest as queries, as
R2-D2's training episodes (bertinetto/r2d2 fc0c13e, ``fewshots/data/SetupEpisode.py``: a
fixed number of images per episode, the shot drawn from ``range(shot_min, shot_max)``).
Only `batch` and `draw` draw them; `tasks_from_indices` without ``shots`` builds every
task at ``K = shots``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from metalearn.task import Task

__all__ = ["Augmentation", "EpisodicSampler", "check_generator"]

Augmentation = Callable[[Tensor, torch.Generator], Tensor]
"""``augment(x [B, ch, H, W] in [0, 1], generator) -> [B, ch, H, W]`` (`metalearn.data.augment`)."""


def check_generator(generator: object) -> torch.Generator:
    """Return ``generator`` if it is a ``torch.Generator``, else raise a ValueError."""
    if not isinstance(generator, torch.Generator):
        raise ValueError(
            f"expected a torch.Generator, got {type(generator).__name__}; pass e.g. "
            "torch.Generator().manual_seed(0) so that sampling is reproducible"
        )
    return generator


class EpisodicSampler:
    """N-way K-shot tasks with Q queries per class, as `metalearn.task.Task` objects.

    Args:
        images: ``[C, M, ch, H, W]``: ``M`` examples of each of ``C`` base classes; or,
            with ``counts``, ``[N, ch, H, W]``: class ``c``'s ``counts[c]`` examples in a
            row after those of classes ``0..c-1``. uint8 (divided by 255 after sampling,
            e.g. ``OmniglotImages.images[i].unsqueeze(2)`` or ``ImageSet.images``) or
            floating (used as given). Kept on its device; tasks come out there.
        ways: classes per task ``N``.
        shots: support examples per class ``K``.
        queries: query examples per class ``Q``.
        rotations: quarter turns that make new classes, e.g. ``(0, 1, 2, 3)``; ``(0,)``
            for none. Needs square images; the rotated copies are stored (R x memory).
        dtype: of the task images (None: ``images.dtype`` if floating, else float32).
        counts: examples per base class, long ``[C]`` summing to ``N`` (None: ``images``
            is ``[C, M, ...]``).
        augment: applied to each task's images in `batch` and `sample` (None: off; keep
            it off for evaluation samplers).
        class_names: of the base classes, to name a class that is too small in errors.
        min_shots: set: each task `batch` draws has ``K_t`` support examples a class, drawn
            uniformly from ``[min_shots, shots]``, and ``shots + queries - K_t`` queries
            (None: every task ``shots``).

    Raises:
        ValueError: ``ways`` above the number of classes, ``shots + queries`` above a
            class's examples, bad rotations, shapes or counts; each message names the numbers.
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
        counts: Tensor | Sequence[int] | None = None,
        augment: Augmentation | None = None,
        class_names: Sequence[str] | None = None,
        min_shots: int | None = None,
    ) -> None:
        rotations = tuple(int(r) for r in rotations)
        if counts is not None:
            counts = torch.as_tensor(counts, dtype=torch.long).cpu()
            _check_counts(images, counts)
            if len(counts) and bool((counts == counts[0]).all()):  # equal: the [C, M] path
                images, counts = images.reshape(len(counts), -1, *images.shape[1:]), None
        _check_arguments(images, ways, shots, queries, rotations, counts, class_names)
        if min_shots is not None and not 1 <= min_shots <= shots:
            raise ValueError(f"min_shots={min_shots} must be in [1, shots={shots}]; or None")
        self.ways, self.shots, self.queries, self.rotations = ways, shots, queries, rotations
        self.min_shots = min_shots
        self.augment = augment
        if dtype is None:
            dtype = images.dtype if images.is_floating_point() else torch.float32
        self.dtype = dtype
        self._divisor = None if images.is_floating_point() else torch.iinfo(images.dtype).max
        if counts is None:
            self.examples: int | None = images.shape[1]
            self.image_shape = tuple(images.shape[2:])
        else:
            self.examples, self.image_shape = None, tuple(images.shape[1:])
        self._rows, self._starts, self.counts = _bank(images, rotations, counts)

    @property
    def num_classes(self) -> int:
        """Base classes times rotations."""
        return len(self.counts)

    def sample_indices(self, generator: torch.Generator, tasks: int = 1) -> tuple[Tensor, Tensor]:
        """Draw the classes and examples of ``tasks`` tasks at once.

        Returns:
            ``classes`` long ``[T, N]`` (distinct within a task, in ``[0, num_classes)``;
            class ``c`` is base class ``c // R`` turned ``rotations[c % R]``; label ``j`` is
            ``classes[:, j]``) and ``examples`` long ``[T, N, K + Q]`` (distinct within a
            class, each below its class's count; the first ``K`` are the support set).
        """
        check_generator(generator)
        if tasks < 1:
            raise ValueError(f"tasks must be >= 1, got {tasks}")
        classes = _distinct(generator, (tasks,), self.ways, self.num_classes)
        n = self.shots + self.queries
        if self.examples is not None:
            examples = _distinct(generator, (tasks, self.ways), n, self.examples)
        else:
            highs = self.counts.to(classes.device)[classes]
            examples = _distinct_below(generator, highs, n)
        return classes, examples

    def tasks_from_indices(
        self,
        classes: Tensor,
        examples: Tensor,
        augment_seeds: Tensor | None = None,
        shots: Tensor | None = None,
    ) -> list[Task]:
        """Build the tasks of `sample_indices`' output (class-major within each set).

        Args:
            classes, examples: from `sample_indices` (or a slice along the first dimension).
            augment_seeds: long ``[T]``, one per task: augment task ``t``'s images with
                ``torch.Generator().manual_seed(seed[t])`` (ignored when ``augment`` is None;
                None: no augmentation).
            shots: long ``[T]``, task ``t``'s support examples a class ``K_t`` (the first
                ``K_t`` of each class's examples; the rest are its queries); None: ``shots``.

        The tasks' images are slices of one batch tensor and their label tensors are shared:
        treat tasks as read-only (nothing in the engine writes to them).
        """
        device = self._rows.device
        starts = self._starts.to(device)[classes.to(device)]
        rows = starts[..., None] + examples.to(device)  # [T, N, K+Q]
        tasks, ways, n = rows.shape
        k = torch.full((tasks,), self.shots) if shots is None else shots.cpu()
        # Support rows of every task, then query rows, each class-major: both sets are then
        # views, no copies. A row's place sorts by (query?, class, example).
        example = torch.arange(n)
        key = (example >= k[:, None, None]) * (ways * n) + torch.arange(ways)[:, None] * n + example
        order = rows.flatten(1).gather(1, key.flatten(1).argsort(dim=1).to(device))
        ks = k.tolist()
        x = self._rows.index_select(0, order.flatten()).to(self.dtype)
        if self._divisor is not None:
            x = x.div_(self._divisor)
        x = x.view(tasks, -1, *self.image_shape)
        if self.augment is not None and augment_seeds is not None:
            x = torch.stack([self._augmented(x[t], int(s)) for t, s in enumerate(augment_seeds)])
        labels = {k: _labels(ways, n, k, device) for k in set(ks)}  # shared by equal K
        return [
            Task(support=(x[t, : ways * k], labels[k][0]), query=(x[t, ways * k :], labels[k][1]))
            for t, k in enumerate(ks)
        ]

    def batch(self, tasks: int, generator: torch.Generator) -> list[Task]:
        """``tasks`` tasks: support ``([N*K, ch, H, W], [N*K])``, query ``([N*Q, ...], [N*Q])``
        (with ``min_shots``, task ``t``'s ``K_t`` and ``shots + queries - K_t``).

        With ``augment`` set, one seed per task is drawn after the indices (see the module
        docstring), and with ``min_shots`` one support size per task after that; without
        either the generator advances exactly as `sample_indices` moves it.
        """
        return self.tasks_from_indices(*self.draw(generator, tasks))

    def draw(
        self, generator: torch.Generator, tasks: int
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """What `batch` draws, unbuilt: `sample_indices`' output, then (with ``augment``
        set) one augmentation seed per task, long ``[T]``, else None, then (with
        ``min_shots`` set) one support size per task, long ``[T]``, else None. A caller
        that builds only some of the tasks (a rank of a distributed run) slices all four
        alike."""
        classes, examples = self.sample_indices(generator, tasks)
        seeds = shots = None
        if self.augment is not None:
            seeds = torch.randint(2**62, (tasks,), generator=generator, device=generator.device)
        if self.min_shots is not None:
            shots = torch.randint(self.min_shots, self.shots + 1, (tasks,), generator=generator,
                                  device=generator.device)  # fmt: skip
        return classes, examples, seeds, shots

    def sample(self, generator: torch.Generator) -> Task:
        """One task (``batch(1, generator)[0]``)."""
        return self.batch(1, generator)[0]

    def _augmented(self, x: Tensor, seed: int) -> Tensor:
        """One task's images ``[S, ch, H, W]`` through ``augment`` with its own generator."""
        generator = torch.Generator(device=x.device).manual_seed(seed)
        out = self.augment(x, generator)
        if out.shape != x.shape:
            raise ValueError(
                f"augment changed the task's image shape {tuple(x.shape)} to "
                f"{tuple(out.shape)}; an augmentation must keep [B, ch, H, W]"
            )
        return out

    def __repr__(self) -> str:
        sizes = f"{self.examples} examples each" if self.examples else "uneven classes"
        return (
            f"EpisodicSampler({self.ways}-way {self.shots}-shot, {self.queries} queries, "
            f"{self.num_classes} classes of {sizes}, rotations={self.rotations}, "
            f"augment={self.augment})"
        )


def _labels(ways: int, n: int, k: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Support and query labels ``[N*k]``, ``[N*(n-k)]`` of a task of ``n`` examples a
    class, its first ``k`` the support: class-major, as `tasks_from_indices` orders rows."""
    labels = torch.arange(ways, device=device).repeat_interleave(n).view(ways, n)
    return labels[:, :k].flatten(), labels[:, k:].flatten()


def _bank(
    images: Tensor, rotations: tuple[int, ...], counts: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Every example of every (rotated) class as rows, with each class's first row and count.

    Returns:
        ``rows [R * N, ch, H, W]``, ``starts`` long ``[C * R]`` and ``counts`` long
        ``[C * R]``: class ``c * R + r`` (base class ``c`` turned ``rotations[r]``) is rows
        ``starts[k] : starts[k] + counts[k]`` with ``k = c * R + r``.
    """
    # No turn is the images themselves: rot90(x, 0) would copy them (and read a
    # memory-mapped cache in full).
    turned = [images if r == 0 else torch.rot90(images, r, dims=(-2, -1)) for r in rotations]
    if counts is None:  # [C, R, M, ...]: class c * R + r, example m is row (c * R + r) * M + m.
        bank = torch.stack(turned, dim=1) if len(turned) > 1 else turned[0]
        classes, examples = images.shape[0] * len(rotations), images.shape[1]
        starts = torch.arange(classes) * examples
        counts = torch.full((classes,), examples, dtype=torch.long)
        return bank.reshape(-1, *images.shape[2:]), starts, counts
    # [R, N, ...]: class c * R + r starts at row r * N + (rows of classes before c).
    bank = torch.stack(turned) if len(turned) > 1 else turned[0]
    before = torch.cumsum(counts, 0) - counts
    shift = torch.arange(len(rotations)) * images.shape[0]
    starts = (before[:, None] + shift[None, :]).flatten()
    return bank.reshape(-1, *images.shape[1:]), starts, counts.repeat_interleave(len(rotations))


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


def _distinct_below(generator: torch.Generator, highs: Tensor, n: int) -> Tensor:
    """``[*highs.shape, n]``: row ``i`` holds ``n`` distinct draws from ``range(highs[i])``.

    The uneven-class counterpart of `_distinct`, with the same two exact methods: i.i.d.
    rows redrawn until distinct when every ``n * n <= high``, else the top ``n`` of i.i.d.
    keys with the keys past each row's ``high`` pushed below all others.
    """
    draw = dict(generator=generator, device=generator.device)
    highs = highs.to(generator.device)
    if n * n > int(highs.min()):
        keys = torch.rand(*highs.shape, int(highs.max()), dtype=torch.float64, **draw)
        beyond = torch.arange(keys.shape[-1], device=keys.device) >= highs[..., None]
        return keys.masked_fill_(beyond, -1.0).topk(n, dim=-1).indices
    # floor(u * high) with u uniform in [0, 1) in float64: uniform over range(high).
    uniform = lambda shape: torch.rand(*shape, n, dtype=torch.float64, **draw)  # noqa: E731
    rows = (uniform(highs.shape) * highs[..., None]).long()
    while (repeats := _repeats(rows)).any():
        rows[repeats] = (uniform((int(repeats.sum()),)) * highs[repeats][:, None]).long()
    return rows


def _repeats(rows: Tensor) -> Tensor:
    """Bool ``[*batch]``: does the row hold a value twice?"""
    ordered = rows.sort(dim=-1).values
    return (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1)


def _check_counts(images: Tensor, counts: Tensor) -> None:
    if images.dim() != 4:
        raise ValueError(
            f"with counts, images must be [examples, channels, H, W], got shape "
            f"{tuple(images.shape)}; for one channel use images.unsqueeze(1)"
        )
    if counts.dim() != 1 or len(counts) == 0 or int(counts.min()) < 1:
        raise ValueError(f"counts must be a non-empty 1-D list of positive sizes, got {counts}")
    if int(counts.sum()) != images.shape[0]:
        raise ValueError(
            f"counts sum to {int(counts.sum())} but images holds {images.shape[0]} examples; "
            "give one count per class, in the order of the rows"
        )


def _check_arguments(
    images: Tensor,
    ways: int,
    shots: int,
    queries: int,
    rotations: tuple[int, ...],
    counts: Tensor | None,
    class_names: Sequence[str] | None,
) -> None:
    if counts is None and images.dim() != 5:
        raise ValueError(
            f"images must be [classes, examples, channels, H, W], got shape "
            f"{tuple(images.shape)}; for [C, M, H, W] use images.unsqueeze(2), or give counts "
            "for [examples, channels, H, W]"
        )
    if not rotations or len(set(rotations)) != len(rotations) or not set(rotations) <= {0, 1, 2, 3}:
        raise ValueError(f"rotations={rotations}: give distinct quarter turns from 0, 1, 2, 3")
    height, width = images.shape[-2:]
    if rotations != (0,) and height != width:
        raise ValueError(f"rotations need square images, got {height}x{width}; use rotations=(0,)")
    for name, value in (("ways", ways), ("shots", shots), ("queries", queries)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    base = images.shape[0] if counts is None else len(counts)
    num_classes = base * len(rotations)
    if ways > num_classes:
        rotated = f" ({base} classes x {len(rotations)} rotations)" if len(rotations) > 1 else ""
        raise ValueError(
            f"ways={ways} but only {num_classes} classes are available{rotated}; lower ways"
        )
    if counts is None:
        smallest, size = 0, images.shape[1]
    else:
        smallest = int(counts.argmin())
        size = int(counts[smallest])
    if shots + queries > size:
        which = "each class has" if counts is None else f"class {_name(smallest, class_names)} has"
        raise ValueError(
            f"shots + queries = {shots} + {queries} = {shots + queries} but {which} "
            f"only {size} examples; lower shots or queries"
            + ("" if counts is None else ", or leave the smallest classes out")
        )


def _name(index: int, class_names: Sequence[str] | None) -> str:
    return f"{index} ({class_names[index]!r})" if class_names is not None else str(index)
