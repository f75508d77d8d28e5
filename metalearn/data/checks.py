"""What a loader checks of a published file's arrays before it uses them.

The published formats say what their arrays are: uint8 images of one size, integer labels
(or row indices) one per image, every class with images. A file that says otherwise is not
the published file, and using it as it is gives a wrong set silently: a float image cast to
uint8 wraps (300.7 becomes 44), a negative row wraps around to the end, a row listed under
two classes puts one image in both. Each check here refuses such a file in one line naming
the file, what it holds and what the format holds; nothing is cast or clipped.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["class_rows", "image_array", "integer_labels"]

_FIX = "the file is not the published one: re-download it (docs/datasets.md)"


def image_array(path: str | os.PathLike, data: Any, side: int, what: str) -> np.ndarray:
    """``data`` if it is uint8 ``[N, side, side, 3]`` with ``N >= 1``, else a ValueError.

    Args:
        path: the file, for the message.
        data: the array the file holds.
        side: the published image side (84, 32).
        what: the array's name in the file (``"image_data"``, ``"data"``).
    """
    shape = getattr(data, "shape", None)
    if (
        not isinstance(data, np.ndarray)
        or data.dtype != np.uint8
        or data.ndim != 4
        or data.shape[1:] != (side, side, 3)
        or len(data) == 0
    ):
        got = f"{data.dtype} {list(shape)}" if isinstance(data, np.ndarray) else type(data).__name__
        raise ValueError(f"{path}: {what} must be uint8 [N, {side}, {side}, 3], got {got}; {_FIX}")
    return data


def integer_labels(
    path: str | os.PathLike, labels: Any, what: str, count: int | None = None
) -> np.ndarray:
    """``labels`` as int64 ``[N]`` if they are non-negative integers (``count`` of them).

    A list of ints or an integer array passes; floats, booleans, strings or nested lists
    are refused rather than cast.
    """
    try:
        array = np.asarray(labels) if isinstance(labels, list | tuple | np.ndarray) else None
    except ValueError:  # ragged nested lists
        array = None
    if array is None or array.ndim != 1 or (len(array) and array.dtype.kind not in "iu"):
        got = f"{array.dtype} {list(array.shape)}" if array is not None else type(labels).__name__
        raise ValueError(f"{path}: {what} must be a list of integers, got {got}; {_FIX}")
    if count is not None and len(array) != count:
        raise ValueError(f"{path}: {what} holds {len(array)} labels for {count} images; {_FIX}")
    if len(array) and int(array.min()) < 0:
        raise ValueError(f"{path}: {what} holds {int(array.min())}, which is negative; {_FIX}")
    return array.astype(np.int64)


def class_rows(
    path: str | os.PathLike, class_dict: Any, images: int
) -> tuple[list[str], list[np.ndarray]]:
    """The classes of a ``class_dict`` (name -> rows of the image array), sorted by name.

    Every class must hold at least one row, every row must be an integer in
    ``range(images)``, and no row may appear twice (in one class or two).

    Returns:
        The names, sorted, and each class's rows (int64) in the file's order.
    """
    if not isinstance(class_dict, Mapping) or not class_dict:
        raise ValueError(
            f"{path}: class_dict must be a non-empty dict of class name -> rows, got "
            f"{type(class_dict).__name__}; {_FIX}"
        )
    if odd := [n for n in class_dict if not isinstance(n, str)]:
        raise ValueError(f"{path}: class_dict has the non-string class name {odd[0]!r}; {_FIX}")
    names = sorted(class_dict)
    rows = [integer_labels(path, class_dict[n], f"class_dict[{n!r}]") for n in names]
    for name, these in zip(names, rows):
        if len(these) == 0:
            raise ValueError(f"{path}: class {name!r} lists no rows; {_FIX}")
        if int(these.max()) >= images:
            raise ValueError(
                f"{path}: class {name!r} lists row {int(these.max())}, but image_data holds "
                f"{images} images (rows 0-{images - 1}); {_FIX}"
            )
    every = np.concatenate(rows)
    found, counts = np.unique(every, return_counts=True)
    if len(found) != len(every):
        row = int(found[counts > 1][0])
        holders = [n for n, these in zip(names, rows) if row in these]
        raise ValueError(
            f"{path}: row {row} is listed more than once (under {', '.join(map(repr, holders))}): "
            f"one image would count for two classes or twice in one; {_FIX}"
        )
    return names, rows
