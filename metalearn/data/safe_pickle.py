"""Reading the benchmarks' published pickles without running code from them.

A pickle names functions for the loader to call (``__reduce__``): ``pickle.load`` imports and
calls whatever the file names, so a doctored data file runs its payload before any check.
The formats metalearn reads (learn2learn's and Ren et al.'s mini-ImageNet caches, Ren et
al.'s tiered-ImageNet files, CIFAR-100's python release, MetaOptNet's CIFAR-FS, FC100 and
mini-ImageNet pickles) hold only dicts, lists, tuples, sets, strings, bytes, numbers and
numpy arrays. `load_pickle` resolves exactly the names those need, as numpy 1 and numpy 2
write them, with the Python 2 spellings; any other name stops the load with one line naming
the file and the name, before anything is called.
"""

from __future__ import annotations

import builtins
import codecs
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["PICKLE_NAMES", "load_pickle"]


def _latin1_encode(text: str, encoding: str = "latin1") -> bytes:
    """``_codecs.encode`` as Python 3 pickles bytes at protocol 0-2, for latin-1 only."""
    if codecs.lookup(encoding).name != "iso8859-1":
        raise pickle.UnpicklingError(f"_codecs.encode with encoding {encoding!r}")
    return text.encode("latin1")


# numpy's array pickle calls: taken from numpy's own reductions, so they are the installed
# numpy's functions whichever module path (numpy.core in numpy 1, numpy._core in 2) a file
# names.
_RECONSTRUCT = np.empty(0).__reduce__()[0]  # (ndarray, shape, dtype) then __setstate__
_SCALAR = np.float64(0).__reduce__()[0]  # (dtype, raw bytes)
_FROMBUFFER = np.empty(0).__reduce_ex__(5)[0]  # protocol 5: (buffer, dtype, shape, order)
_ALLOWED: dict[tuple[str, str], Any] = {
    **{(f"{m}.multiarray", "_reconstruct"): _RECONSTRUCT for m in ("numpy.core", "numpy._core")},
    **{(f"{m}.multiarray", "scalar"): _SCALAR for m in ("numpy.core", "numpy._core")},
    **{(f"{m}.numeric", "_frombuffer"): _FROMBUFFER for m in ("numpy.core", "numpy._core")},
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
    ("_codecs", "encode"): _latin1_encode,
    **{(b, n): getattr(builtins, n) for b in ("builtins", "__builtin__")  # Python 2's name
       for n in ("set", "frozenset", "bytearray")},
}  # fmt: skip
PICKLE_NAMES = tuple(sorted(f"{module}.{name}" for module, name in _ALLOWED))
"""Every global a published pickle may name (``module.name``); anything else is refused."""


class _Refused(Exception):
    """A global outside the allow-list (kept apart from the file's own errors)."""


class _RestrictedUnpickler(pickle.Unpickler):
    # Safe on untrusted files: every global a pickle names goes through find_class, which
    # returns only the allow-list's objects and refuses anything else before it is called.
    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise _Refused(f"{module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"persistent id {pid!r}")


def load_pickle(path: str | os.PathLike, *, encoding: str = "latin1") -> Any:
    """Unpickle one published data file, refusing any name outside `PICKLE_NAMES`.

    Args:
        path: the file.
        encoding: how Python 2 ``str`` objects are decoded: ``"latin1"`` (the default:
            text as str, numpy's array bytes intact; Python 3 pickles are unaffected) or
            ``"bytes"`` (CIFAR-100's release, whose keys are byte strings).

    Returns:
        The unpickled object (dicts, lists, tuples, sets, strings, bytes, numbers, arrays).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file names anything else (one line naming the file and the name),
            or is not a readable pickle.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; see docs/datasets.md for the layout")
    with open(path, "rb") as f:
        try:
            return _RestrictedUnpickler(f, encoding=encoding).load()
        except _Refused as refused:
            raise ValueError(
                f"{path}: refusing to unpickle {refused}: the published data files hold only "
                "dicts, lists, strings, numbers and numpy arrays, so this file is not one of "
                "them and may run code; delete it and re-download it from its source "
                "(docs/datasets.md)"
            ) from None
        except Exception as err:  # truncated, foreign or malformed: name the file, then stop
            raise ValueError(
                f"{path} is not a readable pickle ({type(err).__name__}: "
                f"{' '.join(str(err).split())}); it is "
                "truncated or not the published file: re-download it (docs/datasets.md)"
            ) from None
