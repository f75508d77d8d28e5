"""What an exported program (``.pt2``) may hold, read before ``torch.export.load`` reads it.

``torch.export.load`` runs code from a ``.pt2`` in several ways besides the pickles that
`metalearn.deploy.archive.load_program` forces to tensors:

* a constant declared ``"use_pickle": true`` as an opaque object is read with plain
  ``pickle`` (its ``loads``), and a custom (TorchBind) object with TorchScript's unpickler;
* a member under ``data/aotinductor/`` is a shared library that the load opens (its
  constructor runs), whatever the file is named;
* every symbolic shape's ``expr_str`` is parsed by ``sympy.sympify``, which evaluates
  Python (``__import__('os').system(...)`` is an expression);
* the program's ``guards_code`` is compiled (``exec``) into the module ``program.module()``
  builds and runs on every call;
* a node's target is resolved by attribute lookups from ``torch``, which reaches any
  module torch imports (``torch.os.system``).

`check_program_archive` reads the member list and the JSON configs and refuses, in one line
naming the member, anything outside what ``torch.export.save`` writes for a plain program:
its fixed members, weights and tensor constants (never pickled), sample inputs, extra
files, and model graphs whose expressions, guards and targets pass the grammars below.
AOTInductor members are refused unless ``trust=True``, and then only after every member
name has passed `metalearn.deploy.archive.check_members`.
"""

from __future__ import annotations

import ast
import json
import os
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from metalearn.deploy.archive import check_members, check_trusted

__all__ = ["check_program_archive", "check_targets"]

# Members torch.export.save writes (below the archive's root folder); {m} is a model name.
_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"
_FIXED = {"archive_format", "archive_version", "byteorder", ".data/version",
          ".data/serialization_id"}  # fmt: skip
_ALLOWED = [
    re.compile(p)
    for p in (
        rf"models/{_NAME}\.json",
        rf"data/weights/{_NAME}_weights_config\.json",
        r"data/weights/weight_\d+",
        rf"data/constants/{_NAME}_constants_config\.json",
        r"data/constants/tensor_\d+",
        rf"data/sample_inputs/{_NAME}\.pt",
        rf"extra/{_NAME}",
    )
]
_AOTI = "data/aotinductor/"
_PAYLOAD = {"data/weights/": "weight_", "data/constants/": "tensor_"}

# sympy constructors a serialized shape expression may call (torch writes srepr forms such
# as Mul(Integer(4), Symbol('s77', positive=True, integer=True))).
_SYMPY_CALLS = frozenset(
    "Symbol Integer Float Rational Add Mul Pow Max Min Mod Abs Eq Ne Lt Le Gt Ge "
    "Equality Unequality StrictLessThan LessThan StrictGreaterThan GreaterThan And Or Not "
    "Piecewise ExprCondPair FloorDiv ModularIndexing Where PythonMod CleanDiv CeilToInt "
    "FloorToInt CeilDiv LShift RShift PowByNatural FloatPow FloatTrueDiv IntTrueDiv "
    "IsNonOverlappingAndDenseIndicator TruncToFloat TruncToInt RoundToInt RoundDecimal "
    "ToFloat Identity BitwiseFn_bitwise_and BitwiseFn_bitwise_or BitwiseFn_bitwise_xor".split()
) | {f"OpaqueUnaryFn_{f}" for f in "sqrt cos cosh sin sinh tan tanh asin acos atan exp log "
     "asinh log2".split()}  # fmt: skip
_SYMPY_CONSTANTS = frozenset("oo zoo nan true false".split())
_DIGITS = r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?inf|nan"
_STRING_ARGS = {"Symbol": re.compile(r"[A-Za-z_][A-Za-z0-9_]*"), "Float": re.compile(_DIGITS)}
_BARE_SYMBOL = re.compile(r"[a-z]+\d+")  # s77, u0: the str() form older torch writes
_ARITHMETIC = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow,
               ast.USub, ast.UAdd, ast.Not, ast.And, ast.Or, ast.Eq, ast.NotEq, ast.Lt,
               ast.LtE, ast.Gt, ast.GtE)  # fmt: skip
