"""A typed command line from an experiment's argument dataclass.

Each field becomes ``--field-name``; its type drives parsing (``bool`` fields become
``--flag`` / ``--no-flag``, ``Literal`` fields get choices, ``X | None`` accepts ``none``),
and the string literal under each field is its ``--help`` text, so the dataclass stays the
one place an argument is documented.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

__all__ = ["field_docs", "parse_dataclass"]

T = TypeVar("T")


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass, read from its source."""
    try:
        body = ast.parse(inspect.getsource(cls)).body[0].body
    except (OSError, TypeError, IndexError):
        return {}
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _converter(tp: Any) -> tuple[Any, list[Any] | None]:
    """(parse function, choices) for a field's resolved type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        inner = next(a for a in args if a is not type(None))
        parse, choices = _converter(inner)

        def optional(text: str) -> Any:
            return None if text.lower() == "none" else parse(text)

        return optional, choices
    if origin is typing.Literal:
        return type(args[0]), list(args)
    if tp in (int, float, str):
        return tp, None
    raise TypeError(f"unsupported argument type {tp!r}; use int, float, str, bool, Literal")


def parse_dataclass(
    cls: type[T],
    argv: Sequence[str] | None = None,
    *,
    description: str | None = None,
    presets: Mapping[str, Mapping[str, Any]] | None = None,
) -> T:
    """Parse ``argv`` into an instance of the dataclass ``cls``.

    Args:
        cls: a dataclass whose fields all have defaults.
        argv: the arguments (``sys.argv[1:]`` when None).
        description: ``--help``'s opening text.
        presets: named groups of field values, applied when ``cls`` has a ``preset`` field
            naming one (``--preset NAME``); flags given on the command line win over it.

    Returns:
        The dataclass instance.
    """
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    parser = argparse.ArgumentParser(description=description)
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        flag = "--" + f.name.replace("_", "-")
        # argparse %-formats help strings: a literal "95%" must reach it as "95%%".
        help_text = f"{docs.get(f.name, '')} (default: {default})".replace("%", "%%")
        if hints[f.name] is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            parse, choices = _converter(hints[f.name])
            parser.add_argument(flag, type=parse, choices=choices, default=None, help=help_text)
        parser.set_defaults(**{f"_default_{f.name}": default})
    namespace = vars(parser.parse_args(argv))
    values = {f.name: namespace[f"_default_{f.name}"] for f in dataclasses.fields(cls)}
    explicit = {k: v for k, v in namespace.items() if k in values and v is not None}
    preset = explicit.get("preset", values.get("preset"))
    if presets and preset is not None:
        if preset not in presets:
            raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(presets)}")
        values.update(presets[preset])
    values.update(explicit)
    return cls(**values)
