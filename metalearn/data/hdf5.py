"""torchmeta's HDF5 caches of the benchmarks, read with h5py (the optional ``h5`` extra).

torchmeta converts each benchmark once into HDF5 files beside a JSON list of class names
(see docs/datasets.md for each set's file names): a group of one dataset per class, its
images as uint8 arrays (mini-ImageNet, CIFAR-100) or as PNG bytes (tiered-ImageNet). HDF5
holds data only (no pickled objects), so these files are read as they are, checked
against the published format like every other layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from metalearn.data.checks import image_array
from metalearn.files import FileError, read_json

__all__ = [
    "class_arrays",
    "class_names",
    "encoded_classes",
    "open_hdf5",
    "read_encoded",
    "read_json_list",
]

_FIX = "re-create it with torchmeta or use another layout (docs/datasets.md)"


def open_hdf5(path: Path) -> Any:
    """``h5py.File(path, "r")``, or one line naming what is wrong.

    Raises:
        ImportError: h5py is not installed (the message says how to install it).
        ValueError: the file is not readable HDF5.
    """
    try:
        import h5py
    except ImportError:
        raise ImportError(
            f"reading {path} needs h5py, metalearn's optional HDF5 reader: pip install "
            "metalearn[h5] (or pip install h5py)"
        ) from None
    try:
        return h5py.File(path, "r")
    except OSError as err:
        why = " ".join(str(err).split())
        raise ValueError(f"{path} is not a readable HDF5 file ({why}); {_FIX}") from None


@contextmanager
def _reading(path: Path) -> Iterator[Any]:
    """The open file; a read that fails (a damaged file) is a ValueError naming it."""
    with open_hdf5(path) as file:
        try:
            yield file
        except OSError as err:
            why = " ".join(str(err).split())
            raise ValueError(f"{path} cannot be read ({why}); {_FIX}") from None


def read_json_list(path: Path) -> list:
    """A JSON file holding a non-empty list (torchmeta's ``{split}_labels.json``)."""
    try:  # a regular file only (a FIFO is refused, not waited on), strict JSON
        items = read_json(path, what="class list")
    except (OSError, FileError) as err:
        why = " ".join(str(err).split())
        raise ValueError(f"{why}; {_FIX}") from None
    if not isinstance(items, list) or not items:
        raise ValueError(f"{path} must hold a non-empty JSON list of class names; {_FIX}")
    return items


def class_names(path: Path) -> list[str]:
    """The class names a ``{split}_labels.json`` lists: distinct strings, in file order."""
    names = read_json_list(path)
    if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise ValueError(f"{path} must list distinct class names (strings); {_FIX}")
    return names


def _member(file: Any, path: Path, key: str) -> Any:
    """``file[key]``, or a ValueError naming the file and the missing key."""
    try:
        return file[key]
    except KeyError:
        raise ValueError(f"{path} has no {key}; {_FIX}") from None


def class_arrays(
    path: Path, group: str, names: list[str], side: int
) -> tuple[list[np.ndarray], list[Any]]:
    """Each class's images ``uint8 [n, side, side, 3]`` from ``path[group/name]``.

    ``group`` may be empty (names are then paths from the file's root).

    Returns:
        The arrays in ``names``' order, and each class dataset's attributes (as dicts).

    Raises:
        ValueError: a class missing from the file, or a dataset of another dtype or shape.
    """
    arrays, attributes = [], []
    with _reading(path) as file:
        for name in names:
            key = f"{group}/{name}" if group else name
            dataset = _member(file, path, key)
            data = dataset[()] if hasattr(dataset, "dtype") else None
            arrays.append(image_array(path, data, side, key))
            attributes.append(dict(dataset.attrs))
    return arrays, attributes


def encoded_classes(path: Path, group: str, names: list[str]) -> tuple[list[int], list[dict]]:
    """How many encoded images each class of ``path[group]`` holds, and its attributes.

    Each class is a 1-d dataset of variable-length uint8 arrays (torchmeta's
    tiered-ImageNet: one PNG file's bytes each).

    Raises:
        ValueError: a class missing, empty, or not a 1-d dataset of uint8 byte strings.
    """
    counts, attributes = [], []
    with _reading(path) as file:
        import h5py  # importable: open_hdf5 imported it

        for name in names:
            dataset = _member(file, path, f"{group}/{name}")
            kind = h5py.check_vlen_dtype(dataset.dtype) if hasattr(dataset, "dtype") else None
            if kind != np.uint8 or dataset.ndim != 1 or len(dataset) == 0:
                raise ValueError(
                    f"{path}: {group}/{name} must be a non-empty list of PNG byte strings "
                    f"(variable-length uint8); {_FIX}"
                )
            counts.append(len(dataset))
            attributes.append(dict(dataset.attrs))
    return counts, attributes


def read_encoded(path: Path, group: str, names: list[str]) -> list[bytes]:
    """Every encoded image of the classes ``names``, class after class, as bytes."""
    with _reading(path) as file:
        return [
            np.asarray(item, dtype=np.uint8).tobytes()
            for name in names
            for item in file[f"{group}/{name}"][()]
        ]
