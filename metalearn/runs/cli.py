"""A typed command line from an argument dataclass, parsed by tyro.

Each leaf field of the dataclass is a flag named after it, ``--field-name`` (``--field_name``
too, the form ``wandb agent`` passes: ``--inner_lr=0.3``), whatever group it sits in: an
experiment's arguments are nested dataclasses (data, model, learner, training, tracking,
system), which ``--help`` shows as groups, and every leaf name is unique, so the flags stay
flat (tyro's ``OmitArgPrefixes``). The string literal under each field is its help text.
Types drive parsing: ``bool`` fields are ``--flag`` / ``--no-flag`` and also take
``--flag=True`` / ``--flag=False`` (what a W&B sweep passes), ``Literal`` fields take their
choices, ``X | None`` takes ``None`` (or ``none``). A ``bool | None`` field (none: the
learner's default) takes ``--flag True`` / ``--flag False``, and ``--flag`` alone and
``--no-flag`` as a switch's.

Defaults come from an instance: a preset applied to the dataclass's defaults (``--preset
NAME``, read from the command line first so ``--preset X --help`` shows X's values), or a
resumed run's saved arguments (``base=``). A mistake is one line on stderr and exit code 2:
an unknown flag is answered with the closest known ones.

Flat names are also how the rest of a run speaks of its arguments: presets, checkpoints, the
W&B config, ``--resume`` and ``metalearn-grid`` use `flatten` / `unflatten`.

A program whose reader leaves (``metalearn-compare ... | head -1``) ends quietly:
`quiet_on_closed_stdout` around every ``metalearn-*`` tool's ``main`` and the experiments'
`metalearn.runs.lifecycle.run_cli` turn the ``BrokenPipeError`` of the next write into exit
status `CLOSED_STDOUT`, 141, what a shell reports for a program that SIGPIPE ended (``yes |
head -1`` under ``set -o pipefail``): the output was cut short, and a script can tell; no
traceback and no "Exception ignored" line at exit (stdout then points at the null device).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import io
import os
import signal
import sys
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar

__all__ = ["CLOSED_STDOUT", "flag", "flag_value", "flat_fields", "flatten", "parse_dataclass",
           "quiet_on_closed_stdout", "replace_flat", "silence_stdout", "unflatten"]  # fmt: skip

T = TypeVar("T")
P = ParamSpec("P")

CLOSED_STDOUT = 128 + signal.SIGPIPE
"""The exit status of a program whose stdout was closed by its reader: 141, as a shell reports
a program that SIGPIPE ended."""


def quiet_on_closed_stdout(main: Callable[P, int | None]) -> Callable[P, int]:
    """``main`` (a tool's ``main(argv) -> status``), ending with `CLOSED_STDOUT` and nothing
    printed when its stdout is a pipe whose reader has left.

    The output is flushed before ``main``'s status is returned, so a write held in the buffer
    fails here, not in the interpreter's exit (where it would print "Exception ignored").
    """

    @functools.wraps(main)
    def quiet(*args: P.args, **kwargs: P.kwargs) -> int:
        try:
            status = main(*args, **kwargs)
            sys.stdout.flush()
        except BrokenPipeError:
            silence_stdout()
            return CLOSED_STDOUT
        return 0 if status is None else status

    return quiet


def silence_stdout() -> None:
    """Point stdout at the null device (after its reader left), so that what is still
    buffered, and anything printed later, is dropped instead of failing again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):  # no descriptor: a captured stdout
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (the process's stdout from now on)
    finally:
        os.close(devnull)


def flat_fields(cls: type) -> dict[str, tuple[str, ...]]:
    """Each leaf field's name -> its path through the nested dataclasses of ``cls``.

    Raises:
        TypeError: two leaves share a name (flags would be ambiguous).
    """
    paths: dict[str, tuple[str, ...]] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            for name, path in flat_fields(tp).items():
                _add(paths, name, (f.name, *path))
        else:
            _add(paths, f.name, (f.name,))
    return paths


def _add(paths: dict[str, tuple[str, ...]], name: str, path: tuple[str, ...]) -> None:
    if name in paths:
        raise TypeError(f"argument {name!r} appears twice ({paths[name]} and {path})")
    paths[name] = path


def flatten(obj: Any) -> dict[str, Any]:
    """A (nested) argument dataclass instance as ``{leaf name: value}``."""
    flat: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            flat.update(flatten(value))
        else:
            flat[f.name] = value
    return flat


def unflatten(cls: type[T], flat: Mapping[str, Any], base: T | None = None) -> T:
    """An instance of ``cls`` with the leaves in ``flat`` set, the rest from ``base`` (or the
    dataclass defaults).

    Raises:
        ValueError: a name that is not a leaf of ``cls`` (named, with the closest ones).
    """
    paths = flat_fields(cls)
    if unknown := [k for k in flat if k not in paths]:
        hints = [f"did you mean {' or '.join(c)}?" for k in unknown
                 if (c := difflib.get_close_matches(k, list(paths), n=2))]  # fmt: skip
        raise ValueError(f"unknown argument {', '.join(unknown)}; {' '.join(hints)}".strip("; "))
    return _build(cls, {k: flat[k] for k in flat}, paths, base)


def _build(cls: type, flat: Mapping[str, Any], paths: Mapping, base: Any) -> Any:
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        inner_base = getattr(base, f.name) if base is not None else None
        if dataclasses.is_dataclass(tp):
            values[f.name] = _build(tp, flat, paths, inner_base)
        elif f.name in flat:
            values[f.name] = flat[f.name]
        elif base is not None:
            values[f.name] = inner_base
    if base is None:
        defaults = cls()
        for f in dataclasses.fields(cls):
            values.setdefault(f.name, getattr(defaults, f.name))
    return cls(**values)


def replace_flat(obj: T, **changes: Any) -> T:
    """``obj`` with the named leaves changed (`dataclasses.replace` through the groups)."""
    return unflatten(type(obj), changes, base=obj)


def flag(name: str) -> str:
    """The flag of a leaf field: ``inner_lr`` -> ``--inner-lr``."""
    return "--" + name.replace("_", "-")


def parse_dataclass(
    cls: type[T],
    argv: Sequence[str] | None = None,
    *,
    description: str | None = None,
    presets: Mapping[str, Mapping[str, Any]] | None = None,
    base: T | None = None,
) -> T:
    """Parse ``argv`` into an instance of the (nested) dataclass ``cls``.

    Args:
        cls: a dataclass; nested dataclasses are groups. A field without a default is a
            required flag (with ``presets``, every field needs a default).
        argv: the arguments (``sys.argv[1:]`` when None).
        description: ``--help``'s opening text.
        presets: named groups of leaf values, applied when ``cls`` has a ``preset`` leaf
            naming one (``--preset NAME``); flags given on the command line win over it.
        base: an instance whose values stand in for the defaults (a resumed run's saved
            arguments): only the flags given change it, and no preset is applied.

    Returns:
        The dataclass instance. A bad command line prints one line and exits with code 2.
    """
    import tyro

    argv = list(sys.argv[1:] if argv is None else argv)
    default = base if base is not None else _preset_default(cls, argv, presets)
    argv = _normalised(cls, argv)
    if not {"-h", "--help"} & set(argv):
        _check_flags(cls, argv)
    captured = io.StringIO()
    try:
        with _redirect_errors(captured, argv):
            return tyro.cli(tyro.conf.OmitArgPrefixes[cls], args=argv, default=default,
                            description=description)  # fmt: skip
    except SystemExit as stop:
        if stop.code not in (0, None):
            _fail(_one_line(captured.getvalue()))
        raise


@contextlib.contextmanager
def _redirect_errors(buffer: io.StringIO, argv: Sequence[str]) -> Iterator[None]:
    """Collect tyro's error panel (``--help`` still prints)."""
    if {"-h", "--help"} & set(argv):
        yield
        return
    with contextlib.redirect_stderr(buffer), contextlib.redirect_stdout(buffer):
        yield


def _preset_default(cls: type, argv: Sequence[str], presets: Mapping | None) -> Any:
    """The defaults under the preset named on the command line; None without presets (each
    field's own default, and a field without one is a required flag)."""
    if not presets or "preset" not in flat_fields(cls):
        return None
    default = cls()
    given = flag_value(argv, "--preset")
    name = flatten(default)["preset"] if given is None else given
    if name not in presets:  # refused by the parser's choices
        return default
    return unflatten(cls, {**presets[name], "preset": name}, base=default)


def flag_value(argv: Sequence[str], name: str) -> str | None:
    """The value ``argv`` gives flag ``name`` (``--name VALUE`` or ``--name=VALUE``; the last
    one given wins, as the parser takes it), read before parsing; None when not given."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def _leaf_types(cls: type) -> dict[str, Any]:
    types_: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            types_.update(_leaf_types(tp))
        else:
            types_[f.name] = tp
    return types_


def _optional(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    return origin in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def _optional_bool(tp: Any) -> bool:
    return _optional(tp) and set(typing.get_args(tp)) == {bool, type(None)}


def _normalised(cls: type, argv: Sequence[str]) -> list[str]:
    """``--flag=True``/``--flag=False`` as ``--flag``/``--no-flag``, ``none`` as ``None``;
    an optional switch (``bool | None``) given alone as ``--flag True``, ``--no-flag`` as
    ``--flag False``."""
    leaf = {flag(n): tp for n, tp in _leaf_types(cls).items()}
    leaf.update({"--" + n: tp for n, tp in _leaf_types(cls).items()})
    out: list[str] = []
    for i, arg in enumerate(argv):
        name, eq, value = arg.partition("=")
        tp = leaf.get(name)
        negated = leaf.get("--" + name[5:]) if name.startswith("--no-") and not eq else None
        if _optional_bool(negated):
            out += ["--" + name[5:], "False"]
        elif _optional_bool(tp) and not eq and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out += [arg, "True"]
        elif tp is bool and eq:
            if value.lower() not in ("true", "false"):
                _fail(f"{arg}: {name} is a switch; give {name}=True or {name}=False, or "
                      f"{flag(name[2:])} / --no-{name[2:].replace('_', '-')}")  # fmt: skip
            out.append(name if value.lower() == "true" else "--no-" + name[2:].replace("_", "-"))
        elif tp is not None and _optional(tp) and eq and value == "none":
            out.append(f"{name}=None")
        elif arg == "none" and i > 0 and _optional(leaf.get(argv[i - 1], int)):
            out.append("None")
        else:
            out.append(arg)
    return out


def _check_flags(cls: type, argv: Sequence[str]) -> None:
    """Refuse an unknown flag in one line, with the closest known ones."""
    names = _leaf_types(cls)
    known = {flag(n) for n in names} | {"--" + n for n in names}
    known |= {"--no-" + n.replace("_", "-") for n, tp in names.items()
              if tp is bool or _optional_bool(tp)}  # fmt: skip
    for arg in argv:
        if not arg.startswith("--"):
            continue
        name = arg.split("=", 1)[0]
        if name not in known:
            shown = sorted(k for k in known if "_" not in k)
            close = difflib.get_close_matches(name.replace("_", "-"), shown, n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(close)}?" if close else "; see --help"
            _fail(f"unknown option {name}{hint}")


def _one_line(text: str) -> str:
    """tyro's error panel as one line: its message, without the help pointers."""
    lines = [ln.strip(" │╭╮╰╯─") for ln in text.splitlines()]
    kept = []
    for line in lines:
        if line.startswith(("For full helptext", "Argument helptext")):
            break
        if line.strip("-"):  # a rule of dashes says nothing; a flag's leading -- stays
            kept.append(line)
    return " ".join(kept[1:] or kept) or "invalid command line; see --help"


def _fail(message: str) -> typing.NoReturn:
    prog = sys.argv[0].rsplit("/", 1)[-1] or "metalearn"
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)