_STRUCTURE = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.Load)

# Node targets: operators (OpOverloads), Python's arithmetic on sizes, math, torch.sym_*.
_OPERATOR_TARGETS = frozenset(
    "add sub mul truediv floordiv mod pow neg pos abs eq ne lt le gt ge and_ or_ not_ "
    "getitem".split()
)
_TARGET = re.compile(
    r"torch\.ops\.[A-Za-z_][A-Za-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?"
    r"|torch\.sym_[a-z_]+|math\.[a-z_0-9]+|_operator\.(" + "|".join(_OPERATOR_TARGETS) + ")"
)


def _refuse(path: Path, member: str, why: str) -> ValueError:
    return ValueError(
        f"{path}: refusing member {member!r}: {why}; torch.export.save never writes it for "
        "a plain program, so the file was altered or is not an exported program: export it "
        "again from its checkpoint"
    )


def check_program_archive(path: str | os.PathLike, *, trust: bool = False) -> None:
    """Refuse a ``.pt2`` whose loading could run code, before torch reads any of it.

    Args:
        path: the ``.pt2`` file.
        trust: allow AOTInductor members (native code the load opens), for packages whose
            author you trust; their names are still checked first.

    Raises:
        ValueError: a member name that leaves the archive's folder, a member torch does not
            write for a plain program, a pickled weight or constant, a custom or opaque
            object, or a model graph with an unsafe expression, guard or target: one line
            naming the member.
        UntrustedPackageError: an AOTInductor member without ``trust=True``
            (`metalearn.deploy.archive.check_trusted`).
    """
    path = Path(path)
    check_members(path)
    check_trusted(path, trust)
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            member = _inside_root(info.filename)
            if info.is_dir() or member.startswith(_AOTI):
                continue
            if member not in _FIXED and not any(p.fullmatch(member) for p in _ALLOWED):
                raise _refuse(path, info.filename, "not a member of an exported program")
            elif member.endswith("_config.json"):
                _check_payload_config(path, info.filename, member, archive.read(info))
            elif member.startswith("models/"):
                _check_model(path, info.filename, archive.read(info))


def _inside_root(name: str) -> str:
    """A member's name below the archive's root folder (``archive/``, ``package/``, ...)."""
    parts = PurePosixPath(name).parts
    return "/".join(parts[1:]) if len(parts) > 1 else name


def _check_payload_config(path: Path, name: str, member: str, raw: bytes) -> None:
    """Weights and constants: stored as raw tensor bytes, never pickled, no objects."""
    prefix = next(p for folder, p in _PAYLOAD.items() if member.startswith(folder))
    config = _json(path, name, raw).get("config", {})
    for fqn, entry in config.items() if isinstance(config, dict) else []:
        if not isinstance(entry, dict) or entry.get("use_pickle") is not False:
            raise _refuse(path, name, f"entry {fqn!r} is pickled (use_pickle is not false)")
        if not re.fullmatch(rf"{prefix}\d+", str(entry.get("path_name"))):
            raise _refuse(
                path, name, f"entry {fqn!r} is {entry.get('path_name')!r}, not a {prefix}N tensor"
            )


def _check_model(path: Path, name: str, raw: bytes) -> None:
    """A model graph: sympy expressions, guards and node targets within their grammars."""
    model = _json(path, name, raw)
    for expr in _values(model, "expr_str"):
        if not _is_sympy_expression(expr):
            raise _refuse(path, name, f"shape expression {expr[:80]!r} is not sympy arithmetic")
    for guard in model.get("guards_code") or []:
        if not isinstance(guard, str) or not _is_size_guard(guard):
            raise _refuse(path, name, f"guard {str(guard)[:80]!r} is not a size comparison")
    for target in _values(model, "target"):
        if not _TARGET.fullmatch(target) or "__" in target:
            raise _refuse(path, name, f"node target {target[:80]!r} is not an operator")


