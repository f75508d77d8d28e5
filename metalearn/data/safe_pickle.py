"""Reading the benchmarks' published pickles without running code from them.

A pickle names functions for the loader to call (``__reduce__``): ``pickle.load`` imports and
calls whatever the file names, so a doctored data file runs its payload before any check.
The formats metalearn reads (learn2learn's and Ren et al.'s mini-ImageNet caches, Ren et
al.'s tiered-ImageNet files, CIFAR-100's python release, MetaOptNet's CIFAR-FS, FC100 and
mini-ImageNet pickles) hold only dicts, lists, tuples, sets, strings, bytes, numbers and
numpy arrays. `load_pickle` resolves exactly the names those need, as numpy 1 and numpy 2
write them, with the Python 2 spellings; any other name stops the load with one line naming
the file and the name, before anything is called. Arrays' dtypes are rebuilt from their
pickled description by numpy's own constructor and refused if any part holds Python objects
(numpy's ``dtype.__setstate__`` trusts its state: a forged one declares an object field at
any offset, a wild pointer when read), so what comes back holds plain numbers only.
"""

from __future__ import annotations

import builtins
import codecs
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from metalearn.files import open_regular

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
_PLAIN_KINDS = frozenset("biufcSUVMm")  # numbers, bytes, text, raw bytes, dates: no pointers
_MAX_FIELDS = 4096


class _Refused(Exception):
    """A global or a value outside what the published files hold (kept apart from the
    file's own errors)."""


class _NdarrayName:
    """What ``numpy.ndarray`` resolves to: only `_reconstruct`'s first argument, never a
    callable (``ndarray(shape, dtype, buffer, offset, strides)`` could alias memory)."""


def _reconstruct(cls: Any, shape: Any, code: Any) -> np.ndarray:
    """numpy's ``_reconstruct`` as its pickles call it: an empty ``(0,)`` array of bytes that
    the array's state (``ndarray.__setstate__``: shape, checked dtype, raw data) then fills."""
    if cls is not _NdarrayName or shape != (0,) or code not in (b"b", "b"):
        raise _Refused(f"numpy _reconstruct{(cls, shape, code)!r:.80}")
    return _RECONSTRUCT(np.ndarray, (0,), b"b")


def _dtype(code: Any, align: Any = False, copy: Any = False) -> np.dtype:
    """``numpy.dtype(code, align, copy)`` for a type code string (how numpy pickles one),
    refusing one that holds Python objects (a Python 2 file read with ``encoding="bytes"``
    gives the code as bytes)."""
    if isinstance(code, bytes):
        code = code.decode("ascii", "replace")
    if not isinstance(code, str) or not isinstance(align, bool) or not isinstance(copy, bool):
        raise _Refused(f"numpy.dtype{(code, align, copy)!r:.80}")
    return _plain(np.dtype(code, align, copy))


def _plain(dtype: np.dtype) -> np.dtype:
    """``dtype`` itself, refused if any part of it is an object (a pointer when read)."""
    if dtype.hasobject or dtype.kind not in _PLAIN_KINDS:
        raise _Refused(f"the dtype {dtype!r} (Python objects)")
    return dtype


def _checked_dtype(base: np.dtype, state: Any) -> np.dtype:
    """A new dtype built from a pickled dtype's state, never numpy's ``__setstate__``.

    numpy writes ``(3, byteorder, subarray, names, fields, itemsize, alignment, flags)``;
    its ``__setstate__`` trusts that, so a forged state of allow-listed names can declare an
    object field at any offset (a wild pointer on read). Here the dtype is rebuilt from the
    state's description by numpy's constructor, which checks sizes and offsets; the state
    must be the one numpy writes for that dtype (no hand-set flags or sizes), and no part
    may hold objects: structured dtypes of plain numbers only.
    """
    if not (isinstance(state, tuple) and len(state) == 8 and state[0] == 3):
        raise _Refused(f"the dtype state {state!r:.80}")
    _, order, subarray, names, fields, itemsize, _, _ = state
    order = order.decode("ascii", "replace") if isinstance(order, bytes) else order
    if order not in ("<", ">", "|", "="):
        raise _Refused(f"the dtype byte order {order!r:.20}")
    if subarray is not None:
        if not (isinstance(subarray, tuple) and len(subarray) == 2
                and isinstance(subarray[0], np.dtype)):  # fmt: skip
            raise _Refused(f"the dtype sub-array {subarray!r:.80}")
        dtype = np.dtype((_plain(subarray[0]), subarray[1]))
    elif names is not None:
        dtype = _structured(names, fields, itemsize)
    else:
        dtype = base if order in ("|", "=") else base.newbyteorder(order)
    given = (3, order, subarray, names, fields, itemsize, *state[6:])
    if given != dtype.__reduce__()[2]:  # flags or sizes numpy would not write: hand-built
        raise _Refused(f"a hand-built dtype state {state!r:.100} (numpy writes "
                       f"{dtype.__reduce__()[2]!r:.100} for {dtype!r:.40})")  # fmt: skip
    return _plain(dtype)


