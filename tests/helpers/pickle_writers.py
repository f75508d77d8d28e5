"""Pickles as the published files were written, and hostile ones, for the loader tests.

* `py2_dumps`: what Python 2's cPickle wrote at protocol 2 (Ren et al.'s, CIFAR-100's,
  MetaOptNet's files): every string a Python 2 ``str`` (BINSTRING opcodes), numpy's
  functions under numpy 1's module ``numpy.core.multiarray``.
* `numpy1_dumps`: what Python 3 with numpy 1 writes: numpy 2's pickle with numpy 1's module
  names (``numpy.core`` for ``numpy._core``), at any protocol.
* `payloads`: pickles whose loading would create ``marker`` (each names a different
  callable a hostile file could use).
"""

from __future__ import annotations

import builtins
import io
import os
import pickle
import pickletools
import struct
from typing import Any

_NUMPY1 = {
    "numpy._core.multiarray": "numpy.core.multiarray",
    "numpy._core.numeric": "numpy.core.numeric",
}


class _Python2Pickler(pickle._Pickler):
    dispatch = dict(pickle._Pickler.dispatch)

    def save_py2_str(self, obj: str | bytes) -> None:
        data = obj if isinstance(obj, bytes) else obj.encode("latin1")
        if len(data) < 256:
            self.write(pickle.SHORT_BINSTRING + bytes([len(data)]) + data)
        else:
            self.write(pickle.BINSTRING + struct.pack("<i", len(data)) + data)
        self.memoize(obj)

    dispatch[bytes] = save_py2_str
    dispatch[str] = save_py2_str

    def save_global(self, obj: Any, name: str | None = None) -> None:
        module = obj.__module__
        module = {**_NUMPY1, "builtins": "__builtin__"}.get(module, module)
        self.write(pickle.GLOBAL + f"{module}\n{name or obj.__qualname__}\n".encode())
        self.memoize(obj)


def py2_dumps(obj: Any) -> bytes:
    """``obj`` pickled as Python 2 (cPickle, protocol 2) with numpy 1 wrote it."""
    buffer = io.BytesIO()
    _Python2Pickler(buffer, protocol=2).dump(obj)
    return buffer.getvalue()


def numpy1_dumps(obj: Any, protocol: int) -> bytes:
    """``obj`` pickled at ``protocol`` as numpy 1 names its functions (``numpy.core``)."""
    data = pickle.dumps(obj, protocol=protocol)
    ops = list(pickletools.genops(data))
    ends = [pos for _, _, pos in ops[1:]] + [len(data)]
    # Frames (protocol 4+) hold their length: drop them, rename, and let optimize re-frame.
    data = b"".join(data[pos:end] for (op, _, pos), end in zip(ops, ends) if op.name != "FRAME")
    for new, old in _NUMPY1.items():
        data = data.replace(f"{new}\n".encode(), f"{old}\n".encode())  # protocols 0-3
        short = pickle.SHORT_BINUNICODE
        data = data.replace(  # protocols 4-5: length-prefixed names
            short + bytes([len(new)]) + new.encode(), short + bytes([len(old)]) + old.encode()
        )
    return pickletools.optimize(data)


class _Call:
    """Pickles as ``function(*args)``: what a hostile file's ``__reduce__`` says. Callable,
    so that one call's result can be the function of another (a chain)."""

    def __init__(self, function: Any, *args: Any) -> None:
        self.function, self.args = function, args

    def __call__(self) -> None:  # never called: only pickled
        raise AssertionError("a payload object is only pickled")

    def __reduce__(self) -> tuple:
        return self.function, self.args


def _name(function: Any, protocol: int) -> str:
    """``module.name`` as a pickle of ``protocol`` names ``function``."""
    module = function.__module__
    return (
        f"{'__builtin__' if module == 'builtins' and protocol < 3 else module}.{function.__name__}"
    )


def payloads(marker: str, protocol: int = 2) -> dict[str, bytes]:
    """Pickles that create the file ``marker`` when loaded, by the first global each names."""
    code = f"open({marker!r}, 'w').close()"
    system = _Call(builtins.getattr, _Call(builtins.__import__, "os"), "system")
    calls = {
        _name(builtins.exec, protocol): _Call(builtins.exec, code),
        _name(builtins.eval, protocol): _Call(builtins.eval, code),
        _name(os.system, protocol): _Call(os.system, f"touch '{marker}'"),
        _name(builtins.getattr, protocol): _Call(system, f"touch '{marker}'"),  # a chain
    }
    return {name: pickle.dumps(call, protocol=protocol) for name, call in calls.items()}


def payload_object(marker: str) -> Any:
    """An object whose unpickling creates ``marker`` (for containers that pickle it)."""
    return _Call(builtins.exec, f"open({marker!r}, 'w').close()")


def hidden(marker: str, wrap: Any, protocol: int = 2) -> tuple[str, bytes]:
    """A payload inside a container of the published format, ``wrap(payload)``: the name
    it is refused by and the pickle."""
    return _name(builtins.exec, protocol), pickle.dumps(
        wrap(payload_object(marker)), protocol=protocol
    )
