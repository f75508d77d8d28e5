"""What each data set can give a task, known before it loads: its published classes per
split and examples per class, and the one check of a run's ways, shots and queries.

A task of N ways, K shots and Q queries draws N distinct classes of one split and K + Q
distinct examples of each. The published counts say which tasks a data set can give, so
`check_task_sizes` refuses an impossible one before minutes of decoding, in one line naming
the flag and the limit (the samplers check again, on the data found, after loading).

Omniglot (Lake et al., 2015): 1623 characters (964 in the 30 background alphabets, 659 in
the 20 evaluation ones), 20 drawings each, so 20 examples per class. Its classes depend on
the split `metalearn.data.omniglot_splits` makes (with its default seed and sizes, as the
experiments use it):

* ``"maml"``: 1100 / 100 / 423 characters, each turned by 0, 1, 2 and 3 quarter turns
  (four classes per character): 4400 / 400 / 1692 classes;
* ``"alphabet"``: the background alphabets less five held out to validate (797
  characters), those five (167), the evaluation alphabets (659), no rotations;
* a within-alphabet task (``--train-tasks``/``--eval-protocol within-alphabet``) draws its
  N characters from one alphabet: N is at most the split's largest alphabet (55 Tifinagh
  characters to train, 46 Bengali to validate, 47 Malayalam to test).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from metalearn.data.cifar import CIFAR_FS_CLASSES, FC100_SUPERCLASSES
from metalearn.data.cub import CUB_CLASSES
from metalearn.data.image_set import IMAGE_SPLITS, check_split
from metalearn.data.mini_imagenet import MINI_IMAGENET_CLASSES, MINI_IMAGENET_IMAGES_PER_CLASS
from metalearn.data.tiered_imagenet import TIERED_IMAGENET_CLASSES

__all__ = ["PUBLISHED_SIZES", "PublishedSizes", "check_task_sizes", "published_sizes"]

OMNIGLOT_DRAWINGS = 20
OMNIGLOT_CHARACTERS = {"maml": (1100, 100, 423), "alphabet": (797, 167, 659)}
OMNIGLOT_LARGEST_ALPHABET = (55, 46, 47)  # train, val, test alphabets of the alphabet split


@dataclass(frozen=True)
class PublishedSizes:
    """A data set's published sizes, as one split gives them to tasks.

    Attributes:
        name: the data set as messages name it (``"Omniglot"``, ``"mini-ImageNet"``).
        classes: classes a task can draw from, per split (rotations counted as classes).
        examples: examples per class; where classes differ in size (``uneven``), the
            largest class's (a task needing more can never be drawn; the samplers check
            the smallest after loading).
        uneven: classes hold different numbers of examples.
        note: how ``classes`` come about, per split, in messages (e.g. ``" (423 characters
            x 4 rotations)"``).
    """

    name: str
    classes: Mapping[str, int]
    examples: int
    uneven: bool = False
    note: Mapping[str, str] | None = None


def _equal(name: str, classes: Mapping[str, int], examples: int = 600) -> PublishedSizes:
    return PublishedSizes(name, dict(classes), examples)


PUBLISHED_SIZES: Mapping[str, PublishedSizes | None] = {
    "mini-imagenet": _equal("mini-ImageNet", MINI_IMAGENET_CLASSES,
                            MINI_IMAGENET_IMAGES_PER_CLASS),
    # ImageNet's training images, 732 to 1300 per class.
    "tiered-imagenet": PublishedSizes("tiered-ImageNet", TIERED_IMAGENET_CLASSES, 1300,
                                      uneven=True),
    "cifar-fs": _equal("CIFAR-FS", {s: len(c) for s, c in CIFAR_FS_CLASSES.items()}),
    "fc100": _equal("FC100", {s: 5 * len(c) for s, c in FC100_SUPERCLASSES.items()}),
    # CUB-200-2011: 11,788 photos of 200 species, at most 60 each.
    "cub": PublishedSizes("CUB", CUB_CLASSES, 60, uneven=True),
    "folder": None,  # a user's folder: nothing is published
    "omniglot": None,  # depends on the split and protocol: `published_sizes`
}  # fmt: skip
"""Each data set of `metalearn.data.IMAGE_SET_NAMES` by name (None: see `published_sizes`)."""


def published_sizes(
    dataset: str, split: str = "maml", *, within_alphabet: bool = False
) -> PublishedSizes | None:
    """The sizes tasks of ``dataset`` see (None for a folder: nothing is published).

    Args:
        dataset: one of `metalearn.data.IMAGE_SET_NAMES`.
        split: Omniglot's class split, ``"maml"`` or ``"alphabet"`` (ignored otherwise).
        within_alphabet: Omniglot's tasks are drawn within one alphabet: the classes are
            each split's largest alphabet's characters.

    Raises:
        ValueError: an unknown data set or Omniglot split, or ``within_alphabet`` on
            another split than ``"alphabet"``.
    """
    if dataset not in PUBLISHED_SIZES:
        raise ValueError(f"dataset {dataset!r}; choose one of {', '.join(PUBLISHED_SIZES)}")
    if dataset != "omniglot":
        return PUBLISHED_SIZES[dataset]
    if split not in OMNIGLOT_CHARACTERS:
        raise ValueError(f"split {split!r}; choose one of {', '.join(OMNIGLOT_CHARACTERS)}")
    if within_alphabet and split != "alphabet":
        raise ValueError(
            f"the within-alphabet protocol needs --split alphabet (got {split!r}): MAML's "
            "split mixes alphabets and makes classes by rotation"
        )
    if within_alphabet:
        classes = dict(zip(IMAGE_SPLITS, OMNIGLOT_LARGEST_ALPHABET))
        note = {s: " in its largest alphabet (tasks within one alphabet)" for s in classes}
    elif split == "maml":
        classes = {s: 4 * c for s, c in zip(IMAGE_SPLITS, OMNIGLOT_CHARACTERS[split])}
        note = {s: f" ({c // 4} characters x 4 rotations)" for s, c in classes.items()}
    else:
        classes = dict(zip(IMAGE_SPLITS, OMNIGLOT_CHARACTERS[split]))
        note = {s: " (characters of the alphabet split)" for s in classes}
    return PublishedSizes("Omniglot", classes, OMNIGLOT_DRAWINGS, note=note)


def check_task_sizes(
    dataset: str,
    *,
    ways: int,
    shots: int,
    query: int,
    eval_query: int | None = None,
    train_ways: int | None = None,
    train_shots: int | None = None,
    split: str = "maml",
    train_tasks: str = "episodic",
    eval_protocol: str = "episodic",
    splits: Sequence[str] = IMAGE_SPLITS,
) -> None:
    """Refuse tasks the data set cannot give, before it loads, naming the flag and the limit.

    The training split's tasks have ``train_ways`` classes and ``train_shots + query``
    examples of each; the validation and test splits' ``ways`` and ``shots + eval_query``, as
    `metalearn.data.image_set_samplers` and the Omniglot experiment draw them.

    Args:
        dataset: one of `metalearn.data.IMAGE_SET_NAMES` (``"folder"``: nothing is checked).
        ways, shots, query: ``--ways``, ``--shots``, ``--query``.
        eval_query: ``--eval-query`` (None: ``query``).
        train_ways: ``--train-ways`` (None: ``ways``).
        train_shots: ``--train-shots`` (None: ``shots``).
        split: Omniglot's ``--split`` (``"maml"`` or ``"alphabet"``).
        train_tasks, eval_protocol: Omniglot's ``--train-tasks`` and ``--eval-protocol``
            (``"episodic"`` or ``"within-alphabet"``).
        splits: the splits that will be drawn from (an evaluation of the test split alone
            checks only it).

    Raises:
        ValueError: one line, e.g. ``"--shots 19 with --query 5 needs 24 examples per
            class; Omniglot has 20"``; or an unknown data set or split.
    """
    wide = train_ways is not None and train_ways != ways
    more = train_shots is not None and train_shots != shots
    for name in map(check_split, splits):
        training = name == "train"
        within = (train_tasks if training else eval_protocol) == "within-alphabet"
        sizes = published_sizes(dataset, split, within_alphabet=within)
        if sizes is None:
            return
        n, flag = (train_ways, "--train-ways") if training and wide else (ways, "--ways")
        q, query_flag = (query, "--query") if training or eval_query is None else (
            eval_query, "--eval-query")  # fmt: skip
        k, shots_flag = (train_shots, "--train-shots") if training and more else (shots, "--shots")
        if n > sizes.classes[name]:
            note = sizes.note[name] if sizes.note else ""
            raise ValueError(
                f"{flag} {n}: {sizes.name}'s {name} split has {sizes.classes[name]} classes"
                f"{note}; lower {flag}"
            )
        if k + q > sizes.examples:
            most = "at most " if sizes.uneven else ""
            raise ValueError(
                f"{shots_flag} {k} with {query_flag} {q} needs {k + q} examples per class; "
                f"{sizes.name} has {most}{sizes.examples}"
            )