def _structured(names: Any, fields: Any, itemsize: Any) -> np.dtype:
    """A structured dtype from its names and ``{name: (dtype, offset)}`` fields."""
    ok = (isinstance(names, tuple) and isinstance(fields, dict) and len(names) <= _MAX_FIELDS
          and all(isinstance(n, str) for n in names) and set(names) == set(fields)
          and isinstance(itemsize, int))  # fmt: skip
    if not ok:
        raise _Refused(f"the structured dtype {names!r:.80}")
    for name in names:
        field = fields[name]
        if not (isinstance(field, tuple) and len(field) == 2 and isinstance(field[0], np.dtype)
                and isinstance(field[1], int)):  # fmt: skip
            raise _Refused(f"the dtype field {name!r:.40}: {field!r:.80}")
    return np.dtype({"names": list(names), "formats": [_plain(fields[n][0]) for n in names],
                     "offsets": [fields[n][1] for n in names], "itemsize": itemsize})  # fmt: skip


_ALLOWED: dict[tuple[str, str], Any] = {
    **{(f"{m}.multiarray", "_reconstruct"): _reconstruct for m in ("numpy.core", "numpy._core")},
    **{(f"{m}.multiarray", "scalar"): _SCALAR for m in ("numpy.core", "numpy._core")},
    **{(f"{m}.numeric", "_frombuffer"): _FROMBUFFER for m in ("numpy.core", "numpy._core")},
    ("numpy", "ndarray"): _NdarrayName,
    ("numpy", "dtype"): _dtype,
    ("_codecs", "encode"): _latin1_encode,
    **{(b, n): getattr(builtins, n) for b in ("builtins", "__builtin__")  # Python 2's name
       for n in ("set", "frozenset", "bytearray")},
}  # fmt: skip
PICKLE_NAMES = tuple(sorted(f"{module}.{name}" for module, name in _ALLOWED))
"""Every global a published pickle may name (``module.name``); anything else is refused."""


class _RestrictedUnpickler(pickle._Unpickler):
    # Safe on untrusted files: every global a pickle names goes through find_class, which
    # returns only the allow-list's objects and refuses anything else before it is called;
    # a dtype's state goes through _checked_dtype, never numpy's __setstate__. This is the
    # pure-Python unpickler, whose BUILD opcode can be overridden; the published files are a
    # few large byte strings and arrays, so its speed does not matter.
    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise _Refused(f"{module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"persistent id {pid!r:.80}")

    def load_build(self) -> None:
        inst = self.stack[-2]
        if not isinstance(inst, np.dtype):
            return pickle._Unpickler.load_build(self)
        checked = _checked_dtype(inst, self.stack.pop())
        self.stack[-1] = checked
        for key, value in list(self.memo.items()):  # the memo holds the dtype before its state
            if value is inst:
                self.memo[key] = checked
        return None

    dispatch[pickle.BUILD[0]] = load_build


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
        ValueError: the file names anything else, or holds a dtype with Python objects or a
            dtype state numpy's pickles never write (one line naming the file and what was
            refused), is not a readable pickle, or is not a regular file (a FIFO, ...).
    """
    path = Path(path)
    if not os.path.lexists(path):
        raise FileNotFoundError(f"{path} is missing; see docs/datasets.md for the layout")
    with open_regular(path, what="data file") as f:
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