def _json(path: Path, name: str, raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _refuse(path, name, "not JSON") from None
    if not isinstance(value, dict):
        raise _refuse(path, name, "not a JSON object")
    return value


def _values(tree: Any, key: str) -> Iterator[str]:
    """Every value stored under ``key`` anywhere in a JSON tree (non-strings as ``repr``)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            if k == key and not isinstance(v, (dict, list)):
                yield v if isinstance(v, str) else repr(v)
            else:
                yield from _values(v, key)
    elif isinstance(tree, list):
        for item in tree:
            yield from _values(item, key)


def _is_sympy_expression(text: str) -> bool:
    """True for arithmetic on sympy constructors, numbers and symbol names only: nothing
    ``sympy.sympify`` could evaluate as other Python (no attributes, subscripts, strings
    other than a Symbol's name or a Float's digits)."""
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):
        return False
    strings_ok = {
        id(arg)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        for arg in node.args
        if node.func.id in _STRING_ARGS
        and isinstance(arg, ast.Constant)
        and isinstance(arg.value, str)
        and _STRING_ARGS[node.func.id].fullmatch(arg.value)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            ok = isinstance(node.func, ast.Name) and node.func.id in _SYMPY_CALLS
        elif isinstance(node, ast.Name):
            ok = (
                node.id in _SYMPY_CALLS
                or node.id in _SYMPY_CONSTANTS
                or bool(_BARE_SYMBOL.fullmatch(node.id))
            )
        elif isinstance(node, ast.keyword):
            ok = node.arg is not None and isinstance(node.value, ast.Constant)
        elif isinstance(node, ast.Constant):
            ok = isinstance(node.value, (bool, int, float)) or id(node) in strings_ok
        else:
            ok = isinstance(node, (*_STRUCTURE, *_ARITHMETIC))
        if not ok:
            return False
    return True


def _is_size_guard(text: str) -> bool:
    """True for comparisons of input sizes and integers: ``L['x'].size()[0] == 3``, with
    arithmetic, ``and``/``or``/``not``, and ``.size()``, ``.stride()``,
    ``.storage_offset()`` or ``.dim()`` of an input ``L[...]`` as the only calls."""
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            ok = (isinstance(node.func, ast.Attribute) and not node.args and not node.keywords
                  and node.func.attr in ("size", "stride", "storage_offset", "dim"))  # fmt: skip
        elif isinstance(node, ast.Attribute):
            ok = node.attr in ("size", "stride", "storage_offset", "dim")
        elif isinstance(node, ast.Subscript):
            ok = isinstance(node.slice, ast.Constant)
        elif isinstance(node, ast.Name):
            ok = node.id == "L"
        elif isinstance(node, ast.Constant):
            ok = isinstance(node.value, (bool, int, float, str))
        else:
            ok = isinstance(node, (*_STRUCTURE, *_ARITHMETIC))
        if not ok:
            return False
    return True


def check_targets(path: str | os.PathLike, program: Any) -> None:
    """After loading: every call in every graph of ``program`` is a torch operator or
    arithmetic on sizes (what the target grammar admitted resolved to nothing else).

    Raises:
        ValueError: a call to anything else, named.
    """
    import math
    import operator

    import torch

    allowed = {getattr(operator, n) for n in _OPERATOR_TARGETS} | {
        getattr(math, n) for n in dir(math) if callable(getattr(math, n))
    } | {getattr(torch, n) for n in dir(torch) if n.startswith("sym_")}  # fmt: skip
    operators = (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)
    for module in program.graph_module.modules():
        graph = getattr(module, "graph", None)
        for node in graph.nodes if graph is not None else ():
            target = node.target
            if node.op == "call_function" and not (
                isinstance(target, operators) or target in allowed
            ):
                raise ValueError(
                    f"{Path(path)}: refusing node {node.name!r}, which calls {target!r}, not a "
                    "torch operator; export the program again from its checkpoint"
                )
