"""A typed command line from an experiment's argument dataclass.

Each field becomes ``--field-name`` (``--field_name`` too, the form ``wandb agent`` passes:
``--inner_lr=0.3``); its type drives parsing (``bool`` fields become
``--flag`` / ``--no-flag``, ``Literal`` fields get choices, ``X | None`` accepts ``none``),
and the string literal under each field is its ``--help`` text, so the dataclass stays the
one place an argument is documented. A mistyped flag is answered with the closest ones.

Why not tyro (measured with tyro 1.0.17): it parses ``--inner_lr=0.3`` and suggests flags
for typos too, but its preset helper, ``tyro.extras.overridable_config_cli``, takes the
preset as a positional subcommand (``omniglot_maml.py paper-5w1s``) and refuses the
``--preset paper-5w1s`` form every documented command line uses, and a resumed run needs
the saved arguments as the defaults (``base=``), which this module does in one line.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
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

        optional.__name__ = getattr(parse, "__name__", "value")  # argparse's error names it

        return optional, choices
    if origin is typing.Literal:
        return type(args[0]), list(args)
    if tp in (int, float, str):
        return tp, None
    raise TypeError(f"unsupported argument type {tp!r}; use int, float, str, bool, Literal")


class _Parser(argparse.ArgumentParser):
    """argparse that answers an unknown flag with the closest known ones."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if message.startswith("unrecognized arguments:"):
            known = [s for a in self._actions for s in a.option_strings if "_" not in s]
            hints = []
            for word in message.split(":", 1)[1].split():
                flag = word.split("=", 1)[0].replace("_", "-")
                if flag.startswith("--"):
                    close = difflib.get_close_matches(flag, known, n=3, cutoff=0.6)
                    hints += [f"{flag}: did you mean {' or '.join(close)}?"] if close else []
            message = "; ".join([message, *hints])
        super().error(message)


def parse_dataclass(
    cls: type[T],
    argv: Sequence[str] | None = None,
    *,
    description: str | None = None,
    presets: Mapping[str, Mapping[str, Any]] | None = None,
    base: T | None = None,
) -> T:
    """Parse ``argv`` into an instance of the dataclass ``cls``.

    Args:
        cls: a dataclass whose fields all have defaults.
        argv: the arguments (``sys.argv[1:]`` when None).
        description: ``--help``'s opening text.
        presets: named groups of field values, applied when ``cls`` has a ``preset`` field
            naming one (``--preset NAME``); flags given on the command line win over it.
        base: an instance whose values stand in for the defaults (a resumed run's saved
            arguments): only the flags given change it, and no preset is applied.

    Returns:
        The dataclass instance.
    """
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    defaults = _defaults(cls, argv, presets, base)
    parser = _Parser(description=description)
    for f in dataclasses.fields(cls):
        flags = ["--" + f.name.replace("_", "-")] + (["--" + f.name] if "_" in f.name else [])
        # argparse %-formats help strings: a literal "95%" must reach it as "95%%".
        help_text = f"{docs.get(f.name, '')} (default: {defaults[f.name]})".replace("%", "%%")
        if hints[f.name] is bool:
            action: dict[str, Any] = {"action": argparse.BooleanOptionalAction}
        else:
            parse, choices = _converter(hints[f.name])
            action = {"type": parse, "choices": choices}
        parser.add_argument(*flags, **action, default=defaults[f.name], help=help_text,
                            dest=f.name)  # fmt: skip
    return cls(**vars(parser.parse_args(argv)))


def _defaults(
    cls: type,
    argv: Sequence[str] | None,
    presets: Mapping[str, Mapping[str, Any]] | None,
    base: Any,
) -> dict[str, Any]:
    """Each field's value when its flag is not given: ``base``'s, else the field default
    under the chosen preset (read from ``argv`` first, so ``--preset X --help`` shows X)."""
    if base is not None:
        return {f.name: getattr(base, f.name) for f in dataclasses.fields(cls)}
    defaults = {
        f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
        for f in dataclasses.fields(cls)
    }
    if presets and "preset" in defaults:
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--preset", default=defaults["preset"])
        name = pre.parse_known_args(argv)[0].preset
        if name in presets:  # an unknown name is refused by the full parser's choices
            defaults.update(presets[name], preset=name)
    return defaults
